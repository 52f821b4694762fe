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

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::api::ClaimResponse;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{HookFailurePolicy, LeaseId, Phase, PoolRef, RequestId};
use crate::error::ApiError;
use crate::store::{self, ClaimOutcome, HookLease, HostRow, LeaseRow, LeaseView, StoreError, VmRow};

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

/// Where a hook claim's first transaction left it.
enum HookStep {
    /// It took a VM, ran the hook and answered (a lease, or the hook's failure as an error).
    Done(Box<ClaimResponse>),
    PoolNotFound,
    /// The request_id has a lease; nothing was taken.
    Existing(Box<LeaseView>, DateTime<Utc>),
    /// A claim with this request_id is running its hook on this VM; nothing was taken.
    InFlight(Box<VmRow>),
    NoVm,
    /// A concurrent first transaction with this request_id committed first; nothing was taken.
    Raced,
}

/// The two-phase claim of a pool with `pre_lease_commands` (the seed ADR): transaction 1
/// takes an AVAILABLE VM to PRE_LEASE_HOOK_RUNNING with this claim's request_id on it; the
/// hook runs outside any transaction; transaction 2 writes the lease.
///
/// Transaction 1 and everything after it run detached from the request: a client that
/// disconnects — even while transaction 1 is still in flight — cannot leave the VM in
/// PRE_LEASE_HOOK_RUNNING with nobody to finish the claim (issue 14, item 4). A duplicate
/// arriving while the hook runs takes no VM and runs no hook: it waits for the lease.
async fn claim_with_hook(
    state: &AppState,
    principal: &Principal,
    req: ClaimRequest,
    mut rounds: Rounds,
) -> Result<ClaimResponse, ApiError> {
    loop {
        let (st, pr, rq) = (state.clone(), principal.clone(), req.clone());
        let quota = rounds.quota;
        let step = super::detached(async move { take_and_finish(&st, &pr, &rq, quota).await }).await?;
        match step {
            HookStep::Done(resp) => return Ok(*resp),
            HookStep::PoolNotFound => return Err(pool_not_found(&req.pool)),
            HookStep::Existing(view, db_now) => {
                if let Some(r) = answer_existing(state, &req, *view, now_for(state, db_now), &mut rounds).await? {
                    return Ok(r);
                }
            }
            HookStep::InFlight(vm) => return wait_for_hook_claim(state, principal, &req, &vm).await,
            HookStep::NoVm => {
                if !waited_for_claimers(state, &req, &mut rounds).await? {
                    state.metrics.claim_failure(&req.pool, "exhausted");
                    return Err(exhausted(&req.pool));
                }
            }
            // The winner's first transaction is committed now: the next look finds it.
            HookStep::Raced if rounds.raced < 3 => rounds.raced += 1,
            HookStep::Raced => {
                return Err(aborted(
                    state,
                    &req,
                    "CONCURRENT_CLAIM_RACING",
                    "concurrent claims with this request_id keep racing, retry".into(),
                ));
            }
        }
    }
}

/// Transaction 1, then (when it took a VM) the hook and transaction 2.
async fn take_and_finish(
    state: &AppState,
    principal: &Principal,
    req: &ClaimRequest,
    quota: bool,
) -> Result<HookStep, ApiError> {
    let rid = req.request_id.as_ref().map(RequestId::as_str);
    let taken = if quota {
        // As `claim_under_quota`: the VM taken counts towards the quota until its lease
        // replaces it (the count includes claims running their hook).
        let mut conn = state.conn().await?;
        let tx = conn.transaction().await?;
        if let Some(found) = check_quota(state, &tx, principal, req, true).await? {
            return Ok(match (found.existing, found.in_flight) {
                (Some(view), _) => HookStep::Existing(Box::new(view), found.db_now),
                (None, Some(vm)) => HookStep::InFlight(Box::new(vm)),
                (None, None) => return Err(ApiError::internal("check_quota answered without a claim")),
            });
        }
        let taken = match store::vm_claim_for_hook(&tx, &req.pool, &principal.name, rid).await {
            Err(StoreError::UniqueViolation { .. }) => return Ok(HookStep::Raced),
            other => other?,
        };
        tx.commit().await?;
        taken
    } else {
        let conn = state.conn().await?;
        match store::vm_claim_for_hook(&conn, &req.pool, &principal.name, rid).await {
            Err(StoreError::UniqueViolation { .. }) => return Ok(HookStep::Raced),
            other => other?,
        }
    };
    if !taken.pool_found {
        return Ok(HookStep::PoolNotFound);
    }
    if let Some(view) = taken.existing {
        return Ok(HookStep::Existing(Box::new(view), taken.db_now));
    }
    if let Some(vm) = taken.in_flight {
        return Ok(HookStep::InFlight(Box::new(vm)));
    }
    let Some(vm) = taken.vm else {
        return Ok(HookStep::NoVm);
    };
    finish_hook_claim(state, principal, req, vm, taken.host, &taken.commands).await.map(|r| HookStep::Done(Box::new(r)))
}

