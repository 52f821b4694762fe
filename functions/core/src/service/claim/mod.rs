//! ClaimVM (`POST /v1/claims`): hand out one AVAILABLE VM, or replay the lease a
//! `request_id` already created.
//!
//! One flintlock call by default: a GetMicroVM of the VM taken, before its lease is written
//! (`POOLMGR_CLAIM_VERIFY`, issue 23 finding 1), on the two-phase path a pre-lease hook's
//! claim takes; a pool's hook commands prove the VM exists by running. Everything the
//! response carries was stored at provisioning. With the check off, the common claim (no
//! hook, no duplicate) is the one claim statement, one round trip; the rarer paths — a duplicate still committing, a lease that
//! expired before the sweep, a hook claim — take a few more statements, each of which
//! changes nothing or one thing the next one relies on.
//!
//! Never answers 429 to a claim whose request_id a concurrent claim is committing, and never
//! replays an expired lease as live (issue 14, items 1 and 2; `docs/design-notes.md`).

use chrono::{DateTime, Utc};

use crate::api::ClaimResponse;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{LeaseId, Phase, PoolRef, RequestId};
use crate::error::ApiError;
use crate::store::{self, ClaimOutcome, LeaseRow, LeaseView};

mod hook;

use hook::claim_with_hook;

#[derive(Clone)]
pub struct ClaimRequest {
    pub pool: PoolRef,
    pub request_id: Option<RequestId>,
}

/// What a claim already did, so each detour happens at most once per request (and whether
/// its principal's live leases are under a quota).
#[derive(Default)]
struct Rounds {
    /// The principal has a live-lease quota: each take runs in a transaction that locks and
    /// counts it ([`store::principal_quota_lock`]).
    quota: bool,
    /// It expired its request_id's lease (found expired, not yet swept).
    expired: bool,
    /// It waited for the claims in flight on the pool after finding no VM.
    waited: bool,
    /// Times its hook claim's first transaction lost the request_id to a concurrent one.
    raced: u32,
}

/// "Now" for a lease's liveness: the clock's if a test moved it, else the database's, as it
/// was when the statement that read the lease ran.
fn now_for(state: &AppState, db_now: DateTime<Utc>) -> DateTime<Utc> {
    state.clock.now_param().unwrap_or(db_now)
}

/// Answers a claim from an existing, live lease of this principal's `request_id`.
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
        _ => Err(aborted(
            state,
            req,
            "LEASE_ENDING",
            format!("lease {} for request_id {:?} is being released, retry", view.lease.lease_id, rid.as_str()),
        )),
    }
}

fn aborted(state: &AppState, req: &ClaimRequest, reason: &'static str, message: String) -> ApiError {
    state.metrics.claim_failure(&req.pool, "aborted");
    ApiError::Aborted(message).reason(reason)
}

/// The lease this request_id already has: replayed while live. An expired one (past
/// `expires_at`, not yet swept) is never replayed: the claim expires it — exactly as the sweep
/// would — and `Ok(None)` tells the caller to claim afresh (design-notes, item 2).
async fn answer_existing(
    state: &AppState,
    req: &ClaimRequest,
    view: LeaseView,
    now: DateTime<Utc>,
    rounds: &mut Rounds,
) -> Result<Option<ClaimResponse>, ApiError> {
    let rid = req.request_id.as_ref().ok_or_else(|| ApiError::internal("a replay needs a request_id"))?;
    if view.lease.expires_at > now {
        return replay(state, req, rid, view).map(Some);
    }
    if rounds.expired {
        // It was expired once already and is back: not one this claim should fight over.
        return Err(aborted(
            state,
            req,
            "LEASE_ENDING",
            format!("lease {} for request_id {:?} has expired, retry", view.lease.lease_id, rid.as_str()),
        ));
    }
    rounds.expired = true;
    expire_lease(state, &view.lease).await?;
    Ok(None)
}

async fn expire_lease(state: &AppState, lease: &LeaseRow) -> Result<(), ApiError> {
    let conn = state.conn().await?;
    // None: the sweep expired it first; either way it is gone.
    if let Some(l) = store::lease_expire_one(&conn, &lease.lease_id, state.clock.now_param()).await? {
        let held = (Utc::now() - l.claimed_at).as_seconds_f64();
        state.metrics.release(&l.pool_ref(), "expiry", Some(held));
        tracing::info!(pool = %l.pool_ref(), lease = %l.lease_id, vm = %l.vm_id, "expired lease of a retried request_id expired by its claim");
    }
    Ok(())
}

