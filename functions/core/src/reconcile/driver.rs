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
//! lock). An invocation that finds it held asks the holder to keep going for a linger
//! (`store::loop_ask`) and returns: the holder's next pass is at most a loop interval away.
//! The holder gives the lease back only when nobody asked for later passes, so no wake is lost
//! between the two. Passes of overlapping invocations would be safe anyway (each pool's
//! reconcile lease); the lease only saves their cost. A scheduled invocation whose first pass
//! finds nothing to do returns at once ([`Start::Schedule`]): an idle fleet costs one short
//! pass a minute.
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

/// Runs passes until there is no work left for a linger, or `budget` (measured from now) would
/// not leave room for one more pass; see the module doc. The first pass always runs when this
/// invocation takes the loop lease; one that finds it held only asks the holder to go on.
/// Fails only when the first pass cannot start; a failure later ends the loop with what it did.
pub async fn run_loop_from(state: &AppState, budget: Duration, start: Start) -> Result<LoopReport, ReconcileError> {
    let t0 = Instant::now();
    let rc = &state.config.reconcile;
    let owner = format!("loop-{}", ulid::Ulid::generate());
    // Past its pass deadline a pass still finishes the hook commands it started.
    let pass_room = rc.deadline + state.config.hooks.command_timeout + Duration::from_secs(5);
    let lease_secs = pass_room.as_secs_f64() + rc.loop_interval.as_secs_f64() + 5.0;
    let linger = rc.linger.as_secs_f64();
    let mut report = LoopReport::default();

    if !take_or_ask(state, &owner, lease_secs, linger, &mut report).await? {
        report.duration_ms = t0.elapsed().as_millis();
        return Ok(report);
    }
    let end = t0 + budget;
    let mut last_work = match start {
        Start::Wake => Instant::now(),
        Start::Schedule => Instant::now().checked_sub(rc.linger).unwrap_or_else(Instant::now),
    };
    let signal = state.waker.local_signal();
    loop {
        let lease = {
            let c = state.db.get().await?;
            store::loop_renew(&c, &owner, lease_secs).await?
        };
        let Some(lease) = lease else {
            tracing::warn!("the reconcile loop lease was taken over (this loop overran it); stopping");
            break;
        };
        let pass = match run_pass(state).await {
            Ok(p) => p,
            Err(e) if report.passes == 0 => {
                release(state, &owner, true).await;
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(error = %e, "a reconcile pass of the loop could not start; the loop stops");
                break;
            }
        };
        let worked = pass.selected > 0;
        report.add(pass);
        let now = Instant::now();
        if worked {
            last_work = now;
        }
        let asked = lease.asked;
        if !worked && !asked && now.duration_since(last_work).as_secs_f64() >= linger {
            // Nothing to do for a linger: give the lease back, unless a wake came in since.
            match store::loop_release(&state.db.get().await?, &owner, false).await {
                Ok(true) => {
                    report.duration_ms = t0.elapsed().as_millis();
                    return Ok(report);
                }
                Ok(false) => last_work = now,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot give the reconcile loop lease back; it runs out by itself");
                    report.duration_ms = t0.elapsed().as_millis();
                    return Ok(report);
                }
            }
        }
        if now + rc.loop_interval + pass_room > end {
            // The budget would not hold another pass: hand on if there is work or a wake.
            release(state, &owner, true).await;
            if worked || asked || now.duration_since(last_work).as_secs_f64() < linger {
                report.handed_on = state.waker.wake("hand-off").await;
            }
            report.duration_ms = t0.elapsed().as_millis();
            return Ok(report);
        }
        match &signal {
            Some(n) => {
                let _ = tokio::time::timeout(rc.loop_interval, n.notified()).await;
            }
            None => tokio::time::sleep(rc.loop_interval).await,
        }
    }
    release(state, &owner, true).await;
    report.duration_ms = t0.elapsed().as_millis();
    Ok(report)
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

async fn release(state: &AppState, owner: &str, force: bool) {
    let released = match state.db.get().await {
        Ok(c) => store::loop_release(&c, owner, force).await.map_err(ReconcileError::from),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = released {
        tracing::warn!(error = %e, "cannot give the reconcile loop lease back; it runs out by itself");
    }
}
