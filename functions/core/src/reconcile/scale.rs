//! The sizing step of a pass: reads every autoscaled pool that may need a new desired size
//! with its measured demand (`store::demand_list`, one statement), decides each with the pure
//! arithmetic of [`super::sizing`], and writes the decisions with their POOL_SCALED events
//! (`store::pool_apply_scaling`, one statement). A pass runs it before its selection, so a
//! size that went up is acted on in the same pass. `POST …/expect` runs it for its one pool.
//!
//! Never touches a VM: a size that went down is shed by the pool's own step (AVAILABLE VMs
//! only), one that went up is filled by its replenishment.

use super::ReconcileError;
use super::batches::{self, BATCH_MEMORY_WINDOWS, Look, Recent};
use super::sizing::{Arrivals, Observed, arrival_rate, cut_spans, decide, rose_lately, waiting_need};
use crate::app::AppState;
use crate::domain::{PoolRef, ScalingState};
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
    let a = &state.config.autoscale;
    decision_with(a.window.as_secs_f64(), a.default_provisioning.as_secs_f64(), d)
}

/// [`decision`] with the demand window and the provisioning time assumed until one is
/// measured (seconds): pure.
pub fn decision_with(window: f64, default_provisioning: f64, d: &PoolDemand) -> ScalingWrite {
    let prev = d.scaling.clone().unwrap_or_default();
    // Each window cut to the pool's age and to the last change the estimate saw.
    let spans = cut_spans(DEMAND_WINDOWS.map(|w| w * window), d.age, d.now - prev.since);
    let full = DEMAND_WINDOWS[2] * window;
    let measured = |p: Option<f64>| p.filter(|p| p.is_finite() && *p >= 0.0);
    let provisioning = measured(d.provisioning).unwrap_or(default_provisioning);
    // What a slot is out for on average: the sizing's provisioning time. The last VMs up
    // read it high after a wave of creations (they are its slowest boots, and stay the last
    // up until 20 more come up: a quarter of an hour at 0.02 claims/s) and low while one
    // comes (its fast boots are up first); VMs ordered by creation, once all are up, read it
    // as it is but late. The lower of the two: as the last up while a wave comes, not held
    // up by its slow boots after it.
    let holding = measured(d.provisioning_mean)
        .map(|up| measured(d.provisioning_created_mean).map_or(up, |created| created.min(up)))
        .unwrap_or(provisioning);
    // The last seconds' arrivals: claims and refusals, a retried request once (its arrival
    // was its refusal). Counted twice, the claims of a drained pool's waiting requests, served
    // all at once when its VMs came up, read as a rise to three times the rate.
    let slices = [0, 1, 2, 3].map(|i| d.claims[3 + i] + d.refused[3 + i] - d.retried[i]);
    let slice = RISE_SLICE_WINDOWS * window;
    // Batches: the last seconds' fresh arrivals, remembered; the part of them the idle buffer
    // served is not a rate (`super::batches`).
    let recent =
        Recent { fresh: slices, served: [0, 1, 2, 3].map(|i| d.claims[3 + i] - d.retried[i]), slice, at: d.recent_at };
    let memory = BATCH_MEMORY_WINDOWS * window;
    let seen = batches::excess(&recent, prev.demand_per_second);
    let served = recent.served[2] + recent.served[3];
    let (hint_rate, hint_remaining) = hint_left(&prev, d);
    // A batch that comes while a hint is live is the announced one.
    let announced = d.hint_claims > 0;
    let look = Look { seen, served, buffer: prev.batch_buffer, announced };
    let batches = batches::record(&prev.batches, d.now, memory, &recent, look);
    // The demand window's fresh arrivals: each request once, at its first attempt. A claim
    // of a request refused before is no arrival (counted twice, a drained pool's waiting
    // requests, served when its VMs came up, read as a rise a window later). The longer
    // windows count a served refusal twice: a percent of their arrivals at the target, too
    // few to move their rate.
    let twice = [d.retried_window, 0, 0];
    let counts = [0, 1, 2]
        .map(|i| (d.claims[i] + d.refused[i] - twice[i] - batches::covered_within(&batches, d.now, spans[i])).max(0));
    let rising_since = prev.rising.then_some(d.now - prev.since);
    let (rate, change) =
        arrival_rate(&Arrivals { counts, spans, full, provisioning: holding, rising_since, slices, slice });
    let rising = rose_lately(change, rising_since, spans[0].max(1.0));
    let batch_buffer = match (d.autoscaling.buffer, d.autoscaling.target_warm_ratio) {
        (None, Some(r)) => {
            let allowance = batches::allowance(r, rate, memory.min(d.age), &batches);
            batches::buffer(&batches, d.now, allowance, rate * holding)
        }
        _ => 0,
    };
    let observed = Observed {
        demand_per_second: rate,
        since: change.map_or(0.0, |(c, _)| d.now - c),
        rising: change.is_some_and(|(_, up)| up),
        claims_per_second: d.claims[0] as f64 / spans[0],
        refused_per_second: d.refused[0] as f64 / spans[0],
        provisioning_seconds: provisioning,
        provisioning_mean_seconds: holding,
        busy: d.busy,
        hint_remaining,
        batch_buffer,
        pending: waiting_need(d.refused[0] - d.served_refused, rate, holding, d.first_refused_age, rising),
    };
    let from = d.desired_size.unwrap_or_else(|| d.autoscaling.initial_size(d.size));
    let mut out = decide(d.strategy, &d.autoscaling, &observed, from, &prev, d.now, window);
    out.state.batches = batches;
    out.state.hint_rate = hint_rate;
    out.state.hint_announced = (d.hint_claims > 0).then_some(d.hint_claims);
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

/// A live hint's rate (the pool's when the hint came, kept while it lasts) and its claims not
/// arrived yet: the pool's usual arrivals go on meanwhile, so the announced claims are the
/// arrivals beyond those and their Poisson wobble. The count only goes down while the hint
/// lasts, but for the claims a new post adds: the usual claims' count grows with every second
/// and the arrivals come one by one, so the count beyond them wobbles, and a size that
/// followed it would go up and down with every pass.
fn hint_left(prev: &ScalingState, d: &PoolDemand) -> (Option<f64>, i64) {
    if d.hint_claims <= 0 {
        return (None, 0);
    }
    let rate = prev.hint_rate.unwrap_or(prev.demand_per_second).max(0.0);
    let usual = rate * d.hint_age.max(0.0);
    let beyond = (d.hint_arrivals - (usual + 2.0 * usual.sqrt()).ceil() as i64).max(0);
    let left = (d.hint_claims - beyond).max(0);
    match (prev.hint_rate, prev.hint_announced) {
        (Some(_), Some(was)) => (Some(rate), left.min(prev.expected_claims + (d.hint_claims - was).max(0))),
        _ => (Some(rate), left),
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
        && a.hint_rate == b.hint_rate
        && a.hint_announced == b.hint_announced
        && a.batches == b.batches
        && a.batch_buffer == b.batch_buffer
        && (a.demand_per_second - b.demand_per_second).abs() < 1e-9
        && a.since == b.since
        && a.rising == b.rising
        && (a.claims_per_second - b.claims_per_second).abs() < 1e-9
        && (a.refused_per_second - b.refused_per_second).abs() < 1e-9
        && (a.provisioning_seconds - b.provisioning_seconds).abs() < 1e-6
        && (a.busy_avg - b.busy_avg).abs() < 0.05
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Autoscaling, ScalingState, Strategy};

    /// A reproducible uniform source (xorshift).
    fn rng(seed: u64) -> impl FnMut() -> f64 {
        let mut x = seed.max(1);
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
    }

    /// What one replay of a trace through [`decision_with`] and a modelled IMMEDIATE_ON_LEASE
    /// pool gave.
    #[derive(Debug)]
    struct Outcome {
        requests: usize,
        warm: usize,
        idle_vm_minutes: f64,
        buffers: Vec<(f64, i64)>,
        sizes: Vec<(f64, i32)>,
        /// The most confirmed batches remembered at any pass.
        confirmed: usize,
        /// Each request's first attempt: when, and whether it was warm.
        attempts: Vec<(f64, bool)>,
        /// VMs created.
        created: usize,
    }

    /// An IMMEDIATE_ON_LEASE pool's demand with nothing measured but a live hint: `claims`
    /// announced `age` seconds ago, `arrivals` since (no hint: 0 claims). [`replay`] fills in
    /// what it measured.
    fn hinted(scaling: Option<ScalingState>, claims: i64, arrivals: i64, age: f64) -> PoolDemand {
        PoolDemand {
            namespace: "ns".into(),
            name: "p".into(),
            strategy: Strategy::ImmediateOnLease,
            autoscaling: Autoscaling {
                min: 1,
                max: 1000,
                target_warm_ratio: Some(0.99),
                buffer: None,
                scale_down_stabilization_seconds: 300,
            },
            desired_size: Some(10),
            size: 10,
            scaling,
            now: 10_000.0,
            claims: [0; 7],
            refused: [0; 7],
            retried: [0; 4],
            served_refused: 0,
            retried_window: 0,
            first_refused_age: None,
            recent_at: None,
            age: 10_000.0,
            provisioning: Some(30.0),
            provisioning_mean: Some(30.0),
            provisioning_created_mean: None,
            busy: 0,
            hint_claims: claims,
            hint_arrivals: arrivals,
            hint_age: age,
            hint_expired: false,
        }
    }

    /// A drain is created twice over only when the demand has just risen (nothing was booting
    /// for its claims): a steady pool at 2 claims/s that runs out for a moment, its
    /// replacements booting, gets a VM for each request waiting and each claim of the rest of
    /// the provisioning interval, once; the same drain 50 s after a rise, twice that.
    #[test]
    fn only_a_rise_drains_twice_over() {
        let drained = |since: f64, rising: bool, waiting: i64| {
            let now = 10_000.0;
            let prev = ScalingState {
                demand_per_second: 2.0,
                since: now - since,
                rising,
                at: now - 2.0,
                recs: vec![(now - 2.0, 80)],
                ..ScalingState::default()
            };
            // 2 claims/s over every window (cut at the rise), the last 10 s included.
            let spans = cut_spans(DEMAND_WINDOWS.map(|w| w * 60.0), now, since);
            let c = spans.map(|s| (2.0 * s) as i64);
            let d = PoolDemand {
                desired_size: Some(80),
                claims: [c[0], c[1], c[2], 5, 5, 5, 5],
                refused: [waiting, waiting, waiting, 0, 0, 0, waiting],
                first_refused_age: (waiting > 0).then_some(1.5),
                ..hinted(Some(prev), 0, 0, 0.0)
            };
            decision_with(60.0, 30.0, &d).desired
        };
        // 30 s mean provisioning: 3 waiting and 2 claims/s × 28.5 s to come, 60.
        let (steady, base) = (drained(3000.0, false, 3), drained(3000.0, false, 0));
        assert!((55..=65).contains(&(steady - base)), "once over: {steady} against {base}");
        let (risen, base) = (drained(50.0, true, 3), drained(50.0, true, 0));
        assert!((110..=130).contains(&(risen - base)), "twice over: {risen} against {base}");
    }

    /// A hint on a busy pool: its usual claims go on while the announced ones are awaited, so
    /// only the arrivals beyond its rate when the hint came (and their Poisson wobble) count
    /// as the announced ones, whatever the rate reads later.
    #[test]
    fn a_hints_claims_are_the_arrivals_beyond_the_usual_ones() {
        let at = |rate: f64, hint_rate: Option<f64>| {
            Some(ScalingState { demand_per_second: rate, hint_rate, ..ScalingState::default() })
        };
        // 0.5 claims/s, 180 s: 90 usual (±9.5), and 30 announced.
        let left = |d: &PoolDemand| decision_with(60.0, 45.0, d).scaling.expected_claims;
        assert_eq!(left(&hinted(at(0.5, None), 30, 90, 180.0)), 30, "the usual claims only");
        assert_eq!(left(&hinted(at(0.5, None), 30, 105, 180.0)), 30, "within their wobble");
        assert_eq!(left(&hinted(at(0.5, None), 30, 120, 180.0)), 19);
        assert_eq!(left(&hinted(at(0.5, None), 30, 139, 180.0)), 0, "all came");
        // The rate when it came is kept while it lasts: a later rate (its claims read as one)
        // does not eat it.
        let w = decision_with(60.0, 45.0, &hinted(at(0.5, None), 30, 0, 2.0));
        assert_eq!(w.scaling.hint_rate, Some(0.5));
        assert_eq!(left(&hinted(at(3.0, Some(0.5)), 30, 120, 180.0)), 19);
        // No live hint: none kept.
        assert_eq!(decision_with(60.0, 45.0, &hinted(at(0.5, Some(0.5)), 0, 0, 0.0)).scaling.hint_rate, None);
        // Only down while it lasts (the count beyond the usual claims wobbles as they come one
        // by one), but for the claims a new post adds.
        let was = |left: i64, announced: i64| {
            Some(ScalingState {
                demand_per_second: 0.5,
                hint_rate: Some(0.5),
                hint_announced: Some(announced),
                expected_claims: left,
                ..ScalingState::default()
            })
        };
        assert_eq!(left(&hinted(was(19, 30), 30, 110, 190.0)), 19, "not back up to 30");
        assert_eq!(left(&hinted(was(19, 30), 40, 110, 190.0)), 29, "10 more announced");
        assert_eq!(left(&hinted(was(19, 30), 30, 144, 190.0)), 1, "95 usual, 20 of wobble, 29 announced");
    }

    /// How [`replay`] feeds the decisions.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Seen {
        /// As `store::demand_list` reads it.
        All,
        /// No batch is remembered, so none is ever confirmed, covered or buffered for (the
        /// sizing before batches).
        NoBatches,
        /// Told when [`model_day`]'s bursts may come and at what rate its steady claims do:
        /// through [`BURST_HOURS`] (from a mean boot before), the size is a constant, the
        /// steady load's slots (the rate of [`DAY`]'s phase times the boots' mean) plus an idle
        /// buffer, the first in the peak phase, the second after; the sizing's outside them.
        Told(i32, i32),
    }

    /// A hint a replay posts: when, its `claims` and `within_seconds`.
    type Hint = (f64, i64, f64);

    /// Replays `arrivals` (request times, sorted) against a modelled pool: a claim takes an
    /// AVAILABLE VM (a warm hit) or is refused and retried every 2 s until one is there;
    /// `hints` are posted as `POST …/expect` records them; a pass every 2 s reads the demand
    /// as `store::demand_list` counts it (claims, each request's refusal once, the slices,
    /// the retried claims, the last 20 boots' p90 and mean, the mean of the last ones created
    /// that are all up, the live hint's arrivals) and, as the reconciler's pass does, creates
    /// VMs up to the decision's size (booting: log-normal,
    /// median `boot` seconds, σ 0.25, as the benchmark's simulator draws) or sheds AVAILABLE
    /// ones beyond it. `target`: the policy's `target_warm_ratio`.
    fn replay(arrivals: &[f64], until: f64, boot: f64, target: f64, seen: Seen, hints: &[Hint]) -> Outcome {
        let mut draw = rng(99);
        let mut boot_time = move || {
            // Box–Muller.
            let z = (-2.0 * draw().ln()).sqrt() * (std::f64::consts::TAU * draw()).cos();
            boot * (0.25 * z).exp()
        };
        // The first 10 minutes warm the pool and its estimate up: not counted.
        let warmup = 600.0;
        let policy = Autoscaling {
            min: 1,
            max: 1000,
            target_warm_ratio: Some(target),
            buffer: None,
            scale_down_stabilization_seconds: 300,
        };
        let (w, slice) = (60.0, 60.0 / 24.0);
        // Claims, and those of a request refused before (with when it was refused).
        let (mut claims, mut retried_claims, mut refused) = (vec![], vec![], vec![]);
        let mut retried_first: Vec<f64> = vec![];
        // Requests refused: when they retry next, and when they were first refused.
        let (mut available, mut booting): (i64, Vec<(f64, f64)>) = (20, vec![]);
        let mut waiting: Vec<(f64, f64)> = vec![];
        // Each VM up: when it was created and how long it took, in the order they came up.
        let mut booted: Vec<(f64, f64)> = vec![];
        let (mut desired, mut scaling) = (20, None);
        // The pool's hint: (claims, since, until), as `store::pool_expect` keeps it.
        let (mut hint, mut next_hint): (Option<(i64, f64, f64)>, usize) = (None, 0);
        let requests = arrivals.iter().filter(|a| **a >= warmup).count();
        let mut out = Outcome {
            requests,
            warm: 0,
            idle_vm_minutes: 0.0,
            buffers: vec![],
            sizes: vec![],
            confirmed: 0,
            attempts: vec![],
            created: 0,
        };
        let (dt, mut t, mut next) = (0.5, 0.0, 0usize);
        let count = |v: &Vec<f64>, from: f64, to: f64| {
            v.iter().rev().take_while(|x| **x >= from).filter(|x| **x < to).count() as i64
        };
        let p90 = |v: &[(f64, f64)]| {
            // percentile_cont(0.9) of the last 20.
            let mut v: Vec<f64> = v[v.len().saturating_sub(20)..].iter().map(|b| b.1).collect();
            v.sort_by(f64::total_cmp);
            let x = 0.9 * (v.len() - 1) as f64;
            let i = x.floor() as usize;
            v[i] + x.fract() * (v[(i + 1).min(v.len() - 1)] - v[i])
        };
        while t < until {
            t += dt;
            for (start, at) in booting.iter().filter(|(_, at)| *at <= t) {
                booted.push((*start, at - start));
                available += 1;
            }
            booting.retain(|(_, at)| *at > t);
            while next_hint < hints.len() && hints[next_hint].0 <= t {
                let (_, n, within) = hints[next_hint];
                let last = if booted.is_empty() { 45.0 } else { p90(&booted) };
                hint = Some(match hint.filter(|h| h.2 > t) {
                    Some((c, since, until)) => (c + n, since, until.max(t + within + last)),
                    None => (n, t, t + within + last),
                });
                next_hint += 1;
            }
            // Retries first (they have waited), then the new requests of this step.
            let mut still = vec![];
            for (r, first) in waiting.drain(..) {
                if r <= t && available > 0 {
                    available -= 1;
                    claims.push(t);
                    retried_claims.push(t);
                    retried_first.push(first);
                } else {
                    still.push((if r <= t { t + 2.0 } else { r }, first));
                }
            }
            waiting = still;
            while next < arrivals.len() && arrivals[next] <= t {
                if available > 0 {
                    available -= 1;
                    claims.push(t);
                    if t >= warmup {
                        out.warm += 1;
                    }
                    out.attempts.push((t, true));
                } else {
                    out.attempts.push((t, false));
                    refused.push(t);
                    waiting.push((t + 2.0, t));
                }
                next += 1;
            }
            if t >= warmup {
                out.idle_vm_minutes += available as f64 * dt / 60.0;
            }
            if (t / 2.0).fract() != 0.0 {
                continue;
            }
            let prev: ScalingState = scaling.clone().unwrap_or_default();
            let since = (t - 30.0 * w).max(0.0).max((t - w).min(prev.since));
            let windows = |v: &Vec<f64>| {
                let mut c = [0i64; 7];
                c[0] = count(v, (t - w).max(since), f64::MAX);
                c[1] = count(v, (t - 5.0 * w).max(since), f64::MAX);
                c[2] = count(v, since, f64::MAX);
                for i in 0..4 {
                    let from = t - (4 - i) as f64 * slice;
                    c[3 + i] = count(v, from.max(since), from + slice);
                }
                c
            };
            let (c, r, rc) = (windows(&claims), windows(&refused), windows(&retried_claims));
            let mut last: Vec<f64> = claims
                .iter()
                .rev()
                .take_while(|x| **x >= t - 2.0 * slice)
                .chain(refused.iter().rev().take_while(|x| **x >= t - 2.0 * slice))
                .copied()
                .collect();
            last.sort_by(f64::total_cmp);
            // percentile_disc(0.5): the first value at or past half.
            let recent_at = (!last.is_empty()).then(|| last[(last.len() - 1) / 2]);
            let live = hint.filter(|h| h.2 > t);
            let d = PoolDemand {
                autoscaling: policy.clone(),
                desired_size: Some(desired),
                size: 20,
                now: t,
                claims: c,
                refused: r,
                retried: [3, 4, 5, 6].map(|i| rc[i]),
                first_refused_age: refused.iter().rev().take_while(|x| **x >= t - w).last().map(|x| t - x),
                served_refused: retried_claims
                    .iter()
                    .zip(&retried_first)
                    .rev()
                    .take_while(|(at, _)| **at >= t - w)
                    .filter(|(_, first)| **first >= t - w)
                    .count() as i64,
                retried_window: count(&retried_claims, t - w, f64::MAX),
                recent_at,
                age: t,
                provisioning: (!booted.is_empty()).then(|| p90(&booted)),
                provisioning_mean: (!booted.is_empty()).then(|| {
                    let last = &booted[booted.len().saturating_sub(20)..];
                    last.iter().map(|b| b.1).sum::<f64>() / last.len() as f64
                }),
                provisioning_created_mean: (!booted.is_empty())
                    .then(|| {
                        // Of the last 50 up, the 20 created last of those created more than
                        // two p90s ago, when at least 10 were.
                        let cut = t - 2.0 * p90(&booted);
                        let mut v: Vec<(f64, f64)> =
                            booted[booted.len().saturating_sub(50)..].iter().copied().filter(|b| b.0 < cut).collect();
                        v.sort_by(|a, b| b.0.total_cmp(&a.0));
                        v.truncate(20);
                        (v.len() >= 10).then(|| v.iter().map(|b| b.1).sum::<f64>() / v.len() as f64)
                    })
                    .flatten(),
                hint_expired: hint.is_some_and(|h| h.2 <= t),
                ..hinted(
                    scaling.clone(),
                    live.map_or(0, |h| h.0),
                    live.map_or(0, |h| count(&claims, h.1, f64::MAX).max(count(&refused, h.1, f64::MAX))),
                    live.map_or(0.0, |h| t - h.1),
                )
            };
            let mut wr = decision_with(w, 45.0, &d);
            if let Seen::Told(peak, rest) = seen {
                wr.scaling.batches.clear();
                let mean_boot = boot * (0.25_f64 * 0.25 / 2.0).exp();
                let (from, to) = (BURST_HOURS.0 * 3600.0 - mean_boot, BURST_HOURS.1 * 3600.0);
                if (from..to).contains(&t) {
                    let rate = day_rate(t + mean_boot);
                    let buffer = if rate >= 2.0 { peak } else { rest };
                    wr.desired = (rate * mean_boot).ceil() as i32 + buffer;
                }
            }
            if seen == Seen::NoBatches {
                // Nothing remembered: no batch is ever confirmed, covered or buffered for.
                wr.scaling.batches.clear();
            }
            if wr.clear_hint {
                hint = None;
            }
            desired = wr.desired;
            out.buffers.push((t, wr.scaling.batch_buffer));
            out.sizes.push((t, desired));
            out.confirmed = out.confirmed.max(wr.scaling.batches.iter().filter(|b| b.confirmed).count());
            scaling = Some(wr.scaling);
            let have = available + booting.len() as i64;
            if have < i64::from(desired) {
                out.created += (i64::from(desired) - have) as usize;
                booting.extend((have..i64::from(desired)).map(|_| (t, t + boot_time())));
            } else {
                // As `strategy::surplus` sheds: AVAILABLE VMs beyond the size, never one for a
                // VM still booting.
                available -= (available - i64::from(desired)).max(0);
            }
        }
        out
    }

    /// [`model_day`]'s steady phases, (hours, claims per second) from midnight, and the hours
    /// its bursts come in.
    const DAY: [(f64, f64); 4] = [(7.0, 0.02), (2.0, 2.0), (8.0, 0.5), (7.0, 0.02)];
    const BURST_HOURS: (f64, f64) = (7.0, 17.0);

    /// [`DAY`]'s rate at `t` seconds from midnight.
    fn day_rate(t: f64) -> f64 {
        let mut end = 0.0;
        for (hours, rate) in DAY {
            end += hours * 3600.0;
            if t < end {
                return rate;
            }
        }
        DAY[DAY.len() - 1].1
    }

    /// The benchmark's model day at the demand: 7 h at 0.02 claims/s, 2 h at 2, 8 h at
    /// 0.5, 7 h at 0.02, and matrix bursts of 1 to 50 at once, 10 an hour from 07:00 to 17:00;
    /// and its hints: each burst of 10 or more announced `lead` seconds before it, for a minute
    /// more (the benchmark's `autoscaled-hints`: 180 s before, for 240 s).
    fn model_day(seed: u64, lead: f64) -> (Vec<f64>, Vec<Hint>) {
        let mut u = rng(seed);
        let (mut out, mut hints) = (vec![], vec![]);
        let (mut start, mut t) = (0.0_f64, 0.0_f64);
        for (hours, rate) in DAY {
            let end = start + hours * 3600.0;
            t = t.max(start);
            loop {
                t += -u().ln() / rate;
                if t >= end {
                    break;
                }
                out.push(t);
            }
            start = end;
        }
        let mut t = BURST_HOURS.0 * 3600.0;
        loop {
            t += -u().ln() / (10.0 / 3600.0);
            if t >= BURST_HOURS.1 * 3600.0 {
                break;
            }
            let n = 1 + (u() * 50.0) as usize;
            out.extend((0..n).map(|i| t + i as f64 * 0.01));
            if n >= 10 {
                hints.push((t - lead, n as i64, lead + 60.0));
            }
        }
        out.sort_by(f64::total_cmp);
        hints.sort_by(|a, b| a.0.total_cmp(&b.0));
        (out, hints)
    }

    /// Poisson arrivals in consecutive `(seconds, claims per second)` segments, and when the
    /// last ends. A quiet segment's last gap runs past its end.
    fn segments(seed: u64, parts: &[(f64, f64)]) -> (Vec<f64>, f64) {
        let mut u = rng(seed);
        let (mut arrivals, mut start, mut t) = (vec![], 0.0_f64, 0.0_f64);
        for (len, rate) in parts {
            t = t.max(start);
            loop {
                t += -u().ln() / rate;
                if t >= start + len {
                    break;
                }
                arrivals.push(t);
            }
            start += len;
        }
        (arrivals, start)
    }

    /// The size's changes from `from` to `to` (seconds) whose direction differs from the
    /// previous change's: the benchmark's reversals.
    fn reversals(o: &Outcome, from: f64, to: f64) -> usize {
        let mut changes =
            o.sizes.windows(2).filter(|w| w[1].1 != w[0].1 && w[1].0 >= from && w[1].0 < to).map(|w| w[1].1 > w[0].1);
        let mut last = changes.next();
        let mut n = 0;
        for up in changes {
            n += usize::from(Some(up) != last);
            last = Some(up);
        }
        n
    }

    /// Of the model's static peak-sized pool's idle VM-minutes (95,566 at a 31 s mean boot).
    fn share(o: &Outcome) -> f64 {
        o.idle_vm_minutes / 95_566.0
    }

    fn ratio(o: &Outcome) -> f64 {
        o.warm as f64 / o.requests as f64
    }

    /// The model day at the demand, three seeds. Batches kept coming are served from
    /// an idle buffer: more claims warm than the same sizing without it (each batch read as a
    /// rate: it grew the pool by its size once it had come, for a stabilization window) even
    /// when that one asks for 99.9999 % warm, for at most a tenth more idle VM-minutes than
    /// that costs; the buffer is there while the bursts come and gone within the memory after.
    #[test]
    fn batches_that_keep_coming_are_served_from_a_buffer_better_than_as_a_rate() {
        for seed in [1, 2, 3] {
            let (arrivals, _) = model_day(seed, 180.0);
            let with = replay(&arrivals, 86_400.0, 30.0, 0.99, Seen::All, &[]);
            let rate = replay(&arrivals, 86_400.0, 30.0, 0.99, Seen::NoBatches, &[]);
            let rate_high = replay(&arrivals, 86_400.0, 30.0, 0.999_999, Seen::NoBatches, &[]);
            eprintln!(
                "seed {seed}: buffer {:.4} warm at {:.3}; as a rate {:.4} at {:.3}, at 99.9999 % {:.4} at {:.3}",
                ratio(&with),
                share(&with),
                ratio(&rate),
                share(&rate),
                ratio(&rate_high),
                share(&rate_high)
            );
            assert!(ratio(&with) >= 0.985, "seed {seed}: {:.4}", ratio(&with));
            assert!(
                ratio(&with) > ratio(&rate_high) + 0.001,
                "seed {seed}: more warm hits than as a rate at 99.9999 %"
            );
            assert!(
                with.idle_vm_minutes <= 1.1 * rate_high.idle_vm_minutes,
                "seed {seed}: for about as many idle VM-minutes"
            );
            let buffer_in = |from: f64, to: f64| {
                with.buffers.iter().filter(|(t, _)| *t >= from && *t < to).map(|(_, b)| *b).max().unwrap_or(0)
            };
            // The largest burst, 50, with the steady claims of its seconds.
            assert!(
                (25..=56).contains(&buffer_in(8.0 * 3600.0, 17.0 * 3600.0)),
                "seed {seed}: {}",
                buffer_in(8.0 * 3600.0, 17.0 * 3600.0)
            );
            assert_eq!(buffer_in(0.0, 7.0 * 3600.0), 0, "seed {seed}: none before the bursts");
            assert_eq!(buffer_in(18.0 * 3600.0 + 10.0, 86_400.0), 0, "seed {seed}: gone within the hour after them");
            // The night after: the size is the steady load's (Erlang B at 0.02 × 31 Erlangs,
            // within its dead band), not the bursts'.
            let model = super::super::sizing::servers_for(0.02 * 31.0, 0.01, 1000) as i32;
            let late = with.sizes.iter().filter(|(t, _)| *t >= 19.0 * 3600.0).map(|(_, s)| *s).max().unwrap();
            assert!(late <= model + 2, "seed {seed}: {late} against {model}");
        }
    }

    /// The same day with its bursts of 10 or more announced (3 minutes ahead, as the
    /// benchmark's `autoscaled-hints`): warm for them, and for fewer idle VM-minutes than the
    /// buffer the unannounced day keeps, which is kept for the small bursts only. A hint's VMs
    /// wait for its claims from when they come up: announced a minute ahead instead, as warm
    /// for 3 points less of static-peak's idle VM-minutes at least (18–20 % against 23–25 %).
    #[test]
    fn announced_bursts_are_the_hints_not_the_buffers() {
        for seed in [1, 2, 3] {
            let (arrivals, hints) = model_day(seed, 180.0);
            let without = replay(&arrivals, 86_400.0, 30.0, 0.99, Seen::All, &[]);
            let with = replay(&arrivals, 86_400.0, 30.0, 0.99, Seen::All, &hints);
            // The same hints a minute ahead (a boot and a half): the VMs they ask for come up
            // as before, and wait two minutes less for their claims.
            let (_, sooner) = model_day(seed, 60.0);
            let late = replay(&arrivals, 86_400.0, 30.0, 0.99, Seen::All, &sooner);
            eprintln!(
                "seed {seed}: hinted {:.4} warm at {:.3} ({} VMs created); a minute ahead {:.4} at {:.3}; \
                 unhinted {:.4} at {:.3} ({} created)",
                ratio(&with),
                share(&with),
                with.created,
                ratio(&late),
                share(&late),
                ratio(&without),
                share(&without),
                without.created
            );
            assert!(ratio(&late) >= 0.99, "seed {seed}: {:.4}", ratio(&late));
            assert!(
                share(&late) <= share(&with) - 0.03,
                "seed {seed}: a minute ahead {:.3}, three minutes ahead {:.3}",
                share(&late),
                share(&with)
            );
            let reversals = |o: &Outcome| reversals(o, 0.0, f64::MAX);
            assert!(ratio(&with) >= 0.99, "seed {seed}: {:.4}", ratio(&with));
            // The 25 % of the static peak-sized pool's idle VM-minutes, with the
            // model's margin (it predicted the benchmark within two points).
            assert!(share(&with) <= 0.27, "seed {seed}: {:.3}", share(&with));
            // Each hint takes the size up once and lets it go once.
            assert!(
                reversals(&with) <= reversals(&without) + 2 * hints.len(),
                "seed {seed}: {} for {} hints",
                reversals(&with),
                hints.len()
            );
            assert!(
                with.idle_vm_minutes <= 0.85 * without.idle_vm_minutes,
                "seed {seed}: the buffer is not kept for what the hints announce"
            );
            // Only the bursts of fewer than 10, unannounced, keep a buffer: at most their size.
            let most = with.buffers.iter().map(|(_, b)| *b).max().unwrap_or(0);
            assert!(most <= 9, "seed {seed}: {most}");
        }
    }

    /// The unannounced day against pools told when its bursts may come (from 07:00 to 17:00)
    /// and at what rate its steady claims do, each keeping a constant size through those hours
    /// (from a mean boot before): the steady load's slots plus an idle buffer, one for the two
    /// peak hours and one after. A policy not told of each burst does about best with a
    /// constant buffer while they may come: a burst's instant is a Poisson arrival, and its
    /// misses are convex in the buffer. None of them that costs at most 27 % of the static
    /// peak-sized pool's idle VM-minutes is 99 % warm, so the two targets for this day
    /// (99 % warm at 25 %) cannot both be met without hints. (Session 13 estimated 28 % from
    /// the bursts' sizes alone, leaving out the steady claims that miss after a burst larger
    /// than the buffer: it takes every idle VM, and the claims of the next provisioning time
    /// wait for the VMs it started.) The autoscaled pool, which finds the hours, the rate and
    /// the buffer itself, spends at most 12 points more than the cheapest of them that is.
    #[test]
    fn the_unannounced_day_costs_near_what_a_buffer_told_the_burst_hours_does() {
        for seed in [1, 2, 3] {
            let (arrivals, _) = model_day(seed, 180.0);
            let auto = replay(&arrivals, 86_400.0, 30.0, 0.99, Seen::All, &[]);
            let told: Vec<(Seen, Outcome)> = [40, 50, 60]
                .into_iter()
                .flat_map(|peak| [35, 40, 45, 50].map(|rest| Seen::Told(peak, rest)))
                .map(|seen| (seen, replay(&arrivals, 86_400.0, 30.0, 0.99, seen, &[])))
                .collect();
            for (seen, o) in &told {
                eprintln!("seed {seed}: {seen:?}: {:.4} warm at {:.3}", ratio(o), share(o));
                if share(o) <= 0.27 {
                    assert!(ratio(o) < 0.99, "seed {seed}: {seen:?} is 99 % warm at {:.3}", share(o));
                }
            }
            let warm = told.iter().filter(|(_, o)| ratio(o) >= 0.99);
            let best = warm.map(|(_, o)| share(o)).fold(f64::INFINITY, f64::min);
            eprintln!("seed {seed}: autoscaled {:.4} at {:.3}; told at best {best:.3}", ratio(&auto), share(&auto));
            assert!(best.is_finite(), "seed {seed}: a buffer told the hours reaches 99 %");
            assert!(ratio(&auto) >= 0.99, "seed {seed}: {:.4}", ratio(&auto));
            assert!(share(&auto) <= best + 0.12, "seed {seed}: {:.3} against {best:.3}", share(&auto));
        }
    }

    /// Steps are no batches: two within an hour (from 0.02 to 5 claims/s for ten minutes,
    /// twice, twenty minutes apart) leave no confirmed batch and no buffer, where their first
    /// seconds look like one (two, unconfirmed, without `batches::record`'s confirmation).
    #[test]
    fn steps_keep_no_batch_buffer() {
        let (arrivals, end) =
            segments(7, &[(3600.0, 0.02), (600.0, 5.0), (1200.0, 0.02), (600.0, 5.0), (3600.0, 0.02)]);
        let o = replay(&arrivals, end, 30.0, 0.99, Seen::All, &[]);
        assert_eq!(o.confirmed, 0);
        assert_eq!(o.buffers.iter().map(|(_, b)| *b).max(), Some(0));
    }

    /// The step benchmark's trace in the model: 0.02 claims/s for an hour, 2 claims/s for 30
    /// minutes, four seeds. A drained pool creates VMs for the claims that will wait until its
    /// first VMs come up, twice over (`sizing::waiting_need`, `DRAIN_HEADROOM`), so the
    /// rolling minute's warm hits are back at 95 % and stay there within 88–91 s of the
    /// step's first claim (the target: boot + 60 s, 90 s at the simulator's 30 s median).
    /// Created once over, the waiting requests were served only by the slowest boots: 95–96 s.
    /// VMs created for each request as it was refused came up after those sized for the claims
    /// behind it, which the waiting requests took: 99–119 s (103 for seed 7).
    #[test]
    fn a_step_is_warm_again_within_a_boot_and_a_minute_or_so() {
        for seed in [7, 8, 9, 10] {
            let (arrivals, end) = segments(seed, &[(3600.0, 0.02), (1800.0, 2.0), (1800.0, 0.02)]);
            let o = replay(&arrivals, end, 30.0, 0.99, Seen::All, &[]);
            // The step's first claim (the quiet hour's last gap runs past its end).
            let step = *arrivals.iter().find(|a| **a >= 3600.0).unwrap();
            // The first second from which every rolling minute holds at least 95 % warm.
            let (mut back, mut s) = (None, step);
            while s < 5400.0 {
                let minute = o.attempts.iter().filter(|(a, _)| *a > s - 60.0 && *a <= s);
                let (n, warm) = minute.fold((0, 0), |(n, w), (_, hit)| (n + 1, w + usize::from(*hit)));
                let ok = warm as f64 >= 0.95 * n as f64;
                back = if ok { back.or(Some(s - step)) } else { None };
                s += 1.0;
            }
            let back = back.expect("back at 95 %");
            eprintln!("seed {seed}: back at 95 % {back:.0} s after the step; {} created", o.created);
            assert!(back <= 92.0, "seed {seed}: {back:.0} s");
        }
    }

    /// The same step's size: up while it comes, down once its drain is over, not up and down
    /// with every request served and refused while its first VMs come up (`sizing::decide`'s
    /// drain). From the step's first claim to ten minutes after its end: the step's own
    /// reversal (up, then down when the drain is over), and at most a VM of the steady load's
    /// estimate up and back (3, 1, 1, 1: seed 7 goes 91 → 93 halfway through the step and back
    /// at its end; 1, 1, 1, 1 when the provisioning time was the last 20 VMs up alone, 3, 1, 1,
    /// 1 when a size that fell while VMs booted shed the ready ones); following the waiting
    /// requests, 5–9.
    #[test]
    fn a_steps_drain_takes_the_size_up_and_down_once() {
        for seed in [7, 8, 9, 10] {
            let (arrivals, end) = segments(seed, &[(3600.0, 0.02), (1800.0, 2.0), (1800.0, 0.02)]);
            let o = replay(&arrivals, end, 30.0, 0.99, Seen::All, &[]);
            let step = *arrivals.iter().find(|a| **a >= 3600.0).unwrap();
            let n = reversals(&o, step - 2.0, 5400.0 + 600.0);
            let peak = o.sizes.iter().map(|(_, s)| *s).max().unwrap();
            eprintln!("seed {seed}: {n} reversals, peak {peak}");
            assert!(n <= 3, "seed {seed}: {n}");
        }
    }

    /// The same step, unannounced and announced as the benchmark's `step-hinted` announces it
    /// (its first two minutes' 240 claims, 180 s ahead): the size is back near the model's
    /// after the step (4 VMs at 0.02 claims/s and a 31 s mean boot; near: 5) within ten
    /// minutes of its end, the target. Sized by the last 20 VMs up alone, which after
    /// the step are its slowest boots until 20 more come up, it took 450–1,096 s (seeds 7–10);
    /// by the lower of that and the VMs ordered by creation, 376–586 s.
    #[test]
    fn a_steps_size_is_back_near_the_models_within_ten_minutes_of_its_end() {
        for seed in [7, 8, 9, 10] {
            let (arrivals, end) = segments(seed, &[(3600.0, 0.02), (1800.0, 2.0), (1800.0, 0.02)]);
            for hints in [vec![], vec![(3600.0 - 180.0, 240, 300.0)]] {
                let o = replay(&arrivals, end, 30.0, 0.99, Seen::All, &hints);
                let down = o.sizes.iter().find(|(t, d)| *t >= 5400.0 && *d <= 5).map(|(t, _)| t - 5400.0);
                eprintln!("seed {seed} ({} hints): size 5 or less {down:?} s after the step", hints.len());
                assert!(down.is_some_and(|s| s <= 600.0), "seed {seed}, {} hints: {down:?}", hints.len());
            }
        }
    }
}