/// A claim with a request_id that found no VM: the VMs it skipped may be held by a claim of
/// the same request_id whose lease (or hook VM) its snapshot could not see yet. It waits once
/// for the claims in flight on the pool and looks again (`true`). `false`: no request_id, or
/// it waited already: the pool is exhausted.
async fn waited_for_claimers(state: &AppState, req: &ClaimRequest, rounds: &mut Rounds) -> Result<bool, ApiError> {
    if req.request_id.is_none() || rounds.waited {
        return Ok(false);
    }
    rounds.waited = true;
    let conn = state.conn().await?;
    store::vm_wait_for_claimers(&conn, &req.pool).await?;
    Ok(true)
}

/// ClaimVM, then the wake: a fresh claim (its pool may now be below its target, its demand
/// changed) or a refusal (recorded as demand first: `store::pool_record_refused`) wakes the
/// reconciler ([`crate::wake`]). A replay changes nothing and wakes nobody.
pub async fn claim(state: &AppState, principal: &Principal, req: ClaimRequest) -> Result<ClaimResponse, ApiError> {
    // Kept for the refusal path only; the key is built there, not on every claim.
    let (pool, request_id) = (req.pool.clone(), req.request_id.clone());
    let limits = principal_limits(state, principal).await?;
    if limits.as_ref().is_some_and(|l| !l.allows(&req.pool)) {
        // Out of the principal's scope: exactly what an unknown pool answers (no existence
        // leak), and no demand recorded.
        return Err(pool_not_found(&req.pool));
    }
    let quota = limits.is_some_and(|l| l.max_live_leases.is_some());
    let answer = claim_vm(state, principal, req, quota).await;
    match &answer {
        Ok(r) if !r.replayed => {
            state.wake("claim").await;
        }
        Err(ApiError::ResourceExhausted(_)) => {
            let key = match &request_id {
                Some(rid) => format!("{}:{}", principal.name, rid.as_str()),
                None => format!("-:{}", crate::domain::random_uuid()),
            };
            // Best effort: a refusal not counted only makes the demand look smaller.
            match state.conn().await {
                Ok(c) => {
                    if let Err(e) = store::pool_record_refused(&c, &pool, &key).await {
                        tracing::warn!(pool = %pool, error = %e, "cannot record a refused claim as demand");
                    }
                }
                Err(e) => tracing::warn!(pool = %pool, error = ?e, "cannot record a refused claim as demand"),
            }
            state.wake("refused claim").await;
        }
        _ => {}
    }
    answer
}

/// The scope and quota of a client principal; `None` for an admin or a client without limits.
async fn principal_limits(state: &AppState, principal: &Principal) -> Result<Option<crate::limits::Limits>, ApiError> {
    if principal.role != crate::auth::Role::Client {
        return Ok(None);
    }
    state.limits.of(&state.db, &principal.name).await
}

/// 404, exactly as for an unknown pool, when a client principal's scope leaves `pool` out
/// (a demand hint, like a claim).
pub async fn check_scope(state: &AppState, principal: &Principal, pool: &PoolRef) -> Result<(), ApiError> {
    match principal_limits(state, principal).await? {
        Some(l) if !l.allows(pool) => Err(pool_not_found(pool)),
        _ => Ok(()),
    }
}

fn quota_exceeded(state: &AppState, req: &ClaimRequest, principal: &Principal, max: i32) -> ApiError {
    state.metrics.claim_failure(&req.pool, "quota");
    ApiError::ResourceExhausted(format!(
        "principal {} holds {max} live leases, its quota (max_live_leases): release one, or ask an admin to raise the quota, then retry",
        principal.name
    ))
    .reason("QUOTA_EXCEEDED")
}

