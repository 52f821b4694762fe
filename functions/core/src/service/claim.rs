//! ClaimVM (`POST /v1/claims`): hand out one AVAILABLE VM, or replay the lease a
//! `request_id` already created.
//!
//! Never calls flintlock: everything the response needs was stored at provisioning. Never
//! writes outside the one claim statement, so a claim that fails has changed nothing.

use crate::api::ClaimResponse;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{HookFailurePolicy, LeaseId, Phase, PoolRef, RequestId};
use crate::error::ApiError;
use crate::store::{self, ClaimOutcome, HookLease, HostRow, LeaseView, VmRow};

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
    let lease_id = LeaseId::generate();
    let prepared = match state.config.db_prepare_claim {
        true => Some(store::lease_claim_prepare(&conn).await?),
        false => None,
    };
    let outcome = store::lease_claim(
        &conn,
        prepared.as_ref(),
        &req.pool,
        lease_id.as_str(),
        req.request_id.as_ref().map(RequestId::as_str),
        &principal.name,
    )
    .await?;
    match outcome {
        ClaimOutcome::PoolNotFound => Err(pool_not_found(&req.pool)),
        ClaimOutcome::Existing(view) => {
            let rid = req.request_id.as_ref().ok_or_else(|| ApiError::internal("a replay needs a request_id"))?;
            replay(state, &req, rid, *view)
        }
        ClaimOutcome::NoVmAvailable => {
            state.metrics.claim_failure(&req.pool, "exhausted");
            Err(exhausted(&req.pool))
        }
        ClaimOutcome::NeedsPreLeaseHook => {
            drop(conn);
            claim_with_hook(state, principal, req).await
        }
        // A concurrent claim with our request_id committed first; answer with its lease.
        ClaimOutcome::DuplicateRequestId => replay_winner(state, principal, &req).await,
        ClaimOutcome::Claimed(view) => {
            state.metrics.claim(&req.pool, false);
            let vm = view.vm.as_ref().ok_or_else(|| ApiError::internal("claimed lease without its VM"))?;
            Ok(ClaimResponse::new(&view, vm, false))
        }
    }
}

fn exhausted(pool: &PoolRef) -> ApiError {
    ApiError::ResourceExhausted(format!("pool {pool} has no AVAILABLE VM; retry after the Retry-After delay"))
}

/// Answers with the lease a concurrent claim of the same request_id created, or ABORTED if
/// it already ended.
async fn replay_winner(state: &AppState, principal: &Principal, req: &ClaimRequest) -> Result<ClaimResponse, ApiError> {
    let rid = req.request_id.as_ref().ok_or_else(|| ApiError::internal("a duplicate needs a request_id"))?;
    let conn = state.conn().await?;
    match store::lease_get_by_request_id(&conn, &principal.name, rid.as_str()).await? {
        Some(view) => replay(state, req, rid, view),
        None => {
            state.metrics.claim_failure(&req.pool, "aborted");
            Err(ApiError::Aborted(format!("concurrent claim for request_id {:?} already ended, retry", rid.as_str())))
        }
    }
}

pub fn pool_not_found(pool: &PoolRef) -> ApiError {
    ApiError::NotFound(format!("pool {pool} not found"))
}

/// The two-phase claim of a pool with `pre_lease_commands` (the seed ADR): transaction 1
/// takes an AVAILABLE VM to PRE_LEASE_HOOK_RUNNING; the hook runs outside any transaction;
/// transaction 2 writes the lease. Everything after transaction 1 runs detached from the
/// request, so a client that disconnects cannot leave the VM stuck or half cleaned up.
async fn claim_with_hook(
    state: &AppState,
    principal: &Principal,
    req: ClaimRequest,
) -> Result<ClaimResponse, ApiError> {
    let taken = {
        let conn = state.conn().await?;
        store::vm_claim_for_hook(&conn, &req.pool).await?
    };
    if !taken.pool_found {
        return Err(pool_not_found(&req.pool));
    }
    let Some(vm) = taken.vm else {
        state.metrics.claim_failure(&req.pool, "exhausted");
        return Err(exhausted(&req.pool));
    };
    let (state, principal) = (state.clone(), principal.clone());
    super::detached(async move { finish_hook_claim(&state, &principal, &req, vm, taken.host, &taken.commands).await })
        .await
}

