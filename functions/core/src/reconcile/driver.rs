//! The reconcile loop: passes back to back while there is work, so a pool refills in a boot
//! plus a pass or two, not in schedule ticks (issue 22 item 1).
//!
//! A pass advances each VM one step and never waits for a boot. One pass per scheduled event
//! (EventBridge's shortest rate is a minute) put a claimed VM's replacement 60–120 s behind
//! its claim. [`run_loop`] instead keeps passing, `loop_interval` apart, while the passes find
//! work (a VM booting, a create hook, a pool below its target) and for `linger` after the
//! last pass that did or the last wake, then gives the lease back and returns. Who starts a
//! loop: the schedule (once a minute, as a safety net), a claim, a release or a demand hint
//! ([`crate::wake`]), and a loop whose budget ran out while work remained (it hands on to a
//! fresh invocation, so a Lambda timeout never cuts the work short).
//!
//! One invocation loops at a time: the loop lease (`store::loop_*`, a row, never an advisory
//! lock, renewed every few seconds while the holder works, so a dead holder is replaced within
//! seconds). An invocation that finds it held asks the holder to keep going for a linger
//! (`store::loop_ask`) and returns. The holder gives the lease back only when no ask came after
//! its last pass started and the asked-for linger is over, so no wake is lost between the two,
//! however long a pass takes. A pass that moved nothing (no VM created, found booted, deleted,
//! no flintlock call answered) is not work: a pool that wants VMs it cannot get keeps no loop
//! running. Passes of overlapping invocations would be safe anyway (each pool's
//! reconcile lease); the lease only saves their cost. A host found unreachable and not judged
//! dead yet also keeps a loop passing, until the pass that judges it (at most
//! `POOLMGR_HOST_DEAD_SECONDS`), which tops its pools up on the other hosts (issue 23). A
//! scheduled invocation whose first pass finds nothing to do returns at once
//! ([`Start::Schedule`]): an idle fleet costs one short pass a minute.
//!
//! Never keeps state between invocations: everything that matters is in the database.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{PassReport, ReconcileError, run_pass};
use crate::app::AppState;
use crate::store;

/// What one loop did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct LoopReport {
    /// Passes run by this invocation.
    pub passes: usize,
    /// Of those, the passes that found work (pools selected).
    pub passes_with_work: usize,
    /// Another invocation held the loop lease: this one asked it to go on and ran no pass.
    pub joined: bool,
    /// The budget ran out while work remained: a fresh invocation was woken to go on.
    pub handed_on: bool,
    /// Every pass's report, added up.
    pub total: PassReport,
    pub duration_ms: u128,
}

impl LoopReport {
    fn add(&mut self, r: PassReport) {
        self.passes += 1;
        self.passes_with_work += usize::from(r.selected > 0);
        let d = self.total.duration_ms + r.duration_ms;
        self.total.merge(r);
        self.total.duration_ms = d;
    }
}

/// What started a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The schedule (or poolmgr-local's ticker): a first pass with nothing to do ends the loop
    /// at once, so an idle fleet costs one short pass a minute.
    Schedule,
    /// A wake (a claim, a refusal, a release, a hint, a hand-off): the loop lingers from its
    /// start, so the work of a wake debounced after this one is seen too.
    Wake,
}

/// [`run_loop_from`] for a wake.
pub async fn run_loop(state: &AppState, budget: Duration) -> Result<LoopReport, ReconcileError> {
    run_loop_from(state, budget, Start::Wake).await
}

/// How long the loop lease lasts between renewals; the holder renews it every third of this
/// while a pass runs, so a holder that died (a killed invocation) is replaced this soon.
const LEASE_SECS: f64 = 15.0;

/// Whether a pass moved anything: created, adopted, found AVAILABLE, deleted, expired, failed
/// or resized VMs, or stepped one (a VM still booting was polled, a create hook ran). A pool
/// that wants VMs it cannot get (no eligible host) is selected by every pass but moves
/// nothing, and an orphan scan is not work: neither may keep a loop, and a Lambda, running
/// around the clock.
fn moved(r: &PassReport) -> bool {
    r.created + r.adopted + r.available + r.deleted + r.expired + r.failed + r.orphans_deleted + r.scaled + r.stepped
        > 0
}

/// Runs passes until there is no work left for a linger, or `budget` (measured from now) would
/// not leave room for one more pass; see the module doc. The first pass always runs when this
/// invocation takes the loop lease; one that finds it held only asks the holder to go on.
/// Fails only when the loop lease cannot be read; a failure after that ends the loop, gives
/// the lease back and hands on if work or an ask is pending.
pub async fn run_loop_from(state: &AppState, budget: Duration, start: Start) -> Result<LoopReport, ReconcileError> {
    run_loop_until(state, budget, start, &mut Stop::never()).await
}

