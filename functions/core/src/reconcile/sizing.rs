//! Demand-based sizing as arithmetic: the size an autoscaled pool works towards, from its
//! measured demand, its measured provisioning time, a demand hint and what the last decisions
//! were (issue 22 item 2; docs/design-notes.md, "Issue 22: demand").
//!
//! Pure: no I/O, no clock (times are seconds passed in), no database rows. The pass's sizing
//! step (`scale`) reads the inputs in one statement, calls [`decide`] per pool and writes
//! what changed; the state between two decisions is [`ScalingState`], kept in the pool's row.
//!
//! The model: a pool that replaces each claimed VM is an Erlang loss system. A claim finds a
//! warm VM unless all of the pool's "slots" are out; a slot is out from the claim until the
//! replacement is AVAILABLE. With IMMEDIATE_ON_LEASE a replacement starts at the claim, so a
//! slot is out for the provisioning time `p` and the offered load is `λ·p`. With
//! REPLACE_ON_DELETE (and MIN_SIZE_THRESHOLD, which counts leased VMs alike) the slot is out
//! for the lease too, so the load is `λ·(h + p)`, whose `λ·h` is the mean number of busy VMs
//! (Little's law), measured as a moving average (or the busy VMs now, when more: a burst
//! counts at once). The size is the smallest whose Erlang-B loss
//! is at most `1 - target_warm_ratio`; Erlang B holds for any holding-time distribution.
//! Or, with `buffer`, an explicit number of idle VMs on top of the busy ones (Actions Runner
//! Controller's `minRunners + assignedJobs`).
//!
//! Up at once, down only after a stabilization window: the size never goes below the highest
//! recommendation of the last `scale_down_stabilization_seconds` plus a tenth (Kubernetes'
//! HPA keeps the window's highest; the tenth is a dead band, so a steady load whose estimate
//! wobbles does not walk the size up and down). A hint (announced claims not yet arrived) adds
//! its claims on top until it expires. The ceiling counts every VM of the pool.

use crate::domain::{Autoscaling, ScaleReason, ScalingState, Strategy};

/// What was measured for one pool, as the sizing step reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observed {
    /// Claims that took a VM, per second, over the demand window.
    pub claims_per_second: f64,
    /// Claims refused with 429 (each request once, however often retried), per second.
    pub refused_per_second: f64,
    /// The p90 of recent VMs' creation to AVAILABLE, seconds.
    pub provisioning_seconds: f64,
    /// VMs leased or being claimed now.
    pub busy: i64,
    /// Announced claims that have not arrived yet, while the hint lasts.
    pub hint_remaining: i64,
}

/// A decision: the size to work towards and why, and the state to keep.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub desired: i32,
    pub reason: ScaleReason,
    pub state: ScalingState,
}

/// Erlang's loss formula: the probability that a claim finds all `servers` slots out when the
/// offered load is `load` (arrival rate × holding time), by the stable recursion
/// B(0) = 1, B(c) = a·B(c-1) / (c + a·B(c-1)).
pub fn erlang_b(servers: u32, load: f64) -> f64 {
    let mut b = 1.0;
    for c in 1..=servers {
        b = load * b / (f64::from(c) + load * b);
    }
    b
}

/// The smallest number of slots whose loss is at most `loss` at `load`; at most `cap`.
pub fn servers_for(load: f64, loss: f64, cap: u32) -> u32 {
    if load.is_nan() || load <= 0.0 {
        return 0;
    }
    let mut b = 1.0;
    for c in 1..=cap {
        b = load * b / (f64::from(c) + load * b);
        if b <= loss {
            return c;
        }
    }
    cap
}

/// Whether the strategy counts leased VMs in its size.
fn counts_leased(strategy: Strategy) -> bool {
    !matches!(strategy, Strategy::ImmediateOnLease)
}

/// The size demand asks for, before the floor, the ceiling and the stabilization: the demand
/// part, and the hint on top.
fn demand_size(strategy: Strategy, policy: &Autoscaling, o: &Observed, busy_avg: f64) -> (i64, i64) {
    let cap = u32::try_from(policy.max.max(0)).unwrap_or(0) + 1;
    let lambda = (o.claims_per_second + o.refused_per_second).max(0.0);
    let p = o.provisioning_seconds.max(0.0);
    let demand = match (policy.buffer, policy.target_warm_ratio) {
        (Some(b), _) => i64::from(b) + if counts_leased(strategy) { o.busy } else { 0 },
        (None, Some(r)) => {
            // The busy VMs: their moving average, or the count now when it is far above it
            // (a matrix burst leases 50 at once); not the count's every wobble, which would
            // walk a small pool up and down.
            let now = o.busy as f64;
            let busy = if now > busy_avg + 3.0 * busy_avg.sqrt() + 1.0 { now } else { busy_avg };
            let load = lambda * p + if counts_leased(strategy) { busy } else { 0.0 };
            i64::from(servers_for(load, 1.0 - r, cap))
        }
        (None, None) => 0,
    };
    (demand, o.hint_remaining.max(0))
}

