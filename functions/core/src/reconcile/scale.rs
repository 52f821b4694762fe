//! The sizing step of a pass: reads every autoscaled pool that may need a new desired size
//! with its measured demand (`store::demand_list`, one statement), decides each with the pure
//! arithmetic of [`super::sizing`], and writes the decisions with their POOL_SCALED events
//! (`store::pool_apply_scaling`, one statement). A pass runs it before its selection, so a
//! size that went up is acted on in the same pass. `POST …/expect` runs it for its one pool.
//!
//! Never touches a VM: a size that went down is shed by the pool's own step (AVAILABLE VMs
//! only), one that went up is filled by its replenishment.

use super::ReconcileError;
use super::sizing::{Arrivals, Observed, arrival_rate, cut_spans, decide};
use crate::app::AppState;
use crate::domain::PoolRef;
use crate::store::{self, DEMAND_WINDOWS, PoolDemand, RISE_SLICE_WINDOWS, ScalingWrite};

/// What one sizing step did.
#[derive(Debug, Default, Clone)]
pub struct ScaleReport {
    /// Autoscaled pools looked at.
    pub looked_at: usize,
    /// Pools whose desired size changed.
    pub scaled: Vec<PoolRef>,
}

/// The decision for one pool's demand, as the row to write.
pub fn decision(state: &AppState, d: &PoolDemand) -> ScalingWrite {
    let window = state.config.autoscale.window.as_secs_f64();
    let prev = d.scaling.clone().unwrap_or_default();
    // Each window cut to the pool's age and to the last change the estimate saw.
    let spans = cut_spans(DEMAND_WINDOWS.map(|w| w * window), d.age, d.now - prev.since);
    let full = DEMAND_WINDOWS[2] * window;
    let provisioning = d
        .provisioning
        .filter(|p| p.is_finite() && *p >= 0.0)
        .unwrap_or_else(|| state.config.autoscale.default_provisioning.as_secs_f64());
    let counts = [0, 1, 2].map(|i| d.claims[i] + d.refused[i]);
    let rising_since = prev.rising.then_some(d.now - prev.since);
    let slices = [0, 1, 2, 3].map(|i| d.claims[3 + i] + d.refused[3 + i]);
    let slice = RISE_SLICE_WINDOWS * window;
    let (rate, change) = arrival_rate(&Arrivals { counts, spans, full, provisioning, rising_since, slices, slice });
    let observed = Observed {
        demand_per_second: rate,
        since: change.map_or(0.0, |(c, _)| d.now - c),
        rising: change.is_some_and(|(_, up)| up),
        claims_per_second: d.claims[0] as f64 / spans[0],
        refused_per_second: d.refused[0] as f64 / spans[0],
        provisioning_seconds: provisioning,
        busy: d.busy,
        hint_remaining: d.hint_remaining,
    };
    let from = d.desired_size.unwrap_or_else(|| d.autoscaling.initial_size(d.size));
    let out = decide(d.strategy, &d.autoscaling, &observed, from, &prev, d.now, window);
    ScalingWrite {
        namespace: d.namespace.clone(),
        name: d.name.clone(),
        from_size: d.desired_size,
        desired: out.desired,
        reason: out.reason.as_str().to_owned(),
        scaling: out.state,
        clear_hint: d.hint_expired,
        policy: d.autoscaling.clone(),
    }
}

/// Sizes the autoscaled pools that need it (`pool`: that one only).
pub async fn scale_pools(state: &AppState, pool: Option<&PoolRef>) -> Result<ScaleReport, ReconcileError> {
    let window = state.config.autoscale.window.as_secs_f64();
    let conn = state.db.get().await?;
    let demand = store::demand_list(&conn, window, pool).await?;
    let mut report = ScaleReport { looked_at: demand.len(), ..ScaleReport::default() };
    // Written only when something moved: the size, the bucket history, the reason, a rate.
    let writes: Vec<ScalingWrite> = demand
        .iter()
        .map(|d| (d, decision(state, d)))
        .filter(|(d, w)| {
            d.desired_size != Some(w.desired)
                || w.clear_hint
                || d.scaling.as_ref().is_none_or(|s| !same_but_time(s, &w.scaling))
        })
        .map(|(_, w)| w)
        .collect();
    if writes.is_empty() {
        return Ok(report);
    }
    report.scaled = store::pool_apply_scaling(&conn, &writes).await?;
    for w in writes.iter().filter(|w| w.from_size != Some(w.desired)) {
        tracing::info!(pool = %format!("{}/{}", w.namespace, w.name), from = ?w.from_size, to = w.desired, reason = %w.reason, "pool scaled");
    }
    Ok(report)
}

/// Whether two states differ only in when they were taken and the busy average's drift.
fn same_but_time(a: &crate::domain::ScalingState, b: &crate::domain::ScalingState) -> bool {
    a.recs == b.recs
        && a.reason == b.reason
        && a.active == b.active
        && a.expected_claims == b.expected_claims
        && a.hint_base == b.hint_base
        && (a.demand_per_second - b.demand_per_second).abs() < 1e-9
        && a.since == b.since
        && a.rising == b.rising
        && (a.claims_per_second - b.claims_per_second).abs() < 1e-9
        && (a.refused_per_second - b.refused_per_second).abs() < 1e-9
        && (a.provisioning_seconds - b.provisioning_seconds).abs() < 1e-6
        && (a.busy_avg - b.busy_avg).abs() < 0.05
}