/// The longest a pass may take: past its deadline it still finishes the hook commands it
/// started.
pub fn pass_room(config: &crate::Config) -> Duration {
    config.reconcile.deadline + config.hooks.command_timeout + Duration::from_secs(5)
}

/// Stops a loop between passes (poolmgr-local's shutdown, [`run_ticker`]): the pass in flight
/// finishes, then the loop gives its lease back and hands nothing on, so another process's
/// loop can take over at once instead of after the lease runs out.
#[derive(Debug, Clone)]
pub struct Stop(tokio::sync::watch::Receiver<bool>);

impl Stop {
    /// A stop and the sender that sets it (send `true`).
    pub fn new() -> (tokio::sync::watch::Sender<bool>, Stop) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (tx, Stop(rx))
    }

    fn never() -> Stop {
        // The sender is dropped: `changed` fails at once, so `stopped` waits forever instead.
        Stop(tokio::sync::watch::channel(false).1)
    }

    fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    /// Completes once the stop is set (never, when its sender is gone unset).
    async fn stopped(&mut self) {
        if self.0.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

async fn run_loop_until(
    state: &AppState,
    budget: Duration,
    start: Start,
    stop: &mut Stop,
) -> Result<LoopReport, ReconcileError> {
    let t0 = Instant::now();
    let rc = &state.config.reconcile;
    let owner = format!("loop-{}", ulid::Ulid::generate());
    let pass_room = pass_room(&state.config);
    let linger = rc.linger.as_secs_f64();
    let mut report = LoopReport::default();

    if !take_or_ask(state, &owner, LEASE_SECS, linger, &mut report).await? {
        report.duration_ms = t0.elapsed().as_millis();
        return Ok(report);
    }
    let end = t0 + budget;
    let mut last_work = match start {
        Start::Wake => Instant::now(),
        Start::Schedule => Instant::now().checked_sub(rc.linger).unwrap_or_else(Instant::now),
    };
    let signal = state.waker.local_signal();
    // Whether work or an ask is pending when the loop stops: then it hands on. Not after a
    // database failure: a successor would fail alike at once, a chain of invocations; the
    // schedule comes back in a minute.
    let pending;
    loop {
        if stop.is_set() {
            pending = false;
            break;
        }
        let lease = match renew(state, &owner).await {
            Ok(Some(l)) => l,
            Ok(None) => {
                tracing::warn!("the reconcile loop lease was taken over (it ran out); stopping");
                report.duration_ms = t0.elapsed().as_millis();
                return Ok(report);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot renew the reconcile loop lease; the loop stops");
                pending = false;
                break;
            }
        };
        let pass = match with_renewals(state, &owner, run_pass(state)).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "a reconcile pass of the loop could not start; the loop stops");
                pending = false;
                break;
            }
        };
        let worked = moved(&pass);
        // A host found unreachable and not judged dead yet keeps the loop passing until it is
        // (at most POOLMGR_HOST_DEAD_SECONDS): the judging pass tops its pools up on the other
        // hosts, which a loop that stopped would leave to the next schedule (issue 23).
        // Bounded: a host that keeps being cleared and marked again (a flapping network) keeps
        // no loop running longer than a judgement (and its last ask) past the loop's start or
        // its last work.
        let awaiting = pass.hosts_awaiting_judgement > 0
            && now_since(last_work.max(t0)) < rc.host_dead_after + state.config.flintlock_timeout + rc.linger;
        report.add(pass);
        let now = Instant::now();
        if worked {
            last_work = now;
        }
        if !worked && !awaiting && !lease.asked && now.duration_since(last_work).as_secs_f64() >= linger {
            // Nothing to do for a linger: give the lease back, unless a wake asked for a pass
            // that starts after its ask (this one may have started before it).
            match release(state, &owner, false, Some(lease.now)).await {
                Some(true) => {
                    report.duration_ms = t0.elapsed().as_millis();
                    return Ok(report);
                }
                Some(false) => last_work = now,
                None => {
                    pending = false;
                    break;
                }
            }
        }
        if now + rc.loop_interval + pass_room > end {
            // The budget would not hold another pass.
            pending = worked || awaiting || lease.asked;
            break;
        }
        let pause = async {
            match &signal {
                Some(n) => {
                    let _ = tokio::time::timeout(rc.loop_interval, n.notified()).await;
                }
                None => tokio::time::sleep(rc.loop_interval).await,
            }
        };
        tokio::select! { () = pause => {}, () = stop.stopped() => {} }
    }
    release(state, &owner, true, None).await;
    if pending {
        report.handed_on = state.wake("hand-off").await;
    }
    report.duration_ms = t0.elapsed().as_millis();
    Ok(report)
}

fn now_since(t: Instant) -> Duration {
    Instant::now().saturating_duration_since(t)
}