/// Locks and counts the principal's quota in the caller's transaction
/// ([`store::principal_quota_lock`]). `None`: below it, the claim may take a VM. At it, a
/// claim whose request_id already has a lease (or, with `in_flight`, a hook claim running)
/// gets that to replay or wait for; any other is refused with QUOTA_EXCEEDED.
async fn check_quota(
    state: &AppState,
    tx: &impl store::Executor,
    principal: &Principal,
    req: &ClaimRequest,
    in_flight: bool,
) -> Result<Option<store::HookClaimState>, ApiError> {
    let Some((max, live)) = store::principal_quota_lock(tx, &principal.name).await? else {
        return Ok(None);
    };
    if live < i64::from(max) {
        return Ok(None);
    }
    if let Some(rid) = &req.request_id {
        let found = store::claim_get_by_request_id(tx, &principal.name, rid.as_str()).await?;
        if found.existing.is_some() || (in_flight && found.in_flight.is_some()) {
            return Ok(Some(found));
        }
    }
    Err(quota_exceeded(state, req, principal, max))
}

/// One claim statement under the principal's quota: in one transaction, the quota's row
/// locked and its count taken, then the claim — unless the count is at the quota, when only
/// a replay of the request_id's existing lease is answered.
async fn claim_under_quota(
    state: &AppState,
    principal: &Principal,
    req: &ClaimRequest,
    lease_id: &str,
) -> Result<ClaimOutcome, ApiError> {
    let rid = req.request_id.as_ref().map(RequestId::as_str);
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    if let Some(found) = check_quota(state, &tx, principal, req, false).await? {
        let view = found.existing.ok_or_else(|| ApiError::internal("check_quota answered without the lease"))?;
        return Ok(ClaimOutcome::Existing { view: Box::new(view), db_now: found.db_now });
    }
    let outcome = store::lease_claim_on(&tx, &req.pool, lease_id, rid, &principal.name).await?;
    tx.commit().await?;
    Ok(outcome)
}

async fn claim_vm(
    state: &AppState,
    principal: &Principal,
    req: ClaimRequest,
    quota: bool,
) -> Result<ClaimResponse, ApiError> {
    let mut rounds = Rounds { quota, ..Rounds::default() };
    if state.config.hooks.claim_verify {
        // The VM is checked with its host before the lease is written (issue 23 finding 1):
        // the two-phase path, whose first transaction also answers replays.
        return claim_with_hook(state, principal, req, rounds).await;
    }
    loop {
        let lease_id = LeaseId::generate();
        let outcome = if rounds.quota {
            claim_under_quota(state, principal, &req, lease_id.as_str()).await?
        } else {
            let conn = state.conn().await?;
            store::lease_claim(
                &conn,
                state.config.db_prepare_claim,
                &req.pool,
                lease_id.as_str(),
                req.request_id.as_ref().map(RequestId::as_str),
                &principal.name,
            )
            .await?
        };
        match outcome {
            ClaimOutcome::PoolNotFound => return Err(pool_not_found(&req.pool)),
            ClaimOutcome::Existing { view, db_now } => {
                if let Some(r) = answer_existing(state, &req, *view, now_for(state, db_now), &mut rounds).await? {
                    return Ok(r);
                }
            }
            ClaimOutcome::NoVmAvailable => {
                if !waited_for_claimers(state, &req, &mut rounds).await? {
                    state.metrics.claim_failure(&req.pool, "exhausted");
                    return Err(exhausted(&req.pool));
                }
            }
            ClaimOutcome::NeedsPreLeaseHook => return claim_with_hook(state, principal, req, rounds).await,
            // A concurrent claim with our request_id committed first; answer with its lease.
            ClaimOutcome::DuplicateRequestId => return replay_winner(state, principal, &req).await,
            ClaimOutcome::Claimed(view) => {
                state.metrics.claim(&req.pool, false);
                let vm = view.vm.as_ref().ok_or_else(|| ApiError::internal("claimed lease without its VM"))?;
                return Ok(ClaimResponse::new(&view, vm, false));
            }
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
        // Just committed, so live: replayed as such.
        Some(view) => replay(state, req, rid, view),
        None => Err(aborted(
            state,
            req,
            "CONCURRENT_CLAIM_ENDED",
            format!("concurrent claim for request_id {:?} already ended, retry", rid.as_str()),
        )),
    }
}

pub fn pool_not_found(pool: &PoolRef) -> ApiError {
    ApiError::NotFound(format!("pool {pool} not found"))
}
