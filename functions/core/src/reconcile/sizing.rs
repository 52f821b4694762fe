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
//! is at most `1 - target_warm_ratio`; Erlang B holds for any holding-time distribution
//! and depends on it only through its mean, so `p` is the mean of the recent provisioning
//! times (not held up by a wave's slowest boots: `super::scale::decision_with`; the status
//! shows their p90; sized by the p90, every busy pool carried the
//! difference idle: a third more slots for the simulator's log-normal boots). Requests
//! refused and still waiting each add a VM, not remembered by the stabilization window; while
//! they wait, and for a provisioning time after, the size does not go down (a drain).
//! Or, with `buffer`, an explicit number of idle VMs on top of the busy ones (Actions Runner
//! Controller's `minRunners + assignedJobs`). With a warm ratio, batches of claims at once
//! that keep coming add an idle buffer of their own (`super::batches`; [`Observed::batch_buffer`]).
//!
//! Up at once, down only after a stabilization window: the size never goes below the highest
//! recommendation of the last `scale_down_stabilization_seconds` plus a tenth (Kubernetes'
//! HPA keeps the window's highest; the tenth is a dead band, so a steady load whose estimate
//! wobbles does not walk the size up and down). A hint (announced claims not yet arrived) adds
//! its claims to the demand as it was when the hint came, until they arrive or it expires;
//! the size is the larger of that and the demand measured since (which counts the announced
//! claims as they arrive). The ceiling counts every VM of the pool.

use crate::domain::{Autoscaling, ScaleReason, ScalingState, Strategy};

/// What was measured for one pool, as the sizing step reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observed {
    /// The arrival rate the size is computed for ([`arrival_rate`]), per second.
    pub demand_per_second: f64,
    /// When the estimate last saw the demand change (seconds; 0: never) and whether it went
    /// up: kept in the state.
    pub since: f64,
    pub rising: bool,
    /// Claims that took a VM, per second, over the demand window.
    pub claims_per_second: f64,
    /// Claims refused with 429 (each request once, however often retried), per second.
    pub refused_per_second: f64,
    /// The p90 of recent VMs' creation to AVAILABLE, seconds: what the status shows.
    pub provisioning_seconds: f64,
    /// Their mean, seconds: what a slot is out for on average, which is all of the
    /// provisioning time Erlang B depends on.
    pub provisioning_mean_seconds: f64,
    /// VMs leased or being claimed now.
    pub busy: i64,
    /// Announced claims that have not arrived yet, while the hint lasts.
    pub hint_remaining: i64,
    /// The idle buffer for batches of claims at once (`super::batches::buffer`; 0: none).
    pub batch_buffer: i64,
    /// VMs for requests refused within the demand window and not served since, each waiting
    /// for a VM of its own, on top of what the rate asks for ([`waiting_need`]).
    pub pending: i64,
}

/// A decision: the size to work towards and why, and the state to keep.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub desired: i32,
    pub reason: ScaleReason,
    pub state: ScalingState,
}

/// Arrivals (claims that took a VM, and requests refused for want of one) counted over nested
/// windows ending now, shortest first: the demand window `w`, `5w` and `30w`, each cut to the
/// pool's age and the last change seen ([`cut_spans`]; `spans`, seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Arrivals {
    pub counts: [i64; 3],
    pub spans: [f64; 3],
    /// The longest window uncut (seconds): the half arrival is spread over it.
    pub full: f64,
    /// The provisioning time (seconds): a change seen by a window shorter than that counts
    /// as that many more (or fewer) slots out, not as a rate to extrapolate.
    pub provisioning: f64,
    /// Seconds since the demand was last seen going up (`None`: its last change was down).
    pub rising_since: Option<f64>,
    /// Arrivals in the last few seconds, as consecutive slices of `slice` seconds ending now
    /// (oldest first): the rate of a rise while it comes ([`arrival_rate`]).
    pub slices: [i64; 4],
    pub slice: f64,
}

/// The significance a window's count must reach against the rate of the longer windows
/// before it replaces that rate, one per tail: a steady Poisson load (whose counts wobble by
/// their square root) almost never moves the estimate, while a step moves it within a few
/// arrivals. A rise needs less evidence than a fall: a false rise costs a few idle VMs for a
/// stabilization window, a false fall (or a late rise) costs cold claims.
pub const RISE_SIGNIFICANCE: f64 = 1e-4;
pub const FALL_SIGNIFICANCE: f64 = 1e-5;

