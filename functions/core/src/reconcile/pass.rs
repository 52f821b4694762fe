//! The shared state of one pass (`Pass`): who it is, its deadline, the hosts it found sick,
//! the per-host bound on flintlock calls, the pools it selected and leased, and the per-host
//! call statistics of its report. Every step of the pass borrows it.
//!
//! Never talks to a pool's VMs itself: it runs the steps' flintlock calls in host slots
//! (`Pass::on_host`) and records what they say about their host.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::Semaphore;

use super::conn::StepConn;
use super::{HostPassStats, ReconcileError};
use crate::app::AppState;
use crate::deployment::Deployment;
use crate::domain::PoolRef;
use crate::flintlock::FlintlockError;
use crate::store::{self, PoolRow};
use crate::teardown::TeardownError;

/// What the workers of one pass share.
pub(super) struct Pass<'a> {
    pub(super) state: &'a AppState,
    pub(super) owner: String,
    pub(super) started_db: DateTime<Utc>,
    /// When the pass started, on this process's monotonic clock (with `started_db`: the
    /// database's time now, [`Pass::now`]).
    pub(super) started: Instant,
    /// When the pools' work stops: the first `1 - CLEANUP_SHARE` of the deadline.
    pub(super) deadline: Instant,
    /// The whole `POOLMGR_RECONCILE_DEADLINE_SECONDS`.
    pub(super) full_deadline: Instant,
    /// When the cross-pool cleanup (deleted pools' stragglers, orphan scans, event retention)
    /// stops, set once it starts ([`Pass::start_cleanup`]).
    pub(super) cleanup_deadline: std::sync::OnceLock<Instant>,
    /// This deployment's flintlock namespaces: where VMs are created, and which ones the
    /// orphan scan may delete.
    pub(super) deployment: Deployment,
    /// Hosts that could not be reached during this pass: no calls to them, no placements.
    pub(super) sick_hosts: Mutex<HashSet<String>>,
    /// Per host, a slot per MicroVM call in flight (`POOLMGR_RECONCILE_HOST_CONCURRENCY`).
    pub(super) host_slots: Mutex<HashMap<String, Arc<Semaphore>>>,
    /// Hosts whose row says "unreachable" (`unreachable_until`, no placements): cleared by
    /// the first call of this pass that reaches the host.
    pub(super) marked_unreachable: Mutex<HashSet<String>>,
    /// Hosts judged dead when the pass started ([`judge_dead_hosts`]): no placements on them
    /// and no VM steps ([`Pass::is_sick`]); only their orphan scan still asks them
    /// ([`Pass::on_host_scan`]), and one that answers clears the judgement for the next pass.
    pub(super) dead_hosts: HashSet<String>,
    /// How long a pool lease of this pass lasts: past the deadline plus a hook command
    /// started just before it, so a pool is never worked past its lease.
    pub(super) lease_secs: f64,
    /// The selected pools whose leases are not taken yet, oldest lease first.
    pub(super) pending: Mutex<VecDeque<PoolRef>>,
    /// Pools leased (and swept) by this pass and not yet stepped.
    pub(super) leased: Mutex<VecDeque<PoolRow>>,
    /// Held by the worker taking the next batch of leases, so one batch is taken at a time.
    pub(super) taking: tokio::sync::Mutex<()>,
    /// A batch of leases could not be taken: its pools were neither leased nor found held.
    pub(super) lease_failed: Mutex<bool>,
    /// Per host, the calls of this pass so far (the report's `hosts`).
    pub(super) host_stats: Mutex<BTreeMap<String, HostPassStats>>,
}

/// A failed flintlock call that says its host could not be reached (not that the host
/// refused this one call): the host is sick for the rest of the pass.
pub(super) trait HostFailure {
    fn host_unreachable(&self) -> bool;
}

impl HostFailure for FlintlockError {
    fn host_unreachable(&self) -> bool {
        self.is_transport()
    }
}