async fn renew(state: &AppState, owner: &str) -> Result<Option<store::LoopLease>, ReconcileError> {
    Ok(store::loop_renew(&state.db.get().await?, owner, LEASE_SECS).await?)
}

/// Runs `work` while renewing the loop lease every third of its length, so the lease can be
/// short whatever a pass takes (a dead host's timeouts, hook commands).
async fn with_renewals<T>(state: &AppState, owner: &str, work: impl std::future::Future<Output = T>) -> T {
    let renewals = async {
        loop {
            tokio::time::sleep(Duration::from_secs_f64(LEASE_SECS / 3.0)).await;
            if let Err(e) = renew(state, owner).await {
                tracing::warn!(error = %e, "cannot renew the reconcile loop lease during a pass");
            }
        }
    };
    tokio::pin!(work);
    tokio::pin!(renewals);
    match futures::future::select(work, renewals).await {
        futures::future::Either::Left((out, _)) => out,
        futures::future::Either::Right(_) => unreachable!("the renewals never end"),
    }
}

/// Takes the loop lease (`true`), or asks its holder to go on (`false`): the holder's next
/// pass is at most a loop interval away, so a wake that finds a loop running costs one
/// statement, not a pass.
async fn take_or_ask(
    state: &AppState,
    owner: &str,
    lease_secs: f64,
    linger: f64,
    report: &mut LoopReport,
) -> Result<bool, ReconcileError> {
    for _ in 0..2 {
        if store::loop_take(&state.db.get().await?, owner, lease_secs).await? {
            return Ok(true);
        }
        if store::loop_ask(&state.db.get().await?, linger).await? {
            report.joined = true;
            return Ok(false);
        }
        // The holder gave the lease back in between: take it.
    }
    Ok(store::loop_take(&state.db.get().await?, owner, lease_secs).await?)
}

/// Gives the loop lease back (`force`: whatever asks are pending); `Some(released)`, or
/// `None` when the database could not be asked (the lease then runs out by itself).
async fn release(
    state: &AppState,
    owner: &str,
    force: bool,
    last_pass_started: Option<chrono::DateTime<chrono::Utc>>,
) -> Option<bool> {
    let released = match state.db.get().await {
        Ok(c) => store::loop_release(&c, owner, force, last_pass_started).await.map_err(ReconcileError::from),
        Err(e) => Err(e.into()),
    };
    match released {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(error = %e, "cannot give the reconcile loop lease back; it runs out by itself");
            None
        }
    }
}

/// The local stand-in for the schedule and the wakes (`poolmgr-local`): every
/// `POOLMGR_RECONCILE_INTERVAL_MS`, or at once when a claim, a release or a hint signals
/// (`Waker::local`), a reconcile loop ([`run_loop_from`]: passes while there is work, then a
/// linger), as the reconcile function does on AWS. Never returns.
///
/// A loop that joined (another process holds the loop lease and was just asked to pass for a
/// linger from now) pauses for the wake debounce (at most half the linger) before it listens
/// again: the wakes of that
/// pause are covered by the holder's passes, as an HTTP function's debounced wakes are on AWS
/// (`crate::wake`), and they coalesce meanwhile into one. Without the pause, several
/// poolmgr-local on one database asked at every claim: a loop_take and a loop_ask, a contended
/// write of the one reconcile_loop row and a commit each (the deployed shape of
/// scripts/bench-claims.sh: 1790 asks for 13604 claims, and 1.20-1.39 times the in-process
/// path's PostgreSQL CPU per claim).
///
/// Returns once `stop` is set, after the pass in flight, with the loop lease given back.
pub async fn run_ticker(state: AppState, mut stop: Stop) {
    let signal = state.waker.local_signal();
    let mut tick = tokio::time::interval(state.config.reconcile.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let start = match &signal {
            Some(n) => tokio::select! {
                _ = tick.tick() => Start::Schedule,
                _ = n.notified() => Start::Wake,
                () = stop.stopped() => return,
            },
            None => tokio::select! {
                _ = tick.tick() => Start::Schedule,
                () = stop.stopped() => return,
            },
        };
        let done = run_loop_until(&state, state.config.reconcile.loop_budget, start, &mut stop).await;
        if stop.is_set() {
            return;
        }
        match done {
            Ok(r) => {
                tracing::debug!(
                    passes = r.passes,
                    with_work = r.passes_with_work,
                    joined = r.joined,
                    "reconcile loop done"
                );
                if r.joined {
                    // Never as long as the holder's linger, which is what covers the pause
                    // (the rule "debounce below the linger" is documented, not enforced).
                    tokio::time::sleep(state.config.wake.debounce.min(state.config.reconcile.linger / 2)).await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "reconcile loop failed"),
        }
    }
}
