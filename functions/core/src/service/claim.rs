//! ClaimVM (`POST /v1/claims`): hand out one AVAILABLE VM, or replay the lease a
//! `request_id` already created.
//!
//! Never calls flintlock: everything the response needs was stored at provisioning. Never
//! writes outside the one claim statement, so a claim that fails has changed nothing.

use crate::api::ClaimResponse;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{LeaseId, Phase, PoolRef, RequestId};
use crate::error::ApiError;
use crate::store::{self, ClaimOutcome, LeaseView};

pub struct ClaimRequest {
    pub pool: PoolRef,
    pub request_id: Option<RequestId>,
}

/// Answers a claim from an existing lease of this principal's `request_id`.
fn replay(state: &AppState, req: &ClaimRequest, rid: &RequestId, view: LeaseView) -> Result<ClaimResponse, ApiError> {
    let lease_pool = view.lease.pool_ref();
    if lease_pool != req.pool {
        state.metrics.claim_failure(&req.pool, "request_id_other_pool");
        return Err(ApiError::InvalidArgument(format!(
            "request_id {:?} already holds lease {} on pool {lease_pool}; this claim is for pool {}: use a new request_id for another pool",
            rid.as_str(),
            view.lease.lease_id,
            req.pool
        )));
    }
    match &view.vm {
        Some(vm) if vm.phase != Phase::Deleting => {
            state.metrics.claim(&req.pool, true);
            Ok(ClaimResponse::new(&view, vm, true))
        }
        // A release marks the VM DELETING before flintlock confirms, and removes the VM row
        // before the lease row: either way the lease is ending.
        _ => {
            state.metrics.claim_failure(&req.pool, "aborted");
            Err(ApiError::Aborted(format!(
                "lease {} for request_id {:?} is being released, retry",
                view.lease.lease_id,
                rid.as_str()
            )))
        }
    }
}

pub async fn claim(state: &AppState, principal: &Principal, req: ClaimRequest) -> Result<ClaimResponse, ApiError> {
    let conn = state.conn().await?;
    if let Some(rid) = &req.request_id {
        let found = store::lease_lookup_for_claim(&**conn, &req.pool, &principal.name, rid.as_str()).await?;
        if !found.pool_found {
            return Err(pool_not_found(&req.pool));
        }
        if let Some(view) = found.existing {
            return replay(state, &req, rid, view);
        }
    }
    let lease_id = LeaseId::generate();
    let outcome = store::lease_claim(
        &**conn,
        &req.pool,
        lease_id.as_str(),
        req.request_id.as_ref().map(RequestId::as_str),
        &principal.name,
    )
    .await?;
    match outcome {
        ClaimOutcome::PoolNotFound => Err(pool_not_found(&req.pool)),
        ClaimOutcome::NoVmAvailable => {
            state.metrics.claim_failure(&req.pool, "exhausted");
            Err(ApiError::ResourceExhausted(format!(
                "pool {} has no AVAILABLE VM; retry after the Retry-After delay",
                req.pool
            )))
        }
        ClaimOutcome::DuplicateRequestId => {
            // A concurrent claim with our request_id committed first; answer with its lease.
            let rid = req.request_id.as_ref().expect("a duplicate needs a request_id");
            let found = store::lease_lookup_for_claim(&**conn, &req.pool, &principal.name, rid.as_str()).await?;
            match found.existing {
                Some(view) => replay(state, &req, rid, view),
                None => {
                    state.metrics.claim_failure(&req.pool, "aborted");
                    Err(ApiError::Aborted(format!(
                        "concurrent claim for request_id {:?} already ended, retry",
                        rid.as_str()
                    )))
                }
            }
        }
        ClaimOutcome::Claimed(view) => {
            state.metrics.claim(&req.pool, false);
            let vm = view.vm.as_ref().ok_or_else(|| ApiError::internal("claimed lease without its VM"))?;
            Ok(ClaimResponse::new(&view, vm, false))
        }
    }
}

pub fn pool_not_found(pool: &PoolRef) -> ApiError {
    ApiError::NotFound(format!("pool {pool} not found"))
}
