//! The selection of a pass: which pools need a step at all. One statement
//! ([`store::pool_list_with_work`]) returns the pools that may (anything due, or counts that
//! are not plainly full), and [`needs_step`] decides with the strategy's own arithmetic, so
//! a pool that needs nothing costs no round trip of its own and what "full" means stays
//! written once ([`super::strategy`]). That statement counts the VMs of the candidates only:
//! the pools some signal names (a VM written or a pool stepped since the watermark, a lease
//! or VM due, the pools row) and a bounded number checked in full per pass, so a settled
//! pass costs O(work), not O(pools) (design-notes.md, "Issue 15: selection in O(work)").
//!
//! Never takes a lease or writes anything: the pass takes the reconcile leases of what this
//! returns, in batches, and a pool another pass took meanwhile is skipped there.

use chrono::{DateTime, Utc};

use super::ReconcileError;
use super::provision::BELOW_TARGET_QUARANTINE_FULL;
use super::strategy::{quarantine_full, strategy_wants, surplus, wants_within};
use crate::app::AppState;
use crate::domain::PoolRef;
use crate::store::{self, PoolWork};

/// Whether a pool's step would do anything: a changed spec, a lease or VM due, VMs beyond
/// its size, VMs missing (unless quarantined VMs hold it back and that is already
/// recorded), or a recorded reason for being below target that no longer holds.
pub fn needs_step(w: &PoolWork) -> bool {
    if w.changed || w.leases_due || w.vms_due || surplus(w.strategy, w.size, w.counts) > 0 {
        return true;
    }
    let wants = wants_within(strategy_wants(w.strategy, w.size, w.min_size, w.counts), w.ceiling, w.counts) > 0;
    match (wants, quarantine_full(w.size, w.counts)) {
        (true, true) => w.below_target_reason.as_deref() != Some(BELOW_TARGET_QUARANTINE_FULL),
        (true, false) => true,
        (false, _) => w.below_target_reason.is_some(),
    }
}

/// What a pass selected: the pools to step, and what to record once it leased them all
/// ([`store::selection_advance`]).
#[derive(Debug, Clone)]
pub struct Selection {
    pub pools: Vec<PoolRef>,
    /// The last pool checked in full.
    pub checked: Option<PoolRef>,
}

/// The pools a pass that started at `pass_started` (the database's clock) should step, oldest
/// reconcile lease first: those no pass holds, this pass has not visited and
/// [`needs_step`] says need one.
pub async fn pools_with_work(state: &AppState, pass_started: DateTime<Utc>) -> Result<Vec<PoolRef>, ReconcileError> {
    Ok(select(state, pass_started).await?.pools)
}

/// [`pools_with_work`], with the cursor of the full checks.
pub async fn select(state: &AppState, pass_started: DateTime<Utc>) -> Result<Selection, ReconcileError> {
    let mut conn = state.db.get().await?;
    // In a transaction only for its planner settings (`store::selection_planner_settings`).
    let tx = conn.transaction().await?;
    store::selection_planner_settings(&tx).await?;
    let rc = &state.config.reconcile;
    let warn = rc.warning_window.as_secs_f64();
    let abandon = state.config.hooks.claim_abandon_after.as_secs_f64();
    let margin = rc.selection_margin.as_secs_f64();
    let now = state.clock.now_param();
    let found = store::pool_list_with_work(&tx, pass_started, now, warn, abandon, margin, rc.full_checks).await?;
    tx.commit().await?;
    Ok(Selection {
        pools: found.work.iter().filter(|w| needs_step(w)).map(PoolWork::pool_ref).collect(),
        checked: found.checked,
    })
}