/// The arrival rate to size for, and whether it changed: the longest window's rate (with
/// half an arrival per full window added, so an empty window is not a certain zero),
/// replaced by a shorter window's when that window's count is significantly unlikely under it
/// ([`RISE_SIGNIFICANCE`], [`FALL_SIGNIFICANCE`]), from the longer to the shorter. Steady load: the longest
/// window's rate, which barely wobbles; a step up or down: the window that saw it, as soon as
/// its count says so (a step from 0.02 to 2 claims/s within a few seconds, back down within a
/// minute of its end). The second value says a change was seen and whether it went up, with
/// how long ago the new demand started: the detecting window's span for a rise (its arrivals
/// are the new demand's, diluted), none for a fall (the detecting window still holds the old
/// demand's tail). The caller starts every window no earlier than that from now on
/// (`ScalingState::since`, [`cut_spans`]; never less than the shortest window), so what came
/// before the change never leaks back into the estimate.
pub fn arrival_rate(a: &Arrivals) -> (f64, Option<(f64, bool)>) {
    let span = |i: usize| a.spans[i].max(1.0);
    let mut rate = a.counts[2].max(0) as f64 / span(2) + 0.5 / a.full.max(1.0);
    let mut change = None;
    for i in [1, 0] {
        let n = a.counts[i].max(0);
        let Some(up) = shift(n, rate * span(i)).filter(|_| span(i) < span(i + 1)) else { continue };
        rate = if span(i) < a.provisioning {
            // A window shorter than a provisioning interval (provisioning above the demand
            // window, or a young pool) cannot tell a step from a batch (a 50-job matrix
            // arriving at once): its excess over the rate so far is that many more slots out
            // for one provisioning interval (Little's law), so a batch of 50 asks for 50 more
            // VMs, not for its count extrapolated to the interval; a step keeps adding as its
            // arrivals keep coming. A longer window's rate times the provisioning time asks
            // for at most the batch.
            (rate + (n as f64 - rate * span(i)) / a.provisioning).max(0.0)
        } else {
            n as f64 / span(i)
        };
        change = Some((if up { span(i) } else { 0.0 }, up));
    }
    // Within two windows of a step up, the windows cut at the step still hold up to a window
    // of the lower demand before it: the shortest window is the better estimate while it is
    // higher (a ramp is followed as it comes, not diluted).
    let rising = rose_lately(change, a.rising_since, span(0));
    if change.is_none() && rising {
        rate = rate.max(a.counts[0].max(0) as f64 / span(0));
    }
    // A rise is sized for its own rate as it comes, not for the window that saw it: that
    // window's count over its span grows with the rise's age, so a step from 0.02 to 2
    // claims/s read as 0.3/s ten seconds in and reached 2/s only a window later (a minute; the
    // pool grew 5 → 96 VMs over 45 s in the step benchmark at the demand, and its
    // claims went cold for that minute plus a boot). The last seconds' slices say the rate
    // now: the second-lowest of them, so a batch (a matrix's claims at once, in one slice or
    // across two) is never read as a rate; it counts as slots out above, through the windows.
    // Only while a rise is under way: a steady load's estimate never comes from them.
    if rising && a.slice > 0.0 {
        let mut sl = a.slices.map(|n| n.max(0));
        sl.sort_unstable();
        rate = rate.max(sl[1] as f64 / a.slice);
    }
    (rate, change)
}

/// Whether the demand is rising: a rise seen now ([`arrival_rate`]'s change), or one seen
/// within two of the `shortest` window's spans (`rising_since`: seconds since the last change,
/// when it went up). The rate's estimate follows the shortest window and the last seconds
/// meanwhile; a drain then gets its headroom ([`waiting_need`]).
pub fn rose_lately(change: Option<(f64, bool)>, rising_since: Option<f64>, shortest: f64) -> bool {
    change.is_some_and(|(_, up)| up) || rising_since.is_some_and(|s| s < 2.0 * shortest)
}

/// The spans of windows `w` (shortest first), `age` seconds after the pool was created and
/// `since_change` after its demand last changed: each cut to that history, but none below the
/// shortest (the demand window), which a change just seen is followed through.
pub fn cut_spans(w: [f64; 3], age: f64, since_change: f64) -> [f64; 3] {
    let seen = since_change.max(w[0]).min(age).max(1.0);
    w.map(|x| x.min(seen))
}

/// Whether `n` arrivals are significantly more (`Some(true)`, upper tail below
/// [`RISE_SIGNIFICANCE`]) or fewer (`Some(false)`, lower tail below [`FALL_SIGNIFICANCE`])
/// than the `mu` expected.
pub fn shift(n: i64, mu: f64) -> Option<bool> {
    if changed_tail(n, mu, RISE_SIGNIFICANCE, true) {
        Some(true)
    } else if changed_tail(n, mu, FALL_SIGNIFICANCE, false) {
        Some(false)
    } else {
        None
    }
}