/// The decision for one pool at `now` (seconds), given its previous `desired` size and state.
/// `window` is the demand window (seconds): the busy average's time constant.
pub fn decide(
    strategy: Strategy,
    policy: &Autoscaling,
    o: &Observed,
    desired: i32,
    prev: &ScalingState,
    now: f64,
    window: f64,
) -> Decision {
    // The busy VMs' moving average, over however long it has been since the last decision.
    let busy_avg = if prev.at <= 0.0 || now <= prev.at {
        if prev.at <= 0.0 { o.busy as f64 } else { prev.busy_avg }
    } else {
        let k = 1.0 - (-(now - prev.at) / window.max(1e-3)).exp();
        prev.busy_avg + (o.busy as f64 - prev.busy_avg) * k
    };
    let (demand, hint) = demand_size(strategy, policy, o, busy_avg);
    // The ceiling counts every VM. For a strategy whose size leaves leased VMs out, that is
    // enforced where VMs are created (`strategy::ceiling_room`), not here: a desired size that
    // moved with every claim would shed and re-create VMs and flap.
    let ceiling = i64::from(policy.max);
    let floor = i64::from(policy.min).min(ceiling);
    let raw = demand + hint;
    let (rec, rec_reason) = if raw > ceiling {
        (ceiling, ScaleReason::Ceiling)
    } else if raw < floor {
        (floor, ScaleReason::Floor)
    } else if hint > 0 {
        (raw, ScaleReason::Hint)
    } else {
        (raw, ScaleReason::Demand)
    };
    let rec = i32::try_from(rec).unwrap_or(policy.max);

    // The stabilization window's recommendations, in buckets of a twentieth of it.
    let stab = f64::from(policy.scale_down_stabilization_seconds.max(0));
    let bucket = (stab / 20.0).max(1.0);
    let start = (now / bucket).floor() * bucket;
    // No window: no history, the size follows the recommendation down at once.
    let mut recs: Vec<(f64, i32)> =
        if stab > 0.0 { prev.recs.iter().copied().filter(|(t, _)| *t > now - stab - bucket).collect() } else { vec![] };
    match recs.last_mut() {
        Some((t, r)) if *t == start => *r = (*r).max(rec),
        _ => recs.push((start, rec)),
    }
    let held = recs.iter().map(|(_, r)| *r).max().unwrap_or(rec);
    let floor32 = i32::try_from(floor).unwrap_or(policy.min);
    // A dead band of a tenth, at least one VM, above the window's highest recommendation; none
    // when the whole window asked for the floor (an idle pool goes back to its floor).
    let band = if held <= floor32 || stab <= 0.0 { 0 } else { ((f64::from(held) * 0.1).round() as i32).max(1) };
    let keep = (held + band).min(i32::try_from(ceiling).unwrap_or(policy.max));

    let (next, reason) = if rec > desired {
        (rec, rec_reason)
    } else if desired > keep.max(rec) {
        // Down, but not below what the window's highest recommendation asks for; the reason
        // is the recommendation's.
        (keep.max(rec), rec_reason)
    } else if desired < i32::try_from(floor).unwrap_or(policy.min) {
        (i32::try_from(floor).unwrap_or(policy.min), ScaleReason::Floor)
    } else if i64::from(desired) > ceiling {
        (i32::try_from(ceiling).unwrap_or(policy.max), ScaleReason::Ceiling)
    } else {
        (desired, prev.reason.unwrap_or(rec_reason))
    };
    let lambda = o.claims_per_second + o.refused_per_second;
    let state = ScalingState {
        recs,
        busy_avg,
        at: now,
        reason: Some(reason),
        claims_per_second: o.claims_per_second,
        refused_per_second: o.refused_per_second,
        provisioning_seconds: o.provisioning_seconds,
        expected_claims: hint,
        active: lambda > 0.0 || hint > 0 || o.busy > 0 || busy_avg >= 0.05 || next != policy.min,
    };
    Decision { desired: next, reason, state }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(min: i32, max: i32, r: f64, stab: i32) -> Autoscaling {
        Autoscaling { min, max, target_warm_ratio: Some(r), buffer: None, scale_down_stabilization_seconds: stab }
    }

    fn obs(lambda: f64, p: f64, busy: i64) -> Observed {
        Observed { claims_per_second: lambda, provisioning_seconds: p, busy, ..Observed::default() }
    }

    #[test]
    fn erlang_b_matches_known_values() {
        // Standard tables: B(1, 1) = 0.5; B(2, 1) = 0.2; B(10, 5) ≈ 0.01838.
        assert!((erlang_b(1, 1.0) - 0.5).abs() < 1e-12);
        assert!((erlang_b(2, 1.0) - 0.2).abs() < 1e-12);
        assert!((erlang_b(10, 5.0) - 0.018_384).abs() < 1e-5);
        assert_eq!(erlang_b(0, 3.0), 1.0);
        // The model peak: 2 claims/s × 45 s = 90 Erlangs at 1 % loss needs 107
        // ready-or-coming VMs (the "static pool sized for the peak").
        assert_eq!(servers_for(90.0, 0.01, 10_000), 107);
        assert_eq!(servers_for(0.0, 0.01, 100), 0);
        assert_eq!(servers_for(f64::NAN, 0.01, 100), 0);
        assert_eq!(servers_for(1e6, 0.01, 50), 50, "capped");
    }

    #[test]
    fn immediate_on_lease_sizes_for_the_provisioning_load_whatever_is_busy() {
        let p = ratio(0, 200, 0.99, 300);
        // 107 warm-or-coming VMs; the 150 busy ones are left to the creation's ceiling room
        // (`strategy::ceiling_room`), so the size does not move with every claim.
        let d = decide(Strategy::ImmediateOnLease, &p, &obs(2.0, 45.0, 150), 0, &ScalingState::default(), 100.0, 60.0);
        assert_eq!((d.desired, d.reason), (107, ScaleReason::Demand));
        let d = decide(Strategy::ImmediateOnLease, &p, &obs(9.0, 45.0, 0), 0, &ScalingState::default(), 100.0, 60.0);
        assert_eq!((d.desired, d.reason), (200, ScaleReason::Ceiling));
    }

    /// A small pool under a steady load whose busy count wobbles (Poisson noise) does not walk
    /// up and down: the busy VMs count by their moving average, and the dead band is at least
    /// one VM.
    #[test]
    fn a_small_pool_with_a_wobbling_busy_count_does_not_reverse() {
        let p = ratio(1, 100, 0.99, 300);
        let (mut desired, mut st) = (1, ScalingState::default());
        let mut changes = vec![];
        let busy = [2, 5, 3, 4, 2, 3, 5, 4, 3, 2, 4, 5, 3, 2, 3];
        for i in 0..3000usize {
            let t = 1000.0 + i as f64;
            let d = decide(Strategy::ReplaceOnDelete, &p, &obs(0.1, 30.0, busy[i % busy.len()]), desired, &st, t, 60.0);
            if d.desired != desired && i > 120 {
                changes.push((t, desired, d.desired));
            }
            (desired, st) = (d.desired, d.state);
        }
        let reversals = changes.windows(2).filter(|w| (w[0].2 > w[0].1) != (w[1].2 > w[1].1)).count();
        assert!(reversals <= 1, "{changes:?}");
    }

    #[test]
    fn replace_on_delete_counts_busy_vms_in_the_load() {
        let p = ratio(1, 500, 0.99, 300);
        let d = decide(Strategy::ReplaceOnDelete, &p, &obs(0.5, 40.0, 60), 0, &ScalingState::default(), 10.0, 60.0);
        // Load 0.5 × 40 + 60 busy = 80 Erlangs.
        assert_eq!(d.desired, servers_for(80.0, 0.01, 501) as i32);
        assert!(d.desired > 80);
    }

    #[test]
    fn a_burst_of_leases_counts_at_once_and_decays_with_the_average() {
        let p = ratio(1, 500, 0.99, 0);
        let st = ScalingState { busy_avg: 2.0, at: 100.0, ..ScalingState::default() };
        let d = decide(Strategy::ReplaceOnDelete, &p, &obs(0.0, 30.0, 50), 3, &st, 101.0, 60.0);
        assert!(d.desired >= 50, "the 50 busy VMs count at once: {d:?}");
        // They are released: the average, not the count, says how many stay busy.
        let d2 = decide(Strategy::ReplaceOnDelete, &p, &obs(0.0, 30.0, 0), d.desired, &d.state, 111.0, 60.0);
        assert!(d2.state.busy_avg > 0.0 && d2.state.busy_avg < 50.0, "{d2:?}");
    }

    #[test]
    fn no_demand_sits_at_the_floor_and_the_floor_is_the_reason() {
        let p = ratio(2, 10, 0.99, 300);
        let d = decide(Strategy::ReplaceOnDelete, &p, &Observed::default(), 2, &ScalingState::default(), 10.0, 60.0);
        assert_eq!((d.desired, d.reason), (2, ScaleReason::Floor));
        assert!(!d.state.active, "nothing to look at again");
    }

    #[test]
    fn up_at_once_down_only_after_the_stabilization_window() {
        let p = ratio(1, 100, 0.99, 300);
        let mut st = ScalingState::default();
        let mut desired = 1;
        // A burst: up at once.
        let d = decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 30.0, 0), desired, &st, 1000.0, 60.0);
        assert!(d.desired > 30, "{d:?}");
        let peak = d.desired;
        (desired, st) = (d.desired, d.state);
        // Demand gone: held for the window.
        for t in [1010.0, 1100.0, 1200.0, 1290.0] {
            let d = decide(Strategy::ImmediateOnLease, &p, &Observed::default(), desired, &st, t, 60.0);
            assert_eq!(d.desired, peak, "held at {t}");
            (desired, st) = (d.desired, d.state);
        }
        // Past the window: down to the floor.
        let d = decide(Strategy::ImmediateOnLease, &p, &Observed::default(), desired, &st, 1320.0, 60.0);
        assert_eq!((d.desired, d.reason), (1, ScaleReason::Floor));
    }

    /// Issue 22: no flapping under steady load. A demand estimate that wobbles by ±20 %
    /// around a steady rate moves the size up at most at the start, never down and up again.
    #[test]
    fn a_steady_load_with_a_wobbling_estimate_does_not_reverse() {
        let p = ratio(1, 500, 0.99, 300);
        let (mut desired, mut st) = (1, ScalingState::default());
        let mut changes = vec![];
        for i in 0..2000 {
            let t = 1000.0 + f64::from(i) * 2.0;
            let wobble = 1.0 + 0.2 * ((f64::from(i) * 0.7).sin());
            let d = decide(Strategy::ImmediateOnLease, &p, &obs(0.5 * wobble, 45.0, 5), desired, &st, t, 60.0);
            if d.desired != desired {
                changes.push((t, desired, d.desired));
            }
            (desired, st) = (d.desired, d.state);
        }
        let reversals = changes.windows(2).filter(|w| (w[0].2 > w[0].1) != (w[1].2 > w[1].1)).count();
        assert_eq!(reversals, 0, "{changes:?}");
    }

    #[test]
    fn a_hint_adds_the_announced_claims_until_they_arrive() {
        let p = ratio(10, 200, 0.99, 300);
        let o = Observed { hint_remaining: 50, ..Observed::default() };
        let d = decide(Strategy::ReplaceOnDelete, &p, &o, 10, &ScalingState::default(), 10.0, 60.0);
        assert_eq!((d.desired, d.reason), (50, ScaleReason::Hint));
        assert_eq!(d.state.expected_claims, 50);
        let o = Observed { hint_remaining: 500, ..Observed::default() };
        let d = decide(Strategy::ReplaceOnDelete, &p, &o, 10, &ScalingState::default(), 10.0, 60.0);
        assert_eq!((d.desired, d.reason), (200, ScaleReason::Ceiling));
    }

    #[test]
    fn a_buffer_keeps_idle_vms_on_top_of_the_busy_ones() {
        let p = Autoscaling { buffer: Some(3), target_warm_ratio: None, ..ratio(0, 20, 0.5, 0) };
        let d = decide(Strategy::ReplaceOnDelete, &p, &obs(0.0, 0.0, 7), 0, &ScalingState::default(), 10.0, 60.0);
        assert_eq!(d.desired, 10);
        let d = decide(Strategy::ImmediateOnLease, &p, &obs(0.0, 0.0, 7), 0, &ScalingState::default(), 10.0, 60.0);
        assert_eq!(d.desired, 3);
        let d = decide(Strategy::ReplaceOnDelete, &p, &obs(0.0, 0.0, 19), 0, &ScalingState::default(), 10.0, 60.0);
        assert_eq!((d.desired, d.reason), (20, ScaleReason::Ceiling));
    }

    #[test]
    fn a_changed_policy_clamps_the_size_at_once() {
        let p = ratio(5, 8, 0.99, 300);
        let st = ScalingState { recs: vec![(0.0, 50)], reason: Some(ScaleReason::Demand), ..ScalingState::default() };
        let d = decide(Strategy::ReplaceOnDelete, &p, &Observed::default(), 50, &st, 10.0, 60.0);
        assert_eq!(d.desired, 8, "above the new ceiling");
        let d = decide(Strategy::ReplaceOnDelete, &p, &Observed::default(), 1, &ScalingState::default(), 10.0, 60.0);
        assert_eq!(d.desired, 5, "below the new floor");
        assert_eq!(p.initial_size(3), 5);
        assert_eq!(p.initial_size(30), 8);
    }
}