/// Longest pause between two looks of a duplicate waiting for a hook claim's lease.
const HOOK_WAIT_MAX_PAUSE: Duration = Duration::from_millis(200);

/// A duplicate of a hook claim in flight on `vm`: it waits — at most the claim hook deadline,
/// the longest that claim's hooks may run — for that claim's lease and replays it. 409 ABORTED
/// (with Retry-After) if that claim ended without a lease (its hook failed, its VM was
/// deleted) or is still running when the wait is over.
async fn wait_for_hook_claim(
    state: &AppState,
    principal: &Principal,
    req: &ClaimRequest,
    vm: &VmRow,
) -> Result<ClaimResponse, ApiError> {
    let rid = req.request_id.as_ref().ok_or_else(|| ApiError::internal("a duplicate needs a request_id"))?;
    let until = Instant::now() + state.config.hooks.claim_hook_deadline;
    let mut pause = Duration::from_millis(10);
    loop {
        tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now()))).await;
        pause = (pause * 2).min(HOOK_WAIT_MAX_PAUSE);
        let found = {
            let conn = state.conn().await?;
            store::claim_get_by_request_id(&conn, &principal.name, rid.as_str()).await?
        };
        if let Some(view) = found.existing {
            if view.lease.expires_at <= now_for(state, found.db_now) {
                return Err(aborted(
                    state,
                    req,
                    "LEASE_ENDING",
                    format!("lease {} for request_id {:?} has expired, retry", view.lease.lease_id, rid.as_str()),
                ));
            }
            return replay(state, req, rid, view);
        }
        if found.in_flight.is_none() {
            return Err(aborted(
                state,
                req,
                "CONCURRENT_CLAIM_ENDED",
                format!(
                    "the concurrent claim for request_id {:?} ended without a lease (its pre-lease hook failed or vm {} was deleted), retry",
                    rid.as_str(),
                    vm.id
                ),
            ));
        }
        if Instant::now() >= until {
            return Err(aborted(
                state,
                req,
                "CONCURRENT_CLAIM_RUNNING",
                format!(
                    "a concurrent claim for request_id {:?} is still running the pre-lease hook on vm {}, retry after the Retry-After delay",
                    rid.as_str(),
                    vm.id
                ),
            ));
        }
    }
}