/// Whether the upper (`upper`) or lower Poisson tail of `n` at mean `mu` is below `alpha`:
/// exact up to a mean of 400, by the normal approximation with continuity correction above.
pub fn changed_tail(n: i64, mu: f64, alpha: f64, upper: bool) -> bool {
    if mu.is_nan() || mu <= 0.0 {
        return upper && n > 0;
    }
    let nf = n as f64;
    if mu > 400.0 {
        // z of the one-sided tail alpha (Abramowitz and Stegun 26.2.23, within 5e-4).
        let t = (-2.0 * alpha.ln()).sqrt();
        let z = t
            - (2.515_517 + 0.802_853 * t + 0.010_328 * t * t)
                / (1.0 + 1.432_788 * t + 0.189_269 * t * t + 0.001_308 * t * t * t);
        return if upper { (nf - 0.5 - mu) / mu.sqrt() > z } else { (nf + 0.5 - mu) / mu.sqrt() < -z };
    }
    if nf > mu + 12.0 * mu.sqrt() + 30.0 {
        return upper;
    }
    // P(N <= n) and P(N >= n) by the recursion pmf(k) = pmf(k-1)·mu/k.
    let (mut pmf, mut below) = ((-mu).exp(), 0.0);
    for k in 0..=n {
        if k > 0 {
            pmf *= mu / k as f64;
        }
        below += pmf;
    }
    if upper { 1.0 - (below - pmf) < alpha } else { below < alpha }
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

/// A drained pool: at least this many requests waiting …
pub const DRAINED_MIN_WAITING: i64 = 3;
/// … and at least this share of the arrivals since its first refusal in the window.
pub const DRAINED_SHARE: f64 = 0.5;
/// Within a provisioning interval of a drain's first refusal, while the demand is rising, its
/// VMs are created this many times over: about half of them are up by the mean provisioning
/// time (boots spread around it), and that half serves the requests waiting by then
/// ([`waiting_need`]).
pub const DRAIN_HEADROOM: f64 = 2.0;

/// The VMs a pool's waiting requests need ([`Observed::pending`]): one each, and, while the
/// pool is drained (most of its arrivals since its first refusal in the window still wait:
/// [`DRAINED_MIN_WAITING`], [`DRAINED_SHARE`]), one for each claim of the rest of the
/// provisioning interval since that refusal. Until the first VMs created for the drain come
/// up, every claim is refused and waits; a VM created when it is refused comes up a
/// provisioning interval later, after the VMs sized for the claims that follow, which the
/// waiting requests take first (a retry comes before a fresh claim when the pool is empty),
/// so those claims missed too, one interval after another. Created at the drain's start
/// instead, the waiting requests and the claims after them are served as the first VMs come
/// up. Those VMs come up spread around the mean provisioning time, and until the requests
/// waiting are served every fresh claim misses: sized for the need, the last of them were
/// served by the slowest boots. So within that interval, when the demand has just risen
/// (`rising`: nothing was booting for the new claims), the need is created
/// [`DRAIN_HEADROOM`] times over, and the backlog is served by the time about half of the
/// VMs are up; the rest are shed as they come up once the drain is over (extra boots, few
/// idle minutes). A steady pool that runs out for a moment (the Erlang loss it is sized for)
/// has the replacements of the claims that emptied it booting already: once over. `waiting`:
/// requests refused within the window and not served; `rate` per second, `holding` the mean
/// provisioning time and `since` the seconds since the first refusal.
pub fn waiting_need(waiting: i64, rate: f64, holding: f64, since: Option<f64>, rising: bool) -> i64 {
    let waiting = waiting.max(0);
    let (rate, holding) = (rate.max(0.0), holding.max(0.0));
    let left = match since {
        Some(age) if waiting >= DRAINED_MIN_WAITING && waiting as f64 >= DRAINED_SHARE * rate * age.max(0.0) => {
            holding - age.max(0.0)
        }
        _ => 0.0,
    };
    if !(left > 0.0 && (rate * left).is_finite()) {
        return waiting;
    }
    ((waiting as f64 + rate * left) * if rising { DRAIN_HEADROOM } else { 1.0 }).ceil() as i64
}

/// Whether the strategy counts leased VMs in its size.
fn counts_leased(strategy: Strategy) -> bool {
    !matches!(strategy, Strategy::ImmediateOnLease)
}

/// The size demand asks for, before the floor, the ceiling and the stabilization: the demand
/// part, and the hint on top.
fn demand_size(strategy: Strategy, policy: &Autoscaling, o: &Observed, busy_avg: f64) -> (i64, i64) {
    let cap = u32::try_from(policy.max.max(0)).unwrap_or(0) + 1;
    let lambda = o.demand_per_second.max(0.0);
    let p = o.provisioning_mean_seconds.max(0.0);
    let demand = match (policy.buffer, policy.target_warm_ratio) {
        (Some(b), _) => i64::from(b) + if counts_leased(strategy) { o.busy } else { 0 },
        (None, Some(r)) => {
            // The busy VMs: their moving average, or the count now when it is far above it
            // (a matrix burst leases 50 at once); not the count's every wobble, which would
            // walk a small pool up and down.
            let now = o.busy as f64;
            let busy = if now > busy_avg + 3.0 * busy_avg.sqrt() + 1.0 { now } else { busy_avg };
            let load = lambda * p + if counts_leased(strategy) { busy } else { 0.0 };
            // Batches (claims at once) are served warm by idle VMs at their instant: the
            // buffer is that many on top of the slots the load keeps out on average, of which
            // Erlang B's own slack is a part (`super::batches`).
            let batched = if o.batch_buffer > 0 { load.ceil() as i64 + o.batch_buffer } else { 0 };
            i64::from(servers_for(load, 1.0 - r, cap)).max(batched)
        }
        (None, None) => 0,
    };
    (demand, o.hint_remaining.max(0))
}

/// The decision for one pool at `now` (seconds), given its previous `desired` size and state.
/// `window` is the demand window (seconds): the busy average's time constant. The state's
/// batches are carried over from `prev`: the caller (`scale`) sets the ones it recorded.
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
    // A hint announces claims that the demand then measures as they arrive: the rate they
    // make is sized for (λ·p slots for the claims of the coming provisioning interval, which
    // are the announced ones still to come) and, for a strategy that counts leased VMs, each
    // arrived claim is busy. Added on top of that demand, the announced claims counted twice:
    // a step announced by a hint of its first two minutes held its rate's size plus those
    // claims (docs/benchmarks.md, session 12: 16 % more idle VM-minutes for no warm hit).
    // So the hint's claims not arrived yet add to the demand as it was when the hint was
    // first seen (kept in the state while the hint lasts), and the size is the larger of that
    // and the demand now: an announced step is sized for its claims, then for its rate.
    let hint_base = (hint > 0).then(|| prev.hint_base.unwrap_or(demand));
    let hinted = hint_base.map(|b| b + hint).filter(|h| *h > demand);
    // The ceiling counts every VM. For a strategy whose size leaves leased VMs out, that is
    // enforced where VMs are created (`strategy::ceiling_room`), not here: a desired size that
    // moved with every claim would shed and re-create VMs and flap.
    let ceiling = i64::from(policy.max);
    let floor = i64::from(policy.min).min(ceiling);
    // Requests waiting (refused, retrying) each take the first VM that comes up, before the
    // claims the rate's slots are for: without them on top, a step's first claims took the
    // VMs sized for the claims after them, which then missed too, one provisioning interval
    // after another. Not remembered by the stabilization window: once served, they are busy.
    let raw = hinted.unwrap_or(demand) + o.pending.max(0);
    let (rec, rec_reason) = if raw > ceiling {
        (ceiling, ScaleReason::Ceiling)
    } else if raw < floor {
        (floor, ScaleReason::Floor)
    } else if hinted.is_some() {
        (raw, ScaleReason::Hint)
    } else {
        (raw, ScaleReason::Demand)
    };
    let rec = i32::try_from(rec).unwrap_or(policy.max);
    // What the stabilization window remembers is the measured demand's recommendation: a
    // hint's claims, once they came, took the VMs it asked for, so nothing is held for it.
    let measured = i32::try_from(demand.clamp(floor, ceiling)).unwrap_or(policy.max);

    // The stabilization window's recommendations, in buckets of a twentieth of it.
    let stab = f64::from(policy.scale_down_stabilization_seconds.max(0));
    let bucket = (stab / 20.0).max(1.0);
    let start = (now / bucket).floor() * bucket;
    // No window: no history, the size follows the recommendation down at once.
    let mut recs: Vec<(f64, i32)> =
        if stab > 0.0 { prev.recs.iter().copied().filter(|(t, _)| *t > now - stab - bucket).collect() } else { vec![] };
    let first = prev.at <= 0.0 && stab > 0.0;
    if first {
        // The first decision since autoscaling was switched on (a new pool, or an existing
        // one given the block): the size it starts from (`size`) is the window's first
        // recommendation, so the pool keeps it for a stabilization window before the demand
        // measured since takes it down, as HPA seeds its window with the replicas it found.
        // Without it, a pool went to its floor in its first pass, before any demand could
        // have been measured. Up at once, as ever.
        recs.push((start, desired));
    }
    match recs.last_mut() {
        Some((t, r)) if *t == start => *r = (*r).max(measured),
        _ => recs.push((start, measured)),
    }
    let held = recs.iter().map(|(_, r)| *r).max().unwrap_or(measured);
    let floor32 = i32::try_from(floor).unwrap_or(policy.min);
    // A drain: while requests wait for a VM, and for a provisioning time after a decision last
    // saw them, the size does not go down. The waiting part falls as they are served, the
    // rate's estimate reads a rise low while its windows still hold the quiet before it, and
    // the served requests' places are taken by new refusals while the first VMs come up one
    // by one: a size that followed them went up and down every few seconds of a step's first
    // minute (4–6 reversals an hour in the step benchmark), though the VMs it asked for were
    // all still booting. Held instead, the pool refills what the served requests took (a
    // percent more boots) and goes down once, when the drain is over.
    let draining = o.pending > 0 || (prev.waiting_at > 0.0 && now - prev.waiting_at < o.provisioning_mean_seconds);
    // A dead band of a tenth, at least one VM, above the window's highest recommendation; none
    // when the whole window asked for the floor (an idle pool goes back to its floor).
    let band = if held <= floor32 || stab <= 0.0 { 0 } else { ((f64::from(held) * 0.1).round() as i32).max(1) };
    let keep = (held + band).min(i32::try_from(ceiling).unwrap_or(policy.max));

    let (next, reason) = if rec > desired {
        (rec, rec_reason)
    } else if desired > keep.max(rec) && !draining {
        // Down, but not below what the window's highest recommendation asks for; the reason
        // is the recommendation's.
        (keep.max(rec), rec_reason)
    } else if desired < i32::try_from(floor).unwrap_or(policy.min) {
        (i32::try_from(floor).unwrap_or(policy.min), ScaleReason::Floor)
    } else if i64::from(desired) > ceiling {
        (i32::try_from(ceiling).unwrap_or(policy.max), ScaleReason::Ceiling)
    } else {
        // Kept: for the reason it has; the size a pool starts from, held above what the
        // demand asks for, is the spec's (STATIC).
        (desired, prev.reason.unwrap_or(if first && desired > rec { ScaleReason::Static } else { rec_reason }))
    };
    let lambda = o.demand_per_second;
    let state = ScalingState {
        recs,
        busy_avg,
        at: now,
        reason: Some(reason),
        demand_per_second: o.demand_per_second,
        since: if o.since > prev.since { o.since } else { prev.since },
        rising: if o.since > prev.since { o.rising } else { prev.rising },
        claims_per_second: o.claims_per_second,
        refused_per_second: o.refused_per_second,
        provisioning_seconds: o.provisioning_seconds,
        expected_claims: hint,
        hint_base,
        hint_rate: prev.hint_rate,
        hint_announced: prev.hint_announced,
        batches: prev.batches.clone(),
        batch_buffer: o.batch_buffer,
        waiting_at: if o.pending > 0 { now } else { prev.waiting_at },
        active: o.batch_buffer > 0
            || o.pending > 0
            || lambda > 0.0
            || hint > 0
            || o.busy > 0
            || busy_avg >= 0.05
            || next != policy.min,
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
        Observed {
            demand_per_second: lambda,
            claims_per_second: lambda,
            provisioning_seconds: p,
            provisioning_mean_seconds: p,
            busy,
            ..Observed::default()
        }
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

    /// A pool created (or switched to autoscaling) at `size` keeps it for a stabilization
    /// window before the demand measured since takes it down: none can have been measured by
    /// its first pass. Up at once, as ever; without a window, down at once.
    #[test]
    fn a_new_pool_keeps_its_size_for_a_stabilization_window_then_follows_demand() {
        let p = ratio(1, 100, 0.99, 300);
        let (mut st, mut desired) = (ScalingState::default(), 19);
        for t in [10.0, 100.0, 200.0, 300.0] {
            let d = decide(Strategy::ImmediateOnLease, &p, &Observed::default(), desired, &st, t, 60.0);
            assert_eq!((d.desired, d.reason), (19, ScaleReason::Static), "kept at {t}");
            assert!(d.state.active, "looked at again");
            (desired, st) = (d.desired, d.state);
        }
        let d = decide(Strategy::ImmediateOnLease, &p, &Observed::default(), desired, &st, 330.0, 60.0);
        assert_eq!((d.desired, d.reason), (1, ScaleReason::Floor), "past the window");
        let d = decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 30.0, 0), 19, &ScalingState::default(), 10.0, 60.0);
        assert!(d.desired > 30, "up at once: {d:?}");
        let none = ratio(1, 100, 0.99, 0);
        let d =
            decide(Strategy::ImmediateOnLease, &none, &Observed::default(), 19, &ScalingState::default(), 10.0, 60.0);
        assert_eq!(d.desired, 1, "no window");
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

    /// Once a hint's claims came, they took the VMs it asked for: the size falls back to the
    /// measured demand's at once, not held for a stabilization window as a measured peak is.
    #[test]
    fn a_hint_is_not_held_once_its_claims_came() {
        let p = ratio(1, 200, 0.99, 300);
        let o = Observed { hint_remaining: 50, ..Observed::default() };
        let hinted = decide(Strategy::ImmediateOnLease, &p, &o, 1, &ScalingState::default(), 10.0, 60.0);
        assert_eq!((hinted.desired, hinted.reason), (50, ScaleReason::Hint));
        let after = decide(Strategy::ImmediateOnLease, &p, &Observed::default(), 50, &hinted.state, 12.0, 60.0);
        assert_eq!((after.desired, after.reason), (1, ScaleReason::Floor));
        // A measured peak is held.
        let peak = decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 45.0, 0), 1, &ScalingState::default(), 10.0, 60.0);
        let later = decide(Strategy::ImmediateOnLease, &p, &Observed::default(), peak.desired, &peak.state, 12.0, 60.0);
        assert_eq!(later.desired, peak.desired);
    }

    /// Erlang B depends on the provisioning time through its mean only: the load is the rate
    /// times the mean, whatever the p90 (the status's figure) says.
    #[test]
    fn the_load_is_the_rate_times_the_mean_provisioning_time() {
        let p = ratio(1, 1000, 0.99, 300);
        let o = Observed { provisioning_seconds: 41.0, provisioning_mean_seconds: 31.0, ..obs(2.0, 41.0, 0) };
        let d = decide(Strategy::ImmediateOnLease, &p, &o, 1, &ScalingState::default(), 100.0, 60.0);
        assert_eq!(d.desired as u32, servers_for(62.0, 0.01, 1001));
        assert!(servers_for(82.0, 0.01, 1001) > d.desired as u32 + 15, "the p90's load asks for many more");
        assert_eq!(d.state.provisioning_seconds, 41.0, "the status shows the p90");
    }

    /// A drained pool's waiting requests, and the claims of the rest of the provisioning
    /// interval since its first refusal, which will wait too; an isolated miss is one VM.
    #[test]
    fn a_drained_pool_needs_vms_for_the_claims_that_will_wait_too() {
        // 2 claims/s, 31 s mean provisioning, the first refusal 10 s ago and 20 waiting:
        // drained, 21 s of claims still to come before the first VMs do; twice that, so the
        // half of them that is up by the mean provisioning time serves them.
        assert_eq!(waiting_need(20, 2.0, 31.0, Some(10.0), true), 2 * (20 + 42));
        assert_eq!(waiting_need(40, 2.0, 31.0, Some(30.9), true), 81, "2 × (40 + 0.2)");
        // A steady pool run out for a moment: its replacements are booting already.
        assert_eq!(waiting_need(20, 2.0, 31.0, Some(10.0), false), 20 + 42);
        // Past a provisioning interval since (the VMs created for it have come up): what
        // waits only.
        assert_eq!(waiting_need(70, 2.0, 31.0, Some(40.0), true), 70);
        // A steady pool's misses: a few of the arrivals since the first one.
        assert_eq!(waiting_need(5, 2.0, 31.0, Some(20.0), true), 5);
        assert_eq!(waiting_need(2, 2.0, 31.0, Some(1.0), true), 2, "fewer than three");
        assert_eq!(waiting_need(0, 2.0, 31.0, None, true), 0);
        assert_eq!(waiting_need(-3, f64::NAN, 31.0, Some(1.0), true), 0);
    }

    /// Requests refused and still waiting each take the first VM that comes up: a VM each on
    /// top of what the rate asks for. Once they are served (they are then busy, and their
    /// claims are in the rate) the size goes down after a provisioning time without a request
    /// waiting, not after the stabilization window: a drain's served requests and new
    /// refusals do not take it down and up again.
    #[test]
    fn waiting_requests_each_add_a_vm_held_for_a_provisioning_time_not_the_window() {
        let p = ratio(1, 1000, 0.99, 300);
        let base = decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 10.0, 0), 1, &ScalingState::default(), 100.0, 60.0);
        let waiting = Observed { pending: 25, ..obs(1.0, 10.0, 0) };
        let up = decide(Strategy::ImmediateOnLease, &p, &waiting, base.desired, &base.state, 102.0, 60.0);
        assert_eq!(up.desired, base.desired + 25);
        assert_eq!(up.reason, ScaleReason::Demand);
        // Served 2 s later: still a drain (the provisioning time is 10 s).
        let served = decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 10.0, 0), up.desired, &up.state, 104.0, 60.0);
        assert_eq!(served.desired, up.desired, "held while the drain's VMs come up");
        let again = Observed { pending: 3, ..obs(1.0, 10.0, 0) };
        let refused = decide(Strategy::ImmediateOnLease, &p, &again, served.desired, &served.state, 108.0, 60.0);
        assert_eq!(refused.desired, up.desired, "new refusals within it: no change");
        let quiet =
            decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 10.0, 0), refused.desired, &refused.state, 117.0, 60.0);
        assert_eq!(quiet.desired, up.desired, "9 s after the last request waited");
        let over = decide(Strategy::ImmediateOnLease, &p, &obs(1.0, 10.0, 0), quiet.desired, &quiet.state, 119.0, 60.0);
        let band = ((f64::from(base.desired) * 0.1).round() as i32).max(1);
        assert_eq!(over.desired, base.desired + band, "then down to the held rate's size and its dead band at once");
        // At the ceiling, the ceiling.
        let capped = ratio(1, 20, 0.99, 300);
        let d = decide(Strategy::ImmediateOnLease, &capped, &waiting, 1, &ScalingState::default(), 100.0, 60.0);
        assert_eq!((d.desired, d.reason), (20, ScaleReason::Ceiling));
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
        let st = ScalingState {
            recs: vec![(0.0, 50)],
            at: 5.0,
            reason: Some(ScaleReason::Demand),
            ..ScalingState::default()
        };
        let d = decide(Strategy::ReplaceOnDelete, &p, &Observed::default(), 50, &st, 10.0, 60.0);
        assert_eq!(d.desired, 8, "above the new ceiling");
        let d = decide(Strategy::ReplaceOnDelete, &p, &Observed::default(), 1, &ScalingState::default(), 10.0, 60.0);
        assert_eq!(d.desired, 5, "below the new floor");
        assert_eq!(p.initial_size(3), 5);
        assert_eq!(p.initial_size(30), 8);
    }

    /// A reproducible Poisson process: arrival times over `segments` of (seconds, rate).
    fn poisson_arrivals(segments: &[(f64, f64)], seed: u64) -> Vec<f64> {
        let mut x = seed.max(1);
        let mut uniform = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (mut out, mut start) = (vec![], 0.0);
        for &(len, rate) in segments {
            let mut t = start;
            loop {
                t += -uniform().ln() / rate;
                if t >= start + len {
                    break;
                }
                out.push(t);
            }
            start += len;
        }
        out
    }

    /// Replays arrivals through the estimator and `decide` every `step` seconds (an
    /// IMMEDIATE_ON_LEASE pool, 45 s provisioning, a 60 s window, 300 s stabilization):
    /// the (time, desired) of every pass.
    fn replay(arrivals: &[f64], until: f64, step: f64) -> Vec<(f64, i32)> {
        replay_hinted(arrivals, until, step, |_| 0)
    }

    /// [`replay`], with `hint(t)` announced claims not arrived yet at `t`.
    fn replay_hinted(arrivals: &[f64], until: f64, step: f64, hint: impl Fn(f64) -> i64) -> Vec<(f64, i32)> {
        let p = ratio(1, 1000, 0.99, 300);
        let (mut desired, mut st, mut out) = (1, ScalingState::default(), vec![]);
        let (mut t, mut since, mut rising) = (step, 0.0, false);
        while t < until {
            let count =
                |w: f64| (arrivals.partition_point(|a| *a <= t) - arrivals.partition_point(|a| *a <= t - w)) as i64;
            let spans = cut_spans([60.0, 300.0, 1800.0], t, t - since);
            let rising_since = rising.then_some(t - since);
            let between = |from: f64, to: f64| {
                (arrivals.partition_point(|a| *a < t - to) - arrivals.partition_point(|a| *a < t - from)) as i64
            };
            let slice = 60.0 / 24.0;
            let slices = [4.0, 3.0, 2.0, 1.0].map(|j: f64| between(j * slice, (j - 1.0) * slice));
            let a = Arrivals {
                counts: spans.map(count),
                spans,
                full: 1800.0,
                provisioning: 45.0,
                rising_since,
                slices,
                slice,
            };
            let (rate, change) = arrival_rate(&a);
            if let Some((c, up)) = change {
                (since, rising) = (t - c, up);
            }
            let o = Observed {
                demand_per_second: rate,
                provisioning_seconds: 45.0,
                provisioning_mean_seconds: 45.0,
                hint_remaining: hint(t),
                ..Observed::default()
            };
            let d = decide(Strategy::ImmediateOnLease, &p, &o, desired, &st, t, 60.0);
            (desired, st) = (d.desired, d.state);
            out.push((t, desired));
            t += step;
        }
        out
    }

    /// A matrix burst of 50 claims at once on a steady 0.5 claims/s: about 50 more VMs at
    /// once (not its count extrapolated to a rate), back near the model's size within ten
    /// minutes.
    #[test]
    fn a_batch_asks_for_its_size_not_for_its_rate() {
        let mut arrivals = poisson_arrivals(&[(7200.0, 0.5)], 8);
        arrivals.extend((0..50).map(|i| 5000.0 + f64::from(i) * 0.02));
        arrivals.sort_by(f64::total_cmp);
        let sizes = replay(&arrivals, 7200.0, 1.0);
        let model = servers_for(0.5 * 45.0, 0.01, 1000) as i32;
        let before = sizes.iter().find(|(t, _)| *t >= 4990.0).unwrap().1;
        let peak = sizes.iter().filter(|(t, _)| *t >= 5000.0 && *t < 5400.0).map(|(_, s)| *s).max().unwrap();
        assert!(peak >= before + 35 && peak <= before + 75, "before {before}, peak {peak} (model {model})");
        let after = sizes.iter().find(|(t, _)| *t >= 5600.0).unwrap().1;
        assert!(after <= model + model / 5 + 2, "10 min after: {after} (model {model})");
    }

    /// A step announced by a hint of its first two minutes' claims (as the benchmark's
    /// `step-hinted` trace): the pool is warm for them before the step, and the claims are not
    /// counted twice once they arrive, as the hint's remaining claims and through the rate
    /// they make (which the sum of the two did: 107 + 220 VMs).
    #[test]
    fn an_announced_step_is_sized_for_its_claims_then_for_its_rate_not_both() {
        let arrivals = poisson_arrivals(&[(3600.0, 0.02), (1800.0, 2.0), (3600.0, 0.02)], 7);
        let (at, announced, until) = (3420.0, 240, 3420.0 + 300.0 + 45.0);
        let hint = |t: f64| {
            if t < at || t >= until {
                return 0;
            }
            let arrived = arrivals.partition_point(|a| *a <= t) - arrivals.partition_point(|a| *a <= at);
            (announced - arrived as i64).max(0)
        };
        let sizes = replay_hinted(&arrivals, 9000.0, 1.0, hint);
        let size_at = |t: f64| sizes.iter().find(|(s, _)| *s >= t).map(|(_, d)| *d).unwrap();
        let before = size_at(at - 1.0);
        assert!(size_at(3599.0) >= before + announced as i32 - 5, "warm for the announced claims before the step");
        let peak = sizes.iter().filter(|(t, _)| *t >= at && *t < 5400.0).map(|(_, s)| *s).max().unwrap();
        assert!(peak <= before + announced as i32 + 3, "peak {peak}: the hint on the size before it ({before})");
        let rate_size = servers_for(90.0, 0.01, 1000) as i32;
        assert!(size_at(3600.0 + 600.0) >= rate_size * 9 / 10, "then the step's rate: {}", size_at(4200.0));
        let low = servers_for(0.02 * 45.0, 0.01, 1000) as i32;
        assert!(size_at(5400.0 + 600.0) <= low + 2, "and back down: {}", size_at(6000.0));
    }

    fn reversals_after(sizes: &[(f64, i32)], from: f64) -> usize {
        let dirs: Vec<bool> =
            sizes.windows(2).filter(|w| w[0].0 >= from && w[1].1 != w[0].1).map(|w| w[1].1 > w[0].1).collect();
        dirs.windows(2).filter(|d| d[0] != d[1]).count()
    }

    #[test]
    fn poisson_tails_are_exact_where_it_matters() {
        // A rise at 1e-4: P(N >= 3 | 0.06) ≈ 3.4e-5, P(N >= 2 | 0.06) ≈ 1.7e-3.
        assert_eq!((shift(3, 0.06), shift(2, 0.06)), (Some(true), None));
        // Mean 120: a rise at +3.9 σ (P(N >= 166) ≈ 6e-5), a fall only at -4.3 σ.
        assert_eq!((shift(166, 120.0), shift(158, 120.0)), (Some(true), None));
        assert_eq!((shift(70, 120.0), shift(80, 120.0)), (Some(false), None));
        // Above a mean of 400 the normal approximation, same rule.
        assert_eq!((shift(3600 + 230, 3600.0), shift(3600 + 210, 3600.0)), (Some(true), None));
        assert_eq!((shift(3600 - 270, 3600.0), shift(3600 - 240, 3600.0)), (Some(false), None));
        assert_eq!((shift(1, 0.0), shift(0, 0.0)), (Some(true), None));
        assert_eq!(
            (shift(0, 12.0), shift(0, 10.0)),
            (Some(false), None),
            "P(N = 0 | 12) = 6e-6, P(N = 0 | 10) = 4.5e-5"
        );
    }

    /// Issue 22: no flapping under steady load. Ten hours of a steady Poisson load at each of
    /// the model day's rates (and the bench's scaled-down ones), a decision every 2 s: at most
    /// two reversals an hour, after the first hour.
    #[test]
    fn a_steady_poisson_load_does_not_flap_at_any_rate() {
        for (rate, seed) in [(0.001, 1), (0.005, 2), (0.02, 3), (0.1, 4), (0.5, 5), (2.0, 6)] {
            let hours = 10.0;
            let arrivals = poisson_arrivals(&[(hours * 3600.0, rate)], seed);
            let sizes = replay(&arrivals, hours * 3600.0, 2.0);
            let r = reversals_after(&sizes, 3600.0);
            assert!(r as f64 <= 2.0 * (hours - 1.0), "rate {rate}: {r} reversals in {} h", hours - 1.0);
            // And the size is the model's at that rate, within its wobble, nearly all the time
            // (a rare false rise, at most one or two in ten hours, holds a larger size for a
            // stabilization window).
            let model = servers_for(rate * 45.0, 0.01, 1000).max(1) as i32;
            let after: Vec<i32> = sizes.iter().filter(|(t, _)| *t > 3600.0).map(|(_, s)| *s).collect();
            let within =
                after.iter().filter(|s| **s >= (model * 8 / 10).max(1) - 1 && **s <= model * 13 / 10 + 2).count();
            let (lo, hi) = (after.iter().min().unwrap(), after.iter().max().unwrap());
            assert!(
                within as f64 >= 0.97 * after.len() as f64,
                "rate {rate}: model {model}, sizes {lo}..={hi}, {within} of {} within",
                after.len()
            );
        }
    }

    /// Issue 22: a step from 0.02 to 2 claims/s is followed within seconds (sized for 2
    /// claims/s 15 s in), and the size is back near the model's within ten minutes of the
    /// step's end.
    #[test]
    fn a_step_is_followed_up_at_once_and_down_within_ten_minutes() {
        let arrivals = poisson_arrivals(&[(3600.0, 0.02), (1800.0, 2.0), (3600.0, 0.02)], 7);
        let sizes = replay(&arrivals, 9000.0, 1.0);
        let at = |t: f64| sizes.iter().find(|(s, _)| *s >= t).map(|(_, d)| *d).unwrap();
        let peak = servers_for(90.0, 0.01, 1000) as i32;
        // Sized for the step's own rate within seconds (the last seconds' slices), not as the
        // 60 s window fills (that read 32 of 107 VMs 15 s in, and 95 a minute in).
        assert!(at(3600.0 + 15.0) >= peak * 9 / 10, "15 s into the step: {} of {peak}", at(3615.0));
        assert!(at(3600.0 + 60.0) >= peak * 8 / 10, "60 s into the step: {} of {peak}", at(3660.0));
        assert!(at(3600.0 + 90.0) >= peak * 9 / 10, "90 s into the step: {} of {peak}", at(3690.0));
        let low = servers_for(0.02 * 45.0, 0.01, 1000) as i32;
        assert!(at(5400.0 + 600.0) <= low + 2, "10 min after the step: {} (model {low})", at(6000.0));
        assert!(
            reversals_after(&sizes, 0.0) <= 2,
            "{:?}",
            sizes.windows(2).filter(|w| w[0].1 != w[1].1).collect::<Vec<_>>()
        );
    }
}
