//! The two-phase claim ([`claim_with_hook`]): of a pool with `pre_lease_commands`, and of
//! every claim while `POOLMGR_CLAIM_VERIFY` is on (the default), whose VM is checked in
//! flintlock before its lease is written. Its first transaction takes a VM; the hook or the
//! check runs outside any transaction; the second writes the lease, or the VM is given back or
//! the pool's hook-failure policy applied. Part of [`super`]'s claim.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::{
    ClaimRequest, Rounds, aborted, answer_existing, check_quota, exhausted, now_for, pool_not_found, replay,
    replay_winner, waited_for_claimers,
};
use crate::api::ClaimResponse;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{HookFailurePolicy, LeaseId, Phase, RequestId};
use crate::error::ApiError;
use crate::store::{self, HookLease, HostRow, LeaseView, StoreError, VmRow};

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
pub(super) async fn claim_with_hook(
    state: &AppState,
    principal: &Principal,
    req: ClaimRequest,
    mut rounds: Rounds,
) -> Result<ClaimResponse, ApiError> {
    loop {
        let (st, pr, rq) = (state.clone(), principal.clone(), req.clone());
        let quota = rounds.quota;
        let step = crate::service::detached(async move { take_and_finish(&st, &pr, &rq, quota).await }).await?;
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