async fn finish_hook_claim(
    state: &AppState,
    principal: &Principal,
    req: &ClaimRequest,
    vm: VmRow,
    host: Option<HostRow>,
    commands: &[String],
) -> Result<ClaimResponse, ApiError> {
    let started = Instant::now();
    let hook_deadline = state.config.hooks.claim_hook_deadline;
    let deadline = started + hook_deadline;
    if commands.is_empty() {
        // A verified claim without hook commands (`POOLMGR_CLAIM_VERIFY`); with commands,
        // their exec finds a missing VM just as well.
        verify_vm(state, req, &vm, host.as_ref()).await?;
    }
    for cmd in commands {
        // Each command gets its own limit, but never more than what is left of the claim's
        // deadline: the whole hook must end well inside the function's timeout.
        let left = deadline.saturating_duration_since(Instant::now());
        let past_deadline = || {
            format!(
                "the pre-lease hook did not finish within the claim's deadline of {} s (POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS); `{cmd}` was cut short",
                hook_deadline.as_secs()
            )
        };
        let failure = if left.is_zero() {
            Some(past_deadline())
        } else {
            let limit = state.config.hooks.command_timeout.min(left);
            let run = async {
                match (&host, &vm.uid) {
                    (Some(h), Some(uid)) => state.flintlock.exec(&h.endpoint(), uid, cmd, limit).await,
                    _ => Err(crate::flintlock::FlintlockError::Config {
                        host: vm.flintlock_host.clone(),
                        message: "the VM has no flintlock uid or its host is not registered".into(),
                    }),
                }
            };
            // Dropping the exec at the deadline cancels its stream, which stops the command.
            match tokio::time::timeout(left, run).await {
                // A hung command, or a host that stopped answering mid-command? One
                // GetMicroVM tells: only a host that answers it makes this a hook failure.
                Err(_) => match probe_after_deadline(state, &vm, host.as_ref()).await {
                    Probe::Answers => Some(past_deadline()),
                    Probe::Unreachable(e) => return Err(hook_host_unreachable(state, req, &vm, Step::Hook, &e).await),
                    Probe::VmGone(e) => return Err(hook_vm_gone(state, req, &vm, Step::Hook, &e).await),
                },
                // In transit, or this function cannot open the host's secrets: not the VM's
                // failure either way; it goes back.
                Ok(Err(e)) if e.is_transport() || e.is_credentials() => {
                    return Err(hook_host_unreachable(state, req, &vm, Step::Hook, &e).await);
                }
                Ok(Err(e)) if e.is_not_found() => return Err(hook_vm_gone(state, req, &vm, Step::Hook, &e).await),
                // Sanitised and capped: the reason is stored in VM_HOOK_FAILED and sent back.
                Ok(outcome) => crate::flintlock::hook_failure(cmd, &outcome),
            }
        };
        if let Some(reason) = failure {
            return Err(pre_lease_hook_failed(state, req, &vm, host.as_ref(), reason).await);
        }
    }
    let lease_id = LeaseId::generate();
    let rid = req.request_id.as_ref().map(RequestId::as_str);
    let written = async {
        let conn = state.conn().await?;
        store::lease_insert_after_hook(&conn, &vm.id, lease_id.as_str(), rid, &principal.name, vm.hook_started_at)
            .await
            .map_err(ApiError::from)
    }
    .await;
    let outcome = match written {
        Ok(o) => o,
        Err(e) => {
            // The database failed between the two transactions. The hook ran to the end, so
            // the VM goes back to AVAILABLE rather than sit in PRE_LEASE_HOOK_RUNNING,
            // counted as claiming, until the abandon sweep. Should the lease have committed
            // after all (a statement timeout), the phase guard makes this a no-op and the
            // client's retry replays that lease.
            tracing::warn!(vm = %vm.id, error = %e, "writing the lease after a pre-lease hook failed; giving the VM back");
            let _ = give_back(state, &vm).await;
            return Err(e);
        }
    };
    match outcome {
        HookLease::VmTaken => Err(vm_taken(state, req, &vm)),
        HookLease::DuplicateRequestId => {
            // A claim of this request_id on a pool without hooks won meanwhile. The loser
            // gives its VM back (the hook ran once on it; accepted) and answers with the
            // winner's lease.
            if !give_back(state, &vm).await? {
                return Err(vm_taken(state, req, &vm));
            }
            replay_winner(state, principal, req).await
        }
        HookLease::Claimed(view) => {
            state.metrics.claim(&req.pool, false);
            if !commands.is_empty() {
                state.metrics.hook_succeeded(
                    &req.pool.namespace,
                    &req.pool.name,
                    "pre_lease",
                    started.elapsed().as_secs_f64(),
                );
            }
            let vm = view.vm.as_ref().ok_or_else(|| ApiError::internal("claimed lease without its VM"))?;
            Ok(ClaimResponse::new(&view, vm, false))
        }
    }
}