impl HostFailure for TeardownError {
    fn host_unreachable(&self) -> bool {
        matches!(self, TeardownError::Flintlock(e) if e.host_unreachable())
    }
}

/// The hosts every call has found unreachable for longer than `POOLMGR_HOST_DEAD_SECONDS`
/// (issue 23 finding 2), with their rows retired ([`store::vm_retire_on_dead_host`]): a pool
/// whose host died is topped up on its other hosts by this very pass, and what the dead host
/// still holds is deleted once it answers again (never leaked, never counted twice). Failing
/// to retire is logged and retried by the next pass; the host is still skipped for placements.
///
/// Before a host's VMs are retired it is asked once more, with the kind of call that failed
/// (a GetMicroVM of one of them, or a List for an intent, with the call's whole timeout):
/// passes may be a minute apart (the deployed schedule), and one failed call, a blip at the
/// end of a loop, must not cost a healthy host its VMs a minute later. A host that answers
/// keeps its VMs for this pass and its mark as it is (only a pass's own call clears it, so a
/// host whose ServerInfo answers while its VM calls hang is still judged). A host whose VMs
/// are already retired is not asked again, and the retirement happens only if the mark it
/// was judged by still stands (an overlapping pass may have reached the host meanwhile).
pub(super) async fn judge_dead_hosts(
    state: &AppState,
    hosts: &[store::HostRow],
    now: DateTime<Utc>,
) -> HashSet<String> {
    let dead_after = state.config.reconcile.host_dead_after;
    let overdue = hosts
        .iter()
        .filter(|h| h.unreachable_since.is_some_and(|since| (now - since).to_std().unwrap_or_default() >= dead_after));
    let judged = futures::future::join_all(overdue.map(|h| judge(state, h, dead_after))).await;
    judged.into_iter().flatten().collect()
}

/// One overdue host: its name if it is dead (asked and silent, or retired before).
async fn judge(state: &AppState, h: &store::HostRow, dead_after: Duration) -> Option<String> {
    let since = h.unreachable_since?;
    let retirable = match state.db.get().await {
        Ok(c) => store::vm_retirable_on_host(&c, &h.name).await,
        Err(e) => Err(e),
    };
    // Unknown (the database failed), or nothing left to retire: no retirement, and the host
    // stays off placements and steps.
    let Ok(Some((id, uid))) = retirable else { return Some(h.name.clone()) };
    let asked = async {
        match &uid {
            Some(uid) => state.flintlock.get(&h.endpoint(), uid).await.map(|_| ()),
            None => state.flintlock.list(&h.endpoint(), "", Some(&id)).await.map(|_| ()),
        }
    };
    match tokio::time::timeout(state.config.flintlock_timeout, asked).await {
        // A secrets error tells nothing of the host: never retire on it.
        Ok(Err(e)) if e.is_credentials() => return Some(h.name.clone()),
        // An answer (a VM, "not found", an error of its own): the host is up.
        Ok(Err(e)) if !e.is_transport() => return None,
        Ok(Ok(())) => {
            tracing::info!(host = %h.name, %since, "flintlock host answers again before being judged dead");
            return None;
        }
        Ok(Err(_)) | Err(_) => {}
    }
    let payload = serde_json::json!({
        "host": h.name,
        "reason": format!("host {} unreachable since {since} (POOLMGR_HOST_DEAD_SECONDS={})", h.name, dead_after.as_secs()),
    });
    let retired = match state.db.get().await {
        Ok(c) => store::vm_retire_on_dead_host(&c, &h.name, since, &payload).await,
        Err(e) => Err(e),
    };
    match retired {
        Ok(0) => {}
        Ok(n) => {
            tracing::warn!(host = %h.name, %since, retired = n, "flintlock host judged dead: its VMs retired, replacements go to the other hosts")
        }
        Err(e) => {
            tracing::warn!(host = %h.name, error = %e, "could not retire a dead host's VMs; the next pass retries")
        }
    }
    Some(h.name.clone())
}