async fn finish_hook_claim(
    state: &AppState,
    principal: &Principal,
    req: &ClaimRequest,
    vm: VmRow,
    host: Option<HostRow>,
    commands: &[String],
) -> Result<ClaimResponse, ApiError> {
    let started = std::time::Instant::now();
    let timeout = state.config.hooks.command_timeout;
    for cmd in commands {
        let outcome = match (&host, &vm.uid) {
            (Some(h), Some(uid)) => state.flintlock.exec(&h.endpoint(), uid, cmd, timeout).await,
            _ => Err(crate::flintlock::FlintlockError::Config {
                host: vm.flintlock_host.clone(),
                message: "the VM has no flintlock uid or its host is not registered".into(),
            }),
        };
        // Sanitised and capped: the reason is stored in VM_HOOK_FAILED and sent in the answer.
        if let Some(reason) = crate::flintlock::hook_failure(cmd, &outcome) {
            return Err(pre_lease_hook_failed(state, req, &vm, host.as_ref(), reason).await);
        }
    }
    let lease_id = LeaseId::generate();
    let rid = req.request_id.as_ref().map(RequestId::as_str);
    let outcome = {
        let conn = state.conn().await?;
        store::lease_insert_after_hook(&conn, &vm.id, lease_id.as_str(), rid, &principal.name).await?
    };
    match outcome {
        HookLease::VmTaken => Err(vm_taken(state, req, &vm)),
        HookLease::DuplicateRequestId => {
            // The loser gives its VM back (the hook ran once on it; accepted) and answers
            // with the winner's lease.
            let given_back = {
                let conn = state.conn().await?;
                store::vm_transition(&conn, &vm.id, Phase::PreLeaseHookRunning, Phase::Available, None, None).await?
            };
            if !given_back {
                return Err(vm_taken(state, req, &vm));
            }
            replay_winner(state, principal, req).await
        }
        HookLease::Claimed(view) => {
            state.metrics.claim(&req.pool, false);
            state.metrics.hook_succeeded(
                &req.pool.namespace,
                &req.pool.name,
                "pre_lease",
                started.elapsed().as_secs_f64(),
            );
            let vm = view.vm.as_ref().ok_or_else(|| ApiError::internal("claimed lease without its VM"))?;
            Ok(ClaimResponse::new(&view, vm, false))
        }
    }
}

fn vm_taken(state: &AppState, req: &ClaimRequest, vm: &VmRow) -> ApiError {
    state.metrics.claim_failure(&req.pool, "aborted");
    ApiError::Aborted(format!("vm {} was deleted during the claim (its pool was deleted?), retry", vm.id))
}

/// Applies the pool's hook-failure policy to a VM whose pre-lease hook failed. If the VM was
/// taken meanwhile (a forced pool delete made it DELETING), that is not a hook failure: the
/// claim is ABORTED and the VM left to its deleter.
async fn pre_lease_hook_failed(
    state: &AppState,
    req: &ClaimRequest,
    vm: &VmRow,
    host: Option<&HostRow>,
    reason: String,
) -> ApiError {
    let policy = {
        let conn = match state.conn().await {
            Ok(c) => c,
            Err(e) => return e,
        };
        match store::pool_get(&conn, &req.pool).await {
            Ok(Some((p, _))) => p.hook_failure_policy,
            Ok(None) => return vm_taken(state, req, vm),
            Err(e) => return e.into(),
        }
    };
    let to = match policy {
        HookFailurePolicy::DeleteAndReplace => Phase::Deleting,
        HookFailurePolicy::Quarantine => Phase::Quarantined,
    };
    let payload = serde_json::json!({"hook": "pre_lease", "reason": reason, "policy": policy});
    let moved = match state.conn().await {
        Ok(conn) => store::vm_transition(
            &conn,
            &vm.id,
            Phase::PreLeaseHookRunning,
            to,
            None,
            Some((crate::domain::EventType::VmHookFailed, &payload)),
        )
        .await
        .map_err(ApiError::from),
        Err(e) => Err(e),
    };
    match moved {
        Ok(true) => {}
        Ok(false) => return vm_taken(state, req, vm),
        Err(e) => return e,
    }
    state.metrics.hook_failed(&req.pool.namespace, &req.pool.name, "pre_lease");
    state.metrics.claim_failure(&req.pool, "hook_failed");
    tracing::warn!(vm = %vm.id, %reason, %policy, "pre-lease hook failed");
    if to == Phase::Deleting {
        // Best effort now; a VM whose delete fails stays DELETING for the reconciler.
        let vm = VmRow { phase: Phase::Deleting, ..vm.clone() };
        if let Err(e) = crate::teardown::finish_vm_delete(&state.flintlock, &state.db, &vm, host).await {
            tracing::warn!(vm = %vm.id, error = %e, "VM of a failed hook left DELETING for the reconciler");
        }
    }
    ApiError::Internal {
        message: format!(
            "pre-lease hook failed on vm {}: {reason}; the VM was {}; retry the claim (the same request_id claims a fresh VM)",
            vm.id,
            if to == Phase::Deleting { "deleted" } else { "quarantined" }
        ),
        cause: reason,
    }
}