/// Which flintlock call of a two-phase claim met a missing VM or an unreachable host.
#[derive(Clone, Copy)]
enum Step {
    Hook,
    Verify,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::Hook => "the pre-lease hook",
            Step::Verify => "the claim's check (GetMicroVM)",
        }
    }
}

/// The verified claim's check (issue 23 finding 1): a GetMicroVM of the VM taken, bounded by
/// `POOLMGR_CLAIM_VERIFY_TIMEOUT_MS`. A VM its host does not know is lost (VM_LOST, 503); a
/// host that cannot be reached, or answers too late, gets the VM back and the claim 503.
async fn verify_vm(state: &AppState, req: &ClaimRequest, vm: &VmRow, host: Option<&HostRow>) -> Result<(), ApiError> {
    let (Some(h), Some(uid)) = (host, vm.uid.as_deref()) else {
        let e = crate::flintlock::FlintlockError::Config {
            host: vm.flintlock_host.clone(),
            message: "the VM has no flintlock uid or its host is not registered".into(),
        };
        return Err(hook_vm_gone(state, req, vm, Step::Verify, &e).await);
    };
    let limit = state.config.hooks.claim_verify_timeout.min(state.config.hooks.claim_hook_deadline);
    match ask_for_vm(state, h, uid, limit).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(hook_vm_gone(state, req, vm, Step::Verify, &vm_not_found(h, uid)).await),
        Err(e) => Err(hook_host_unreachable(state, req, vm, Step::Verify, &e).await),
    }
}

/// One GetMicroVM of `uid` on `h`, bounded by `limit`: whether the host has the VM. Past the
/// limit the host counts as unavailable (`POOLMGR_CLAIM_VERIFY_TIMEOUT_MS`).
async fn ask_for_vm(
    state: &AppState,
    h: &HostRow,
    uid: &str,
    limit: std::time::Duration,
) -> Result<bool, crate::flintlock::FlintlockError> {
    match tokio::time::timeout(limit, state.flintlock.get(&h.endpoint(), uid)).await {
        Ok(r) => r.map(|m| m.is_some()),
        Err(_) => Err(crate::flintlock::FlintlockError::Unavailable {
            host: h.name.clone(),
            message: format!(
                "GetMicroVM did not answer within {} ms (POOLMGR_CLAIM_VERIFY_TIMEOUT_MS)",
                limit.as_millis()
            ),
        }),
    }
}

/// The error a VM its host does not have is recorded with.
fn vm_not_found(h: &HostRow, uid: &str) -> crate::flintlock::FlintlockError {
    crate::flintlock::FlintlockError::Rpc {
        host: h.name.clone(),
        code: tonic::Code::NotFound,
        message: format!("microvm {uid} not found"),
    }
}

/// What a GetMicroVM said of a VM whose pre-lease command the claim's deadline cut short.
enum Probe {
    /// The host answered and has the VM: the command itself hung (the hook failed).
    Answers,
    /// The host did not answer within `POOLMGR_CLAIM_VERIFY_TIMEOUT_MS`, or not at all.
    Unreachable(crate::flintlock::FlintlockError),
    /// The host answered without the VM.
    VmGone(crate::flintlock::FlintlockError),
}

/// Issue 23: a pre-lease hook cut off by the claim's deadline on a host that stopped
/// answering (hung, partitioned) got the hook-failure policy: a hung host looked like a hung
/// command. The claim now asks the host for the VM, bounded like the claim's check; a host
/// that cannot answer is a transport failure (the VM goes back, 503), never the policy.
async fn probe_after_deadline(state: &AppState, vm: &VmRow, host: Option<&HostRow>) -> Probe {
    let (Some(h), Some(uid)) = (host, vm.uid.as_deref()) else { return Probe::Answers };
    match ask_for_vm(state, h, uid, state.config.hooks.claim_verify_timeout).await {
        Ok(true) => Probe::Answers,
        Ok(false) => Probe::VmGone(vm_not_found(h, uid)),
        Err(e) if e.is_transport() || e.is_credentials() => Probe::Unreachable(e),
        // Any other answer came from the host: it is up, so the command is what hung.
        Err(_) => Probe::Answers,
    }
}