/// The share of the pass deadline kept for the cleanup: the pools' work stops at the rest.
pub(super) const CLEANUP_SHARE: f64 = 0.2;
/// The cleanup's budget at least, even when the pools' work ran past the whole deadline (a
/// create hook's command may).
pub(super) const CLEANUP_MIN: Duration = Duration::from_secs(2);

impl Pass<'_> {
    /// The database's time now (its time at the pass's start plus the time since, plus a
    /// test's clock adjustment): what due and timeout checks compare database timestamps
    /// with, never this process's wall clock, which may have drifted (issue 23 finding 5).
    pub(super) fn now(&self) -> DateTime<Utc> {
        let elapsed = chrono::Duration::from_std(self.started.elapsed()).unwrap_or_default();
        self.started_db + elapsed + self.state.clock.adjustment()
    }

    pub(super) fn past_deadline(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Starts the cleanup's budget (issue 23 finding 4): orphan scans, deleted pools'
    /// stragglers and event retention ran only when the pools left time before the deadline,
    /// so under load they never ran at all. They now get the rest of the deadline, and at
    /// least [`CLEANUP_MIN`], in every pass.
    pub(super) fn start_cleanup(&self) {
        let until = self.full_deadline.max(Instant::now() + CLEANUP_MIN);
        let _ = self.cleanup_deadline.set(until);
    }

    /// Whether the cleanup's budget is spent (`true` before it started).
    pub(super) fn past_cleanup_deadline(&self) -> bool {
        self.cleanup_deadline.get().is_none_or(|t| Instant::now() >= *t)
    }

    /// Marks `host` sick for this pass; `true` if it was not yet.
    pub(super) fn sick(&self, host: &str) -> bool {
        self.sick_hosts.lock().expect("sick hosts").insert(host.to_owned())
    }

    /// Whether `host` was found unreachable (by this pass or before it) and has not answered
    /// since: judged dead, or awaiting that judgement.
    pub(super) fn is_marked_unreachable(&self, host: &str) -> bool {
        self.dead_hosts.contains(host) || self.marked_unreachable.lock().expect("marked hosts").contains(host)
    }

    /// Whether the pass skips `host`'s VMs: a call of this pass found it unreachable, or it
    /// was judged dead at the pass's start. A dead host's calls would each wait out their
    /// timeout (a hung host) and hold the pass, and with it the refill its judgement started;
    /// only its orphan scan still asks it ([`Pass::on_host_scan`]), which is how its return
    /// is seen.
    pub(super) fn is_sick(&self, host: &str) -> bool {
        self.dead_hosts.contains(host) || self.sick_hosts.lock().expect("sick hosts").contains(host)
    }

    /// The hosts a placement must skip: sick in this pass, or judged dead at its start.
    pub(super) fn sick_list(&self) -> Vec<String> {
        let sick = self.sick_hosts.lock().expect("sick hosts");
        sick.iter().chain(self.dead_hosts.iter().filter(|h| !sick.contains(*h))).cloned().collect()
    }

    /// Runs `call`, a flintlock call to `host`, in one of the host's slots; `None`, without
    /// calling, when the host is sick (checked again once a slot is free: the call that
    /// held it may have found the host dead). A call failing because the host could not be
    /// reached marks it sick *before* its slot is given back, so whatever queued behind it
    /// is skipped instead of waiting out its own timeout. Give the step's connection back
    /// first (`StepConn::released`): waiting for a slot is waiting for something else.
    pub(super) async fn on_host<T, E: HostFailure>(
        &self,
        host: &str,
        call: impl Future<Output = Result<T, E>>,
    ) -> Option<Result<T, E>> {
        if self.is_sick(host) {
            return None;
        }
        self.on_host_scan(host, call).await
    }

    /// [`Pass::on_host`] for the orphan scan's calls, which also ask a host judged dead: one
    /// list per scan interval is how a dead host's return is noticed (and then its leftovers
    /// deleted). A host a call of this pass found unreachable is still skipped.
    pub(super) async fn on_host_scan<T, E: HostFailure>(
        &self,
        host: &str,
        call: impl Future<Output = Result<T, E>>,
    ) -> Option<Result<T, E>> {
        let sick = || self.sick_hosts.lock().expect("sick hosts").contains(host);
        if sick() {
            return None;
        }
        let slots = {
            let limit = self.state.config.reconcile.host_concurrency;
            let mut all = self.host_slots.lock().expect("host slots");
            all.entry(host.to_owned()).or_insert_with(|| Arc::new(Semaphore::new(limit))).clone()
        };
        // Never past the pass's deadline: a step still waiting for a slot then is skipped
        // (the next pass takes it), so no call starts after the deadline and the pool lease
        // (deadline + hook timeout + 30 s) cannot run out under a step (issue 23 finding 5).
        // The cleanup (no pool lease) has its own budget, which may end later.
        let until = self.cleanup_deadline.get().copied().unwrap_or(self.full_deadline);
        let deadline = tokio::time::Instant::from_std(until);
        let _slot = tokio::time::timeout_at(deadline, slots.acquire_owned()).await.ok()?.ok()?;
        if sick() {
            return None;
        }
        let t = Instant::now();
        let r = call.await;
        self.count_call(host, t.elapsed(), r.is_err());
        let unreachable = matches!(&r, Err(e) if e.host_unreachable());
        if unreachable && self.sick(host) {
            tracing::warn!(host, "flintlock host unreachable: skipping its VMs for the rest of this pass");
            // And no placements on it by the next passes for a while: they place new VMs
            // before their own calls could find it dead. Best effort: this pass knows anyway.
            self.marked_unreachable.lock().expect("marked hosts").insert(host.to_owned());
            let window = self.state.config.reconcile.backoff_cap.as_secs_f64();
            self.record_reachability(host, Some(window)).await;
        } else if !unreachable && self.marked_unreachable.lock().expect("marked hosts").remove(host) {
            // It answered (a success or an error of its own): one lost reply must not keep
            // new VMs off a healthy host.
            self.record_reachability(host, None).await;
        }
        Some(r)
    }

    pub(super) fn count_call(&self, host: &str, took: Duration, failed: bool) {
        let mut stats = self.host_stats.lock().expect("host stats");
        let h = stats.entry(host.to_owned()).or_default();
        h.calls += 1;
        h.failed += usize::from(failed);
        h.busy_ms += took.as_millis();
    }

    pub(super) fn count_create(&self, host: &str) {
        self.host_stats.lock().expect("host stats").entry(host.to_owned()).or_default().created += 1;
    }

    /// Marks `host` unreachable for `window` seconds in its row, or clears that (`None`).
    pub(super) async fn record_reachability(&self, host: &str, window: Option<f64>) {
        let recorded = match self.state.db.get().await {
            Ok(c) => match window {
                Some(secs) => store::host_mark_unreachable(&c, host, secs).await,
                None => store::host_clear_unreachable(&c, host).await,
            },
            Err(e) => Err(e),
        };
        if let Err(e) = recorded {
            tracing::warn!(host, error = %e, "could not record whether the host is reachable");
        }
    }

    /// Puts a failing VM step off (exponential backoff, in the VM's row).
    pub(super) async fn backoff(&self, db: &mut StepConn<'_>, vm_id: &str) -> Result<(), ReconcileError> {
        let rc = &self.state.config.reconcile;
        let (base, cap) = (rc.backoff_base.as_secs_f64(), rc.backoff_cap.as_secs_f64());
        Ok(store::vm_backoff(db.client().await?, vm_id, base, cap).await?)
    }
}
