//! A pool's rollout, one step per pass (issue 24): what it retires, how far it surges, and
//! whether it is done or must halt. The state is the pool row's (V19); every change it makes
//! is one guarded statement (`store::rollout_*`), so a pass killed at any point leaves a state
//! the next pass steps on from.
//!
//! Per step, for a rollout to the pool's revision R:
//! - **Done** when no VM of another revision is AVAILABLE or coming: COMPLETE,
//!   POOL_ROLLOUT_COMPLETED, R marked rolled out. LEASED VMs of another revision never count
//!   and are never touched (`status.rollout.stale_leased`).
//! - **Halted** (PROGRESSING only) after `failure_threshold` new VMs failed, or when none
//!   became AVAILABLE for `progress_deadline_seconds`; with `auto_rollback`, back to the newest
//!   kept revision that rolled out, whose rollout then retires the halted revision's VMs. A
//!   template that never boots destroys no healthy VM: retirement waits for replacements.
//! - **Replaced:** the stale AVAILABLE VMs that claims will not consume within
//!   `window_seconds` (under ANY claims take stale VMs first, and the last window's claims are
//!   the estimate for the next; under CURRENT a claim takes a stale VM only once no current
//!   one is left, so none is counted on). Up to
//!   `max_surge` new VMs are kept coming above the target for them, and stale AVAILABLE VMs
//!   are retired (oldest first, VM_DELETED_FOR_ROLLOUT) while AVAILABLE VMs stay at or above
//!   the warm floor minus `max_unavailable`: the lower of the strategy's warm target and the
//!   AVAILABLE count when the rollout started (a busy pool runs below its target). With the
//!   default 0, a stale VM goes only as a new one became AVAILABLE. Until
//!   the first new VM is AVAILABLE, the surge is at most the failures left before the halt.

use crate::domain::{ClaimPreference, RolloutState, Strategy, VmCounts};
use crate::store::{self, PoolRow};

use super::conn::StepConn;
use super::error::ReconcileError;

/// What the step asks of the rest of the pool's step this pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// VMs above the target the pool may have meanwhile (not shed as surplus).
    pub allowance: i64,
    /// New VMs to create beyond what the strategy wants.
    pub extra: i64,
    /// Stale AVAILABLE VMs retired by this step (no longer available to the replenishment).
    pub retired: i64,
}

impl Plan {
    /// The counts the replenishment and the surplus see after this step's retirements.
    pub fn counts(&self, mut counts: VmCounts) -> VmCounts {
        counts.available = (counts.available - self.retired).max(0);
        counts
    }
}

pub(super) async fn step(db: &mut StepConn<'_>, pool: &PoolRow, counts: VmCounts) -> Result<Plan, ReconcileError> {
    // A rollout that is not stepped (paused, halted, done) keeps nothing above the target: the
    // VMs its surge still has coming are not counted as surplus (`strategy::surplus` never
    // sheds a warm VM for one still booting), and go as they come up.
    let idle = Plan::default();
    let (Some(policy), Some(state), Some(since)) = (&pool.rollout, pool.rollout_state, pool.rollout_event_id) else {
        return Ok(idle);
    };
    if !matches!(state, RolloutState::Progressing | RolloutState::RolledBack) {
        return Ok(idle);
    }
    let pref = pool.pool_ref();
    let rc = store::rollout_counts(db.client().await?, &pref, pool.revision, since, policy.window_seconds).await?;
    if rc.stale_available + rc.stale_coming == 0 {
        if store::rollout_complete(db.client().await?, &pref, pool.revision).await? {
            tracing::info!(pool = %pref, revision = pool.revision, extra_boots = pool.rollout_extra_boots, stale_leased = rc.stale_leased, "rollout complete");
        }
        return Ok(idle);
    }
    if state == RolloutState::Progressing {
        let started = pool.rollout_started_at.unwrap_or(rc.db_now);
        let last = rc.last_progress.map_or(started, |t| t.max(started));
        let stalled = (rc.db_now - last).num_seconds();
        let reason = if rc.failures >= i64::from(policy.failure_threshold) {
            Some(format!(
                "{} new VMs of revision {} failed (failure_threshold {})",
                rc.failures, pool.revision, policy.failure_threshold
            ))
        } else if stalled >= i64::from(policy.progress_deadline_seconds) {
            Some(format!(
                "no VM of revision {} became AVAILABLE for {stalled} s (progress_deadline_seconds {})",
                pool.revision, policy.progress_deadline_seconds
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            let back = if policy.auto_rollback {
                store::rollout_last_good(db.client().await?, &pref, pool.revision).await?
            } else {
                None
            };
            if store::rollout_halt(db.client().await?, &pref, pool.revision, &reason, back).await? {
                tracing::warn!(pool = %pref, revision = pool.revision, %reason, rolled_back_to = ?back, "rollout halted");
            }
            return Ok(idle);
        }
    }
    let target = i64::from(pool.target_size());
    let surge = i64::from(policy.max_surge.of(pool.target_size(), true));
    let unavailable = i64::from(policy.max_unavailable.of(pool.target_size(), false));
    // Stale VMs the claims will take within the window. Under CURRENT a claim takes a stale
    // VM only when no current one is AVAILABLE, and the replenishment makes current ones, so
    // none is counted on: every stale VM is replaced actively. Under ANY a claim takes a stale
    // VM first (V21): as many as the last window's claims, the estimate for the next one.
    let consumed = match policy.claim_preference {
        ClaimPreference::Current => 0,
        ClaimPreference::Any => rc.recent_claims.min(rc.stale_available),
    };
    let to_replace = (rc.stale_available - consumed).max(0);
    // The warm VMs the strategy keeps out of the target: leased ones count towards it under
    // REPLACE_ON_DELETE and MIN_SIZE_THRESHOLD, not under IMMEDIATE_ON_LEASE.
    let committed = match pool.strategy {
        Strategy::ImmediateOnLease => counts.claiming,
        Strategy::ReplaceOnDelete | Strategy::MinSizeThreshold => counts.claiming + counts.leased,
    };
    // Never below the warm capacity the pool had when the rollout started either: a busy pool
    // runs below its target by its refills in flight, and would otherwise never retire one.
    let start = pool.rollout_warm_floor.map_or(i64::MAX, i64::from);
    let floor = (target - committed).min(start).saturating_sub(unavailable).max(0);
    let retire = to_replace.min(counts.available - floor).max(0);
    let retired =
        if retire > 0 { store::rollout_retire(db.client().await?, &pref, pool.revision, retire).await? } else { 0 };
    if retired > 0 {
        tracing::info!(pool = %pref, revision = pool.revision, retired, left = rc.stale_available - retired, "stale VMs retired for the rollout");
    }
    // New VMs coming above the target for what is left to replace, at most the surge; and
    // until one of them became AVAILABLE, no more than the failures the rollout may still
    // take, so a template that never boots halts after failure_threshold VMs, not a surge's.
    let mut allowance = surge.min(to_replace - retired);
    if rc.last_progress.is_none() {
        allowance = allowance.min((i64::from(policy.failure_threshold) - rc.failures).max(0));
    }
    // What the pool already has above its target, as its strategy counts (the surge in
    // flight and the surge AVAILABLE but not yet swapped for a stale VM).
    let kept = (counts.available - retired)
        + counts.claiming
        + counts.provisioning
        + if pool.strategy == Strategy::ImmediateOnLease { 0 } else { counts.leased };
    let above = (kept - target).max(0);
    Ok(Plan { allowance: allowance.max(above), extra: (allowance - above).max(0), retired })
}