/// A VM whose hook ran but whose claim will not get the lease: PRE_LEASE_HOOK_RUNNING →
/// AVAILABLE (`false` if it had left that phase: taken by a delete, or leased after all).
async fn give_back(state: &AppState, vm: &VmRow) -> Result<bool, ApiError> {
    retrying("give the VM back", &vm.id, || async {
        let conn = state.conn().await?;
        Ok(store::vm_transition_hook_claim(&conn, &vm.id, vm.hook_started_at, Phase::Available, None).await?)
    })
    .await
}

/// A pre-lease hook command that failed in transit (issue 23 finding 3: the host could not be
/// reached, the connection broke): not the VM's failure, so no policy. The VM goes back to
/// AVAILABLE and the claim answers 503 with Retry-After; its retry (the same request_id)
/// claims afresh. Should the give-back fail, the abandon sweep deletes the VM later.
async fn hook_host_unreachable(
    state: &AppState,
    req: &ClaimRequest,
    vm: &VmRow,
    step: Step,
    e: &crate::flintlock::FlintlockError,
) -> ApiError {
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, error = %e, "{} could not reach its host; giving the VM back", step.name());
    let given_back = give_back(state, vm).await;
    if e.is_transport() {
        // The claim is often the first to find a host dead (issue 23 finding 2): its scan is
        // due at the next pass, which the wake starts, so the dead-host clock starts now
        // rather than at the next scheduled invocation. Best effort.
        if let Ok(c) = state.conn().await
            && let Err(err) = store::host_scan_now(&c, &vm.flintlock_host).await
        {
            tracing::warn!(host = %vm.flintlock_host, error = %err, "cannot ask for the host's scan");
        }
        state.wake("host unreachable").await;
    }
    state.metrics.claim_failure(&req.pool, "unavailable");
    let what = match given_back {
        Ok(true) => "the VM was given back to the pool",
        Ok(false) => "the VM had been taken meanwhile",
        Err(_) => "the VM is left for the reconciler",
    };
    ApiError::unavailable(
        format!(
            "{} on vm {} could not reach flintlock host {}; {what}; retry the claim after the Retry-After delay (the same request_id claims afresh)",
            step.name(),
            vm.id,
            vm.flintlock_host
        ),
        e,
    )
    .reason("FLINTLOCK_UNAVAILABLE")
}

/// A pre-lease hook that found its VM gone from flintlock (a host rebooted without it, a
/// delete behind poolmgr's back): not a hook failure, and nothing to quarantine. The row goes
/// with VM_LOST (the reconciler replaces it) and the claim answers 503 with Retry-After; its
/// retry (the same request_id) claims another VM. Found by the fault campaign.
async fn hook_vm_gone(
    state: &AppState,
    req: &ClaimRequest,
    vm: &VmRow,
    step: Step,
    e: &crate::flintlock::FlintlockError,
) -> ApiError {
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, error = %e, "{} found the VM gone from flintlock", step.name());
    let uid = vm.uid.clone().unwrap_or_default();
    let why = format!("{} found no such VM ({e})", step.name());
    let forgotten = retrying("remove the lost VM", &vm.id, || async {
        let conn = state.conn().await?;
        let phase = Phase::PreLeaseHookRunning;
        Ok(store::vm_forget_lost(&conn, &vm.id, &uid, phase, &vm.flintlock_host, &why).await?)
    })
    .await;
    if matches!(forgotten, Ok(false)) {
        // It had left PRE_LEASE_HOOK_RUNNING: a delete (a discard, a pool delete) took it and
        // removed its microVM, which is why the host did not have it.
        return vm_taken(state, req, vm);
    }
    state.metrics.claim_failure(&req.pool, "unavailable");
    state.wake("lost VM").await;
    ApiError::unavailable(
        format!(
            "vm {} is gone from flintlock host {} ({} found no such VM); retry the claim after the Retry-After delay (the same request_id claims another VM)",
            vm.id,
            vm.flintlock_host,
            step.name()
        ),
        e,
    )
    .reason("VM_GONE")
}

/// Attempts of [`retrying`], and the pause before the second (doubled before the third).
const SETTLE_ATTEMPTS: u32 = 3;
const SETTLE_FIRST_PAUSE: Duration = Duration::from_millis(100);
/// No new attempt after this long: the function's own timeout is not far.
const SETTLE_BUDGET: Duration = Duration::from_secs(3);

/// Runs `op` — a step that takes a VM out of PRE_LEASE_HOOK_RUNNING after its claim could not
/// finish — up to [`SETTLE_ATTEMPTS`] times while the database fails. Each such step is
/// guarded by the VM's phase, so running it twice is harmless. What still fails is left to
/// the abandon sweep (`POOLMGR_CLAIM_ABANDON_SECONDS`).
async fn retrying<T, F, Fut>(what: &str, vm_id: &str, mut op: F) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    let started = Instant::now();
    let mut pause = SETTLE_FIRST_PAUSE;
    let mut attempt = 1;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if attempt < SETTLE_ATTEMPTS && started.elapsed() < SETTLE_BUDGET => {
                tracing::warn!(vm = %vm_id, error = %e, attempt, "could not {what}; retrying");
            }
            Err(e) => {
                tracing::error!(vm = %vm_id, error = %e, "could not {what}; the VM is left to the abandon sweep");
                return Err(e);
            }
        }
        tokio::time::sleep(pause).await;
        pause *= 2;
        attempt += 1;
    }
}

fn vm_taken(state: &AppState, req: &ClaimRequest, vm: &VmRow) -> ApiError {
    state.metrics.claim_failure(&req.pool, "aborted");
    ApiError::Aborted(format!("vm {} was deleted during the claim (its pool was deleted?), retry", vm.id))
        .reason("VM_GONE")
}

/// Applies the pool's hook-failure policy to a VM whose pre-lease hook failed. If the VM was
/// taken meanwhile (a forced pool delete made it DELETING), that is not a hook failure: the
/// claim is ABORTED and the VM left to its deleter. A database that fails here is retried
/// ([`retrying`]) rather than leave the VM in PRE_LEASE_HOOK_RUNNING.
async fn pre_lease_hook_failed(
    state: &AppState,
    req: &ClaimRequest,
    vm: &VmRow,
    host: Option<&HostRow>,
    reason: String,
) -> ApiError {
    // `correlation_id`: the x-request-id the failed claim's answer names.
    let correlation_id = crate::error::REQUEST_ID.try_with(Clone::clone).ok();
    let payload = |policy: HookFailurePolicy| serde_json::json!({"hook": "pre_lease", "reason": reason, "policy": policy, "correlation_id": correlation_id});
    let applied = retrying("apply the hook-failure policy", &vm.id, || async {
        let conn = state.conn().await?;
        let policy = match store::pool_get(&conn, &req.pool).await? {
            Some((p, _)) => p.hook_failure_policy,
            None => return Ok(None),
        };
        let to = match policy {
            HookFailurePolicy::DeleteAndReplace => Phase::Deleting,
            HookFailurePolicy::Quarantine => Phase::Quarantined,
        };
        let event = payload(policy);
        let moved = store::vm_transition_hook_claim(
            &conn,
            &vm.id,
            vm.hook_started_at,
            to,
            Some((crate::domain::EventType::VmHookFailed, &event)),
        )
        .await?;
        Ok(moved.then_some((policy, to)))
    })
    .await;
    let (policy, to) = match applied {
        Ok(Some(applied)) => applied,
        Ok(None) => return vm_taken(state, req, vm),
        Err(e) => return e,
    };
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
    // The client learns that the hook failed and what became of the VM; the command and
    // what the guest printed go only to the VM_HOOK_FAILED event and the log (issue 25 item
    // 6): a client is not told what an admin's hook runs.
    let request_id = correlation_id.unwrap_or_default();
    ApiError::Internal {
        message: format!(
            "the pool's pre-lease hook failed on vm {}; the VM was {}; retry the claim (the same request_id claims a fresh VM); an admin finds the detail in the VM_HOOK_FAILED event and the log (request id {request_id})",
            vm.id,
            if to == Phase::Deleting { "deleted" } else { "quarantined" }
        ),
        cause: reason,
    }
    .reason("HOOK_FAILED")
}
