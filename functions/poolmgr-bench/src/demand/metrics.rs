//! A row's figures, from what its replay recorded, the status samples and the pool's events.
//! Every time is unscaled (real seconds × k). Definitions, as `docs/benchmarks.md` states them:
//!
//! - warm hit: a claim answered 200 on its first attempt; the ratio is over every claim of
//!   the trace (a claim that never got a VM within the deadline counts as a miss);
//! - claim wait: first attempt to the 200, of the claims that got a VM;
//! - idle VM-minutes: AVAILABLE VMs integrated over the trace (status samples, step-wise);
//! - extra boots: VMs provisioned during the trace beyond the claims served and the growth of
//!   the pool's warm part (AVAILABLE + PROVISIONING) from the start to the end, i.e. VMs booted
//!   that no claim used (deleted by a scale-down, or failed);
//! - reversals: POOL_SCALED events whose direction (up/down) differs from the previous one's;
//! - refill lag: each VM_CLAIMED paired, in order, with the first later VM_AVAILABLE of the pool
//!   not paired yet; the time between them;
//! - boot: the simulator's draws for the pool's VMs (its log), and provisioning: VM_PROVISIONED
//!   to VM_AVAILABLE of each VM (events);
//! - step traces: the rolling one-minute warm-hit ratio on a 5 s grid; recovery = from the
//!   step's start to the first grid point at or above 95 % after the first one below it
//!   during the step; and, as the model measures it, from the step's first claim the first
//!   second (a 1 s grid) from which every rolling minute until the step's end holds ≥ 95 %;
//!   back down = from the step's end until the warm part is within max(1, 10 %) of its mean
//!   over the ten minutes before the step; and until the desired size is within max(1, 10 %)
//!   of the model's size at the rate after the step (the "near the model's size").
//!
//! Never asserts anything about the figures.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::replay::{ClaimRecord, Event, Replayed, Sample};
use super::trace::Trace;

/// One (trace, policy, configuration) of a run, as written to `--results`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Row {
    pub trace: String,
    pub policy: String,
    pub configuration: String,
    /// k: every duration divided by it, every rate multiplied.
    pub scale: f64,
    /// D: every arrival rate (and the burst rate) multiplied by it.
    pub demand: f64,
    pub seed: u64,
    /// How long before what they announce `autoscaled-hints` sent its hints (unscaled
    /// seconds; other policies send none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint_lead_s: Option<f64>,
    pub pool: String,
    /// The static size, or the autoscaled pool's starting size.
    pub pool_size: i64,
    pub autoscaling_min: Option<i64>,
    pub autoscaling_max: Option<i64>,
    /// λ·p at the trace's peak rate and at its mean rate (erlangs).
    pub peak_load: f64,
    pub mean_load: f64,
    /// The model's idle VM-minutes over the trace's phases (bursts not counted): of the
    /// static pool sized for the peak, and of the ideal pool that follows each phase's Erlang
    /// size at once (`Trace::model_idle_vm_minutes`); their ratio is the best an autoscaler can
    /// do against `static-peak` at this demand factor.
    #[serde(default)]
    pub model_idle_static_peak_vm_minutes: f64,
    #[serde(default)]
    pub model_idle_ideal_vm_minutes: f64,
    pub claims: usize,
    pub claims_ok: usize,
    pub claims_failed: usize,
    pub warm_hits: usize,
    /// Claims that were not warm hits, by the trace hour they arrived in (where the policy
    /// lost them: a step, a burst, the peak).
    #[serde(default)]
    pub misses_by_hour: Vec<usize>,
    pub warm_hit_ratio: f64,
    pub claim_wait_p50_s: f64,
    pub claim_wait_p99_s: f64,
    pub claim_wait_max_s: f64,
    pub attempts_per_claim: f64,
    /// Why claims failed (`deadline`, or the answer), counted.
    pub failures: BTreeMap<String, usize>,
    /// What retried attempts were answered (HTTP status; 0 = no answer), counted.
    pub retried: BTreeMap<u16, usize>,
    /// The real latency of first attempts (ms, not scaled): how loaded the stack was.
    pub first_attempt_ms_p50: f64,
    pub first_attempt_ms_p99: f64,
    pub idle_vm_minutes: f64,
    /// Idle VM-minutes per hour of trace: comparable across traces.
    pub idle_vms_mean: f64,
    pub boots: usize,
    pub extra_boots: i64,
    pub deleted_on_scale_down: usize,
    pub pool_scaled_events: usize,
    pub reversals: usize,
    pub reversals_per_hour: f64,
    /// The refill lag the row reports: the scaled run's for `local`, the real-time segment's
    /// (k = 1) for `deployed` (see `refill_lag_source`).
    pub refill_lag_p50_s: Option<f64>,
    pub refill_lag_p99_s: Option<f64>,
    pub refill_lag_source: String,
    pub refill_lag_scaled_p50_s: Option<f64>,
    pub refill_lag_scaled_p99_s: Option<f64>,
    pub refills_unpaired: usize,
    pub boot_p50_s: Option<f64>,
    pub boot_draws: usize,
    pub provisioning_p50_s: Option<f64>,
    pub provisioning_p99_s: Option<f64>,
    pub max_total_vms: i64,
    pub samples: usize,
    pub rolling_min_warm_ratio: Option<f64>,
    pub recovery_to_95_s: Option<f64>,
    /// The model's measure (`core`'s scale tests): from the step's first claim, the first
    /// second from which every rolling minute until the step's end holds ≥ 95 % warm.
    #[serde(default)]
    pub recovery_held_95_s: Option<f64>,
    pub back_down_s: Option<f64>,
    pub pre_step_warm: Option<f64>,
    /// The model's size after the step (Erlang B at the rate after it, the boot's mean time,
    /// 99 %), and the time from the step's end until the desired size is within
    /// max(1, 10 %) of it (autoscaled rows).
    pub model_size_after_step: Option<i64>,
    pub desired_back_down_s: Option<f64>,
    pub hints_sent: usize,
    pub hints_accepted: usize,
    /// The configuration's real-time segment (k = 1), when it ran: claim → replacement AVAILABLE.
    pub realtime_refill_lag_p50_s: Option<f64>,
    pub realtime_refill_lag_p99_s: Option<f64>,
    /// The real-time segment's lags less each replacement's own boot draw (what issue 22's
    /// "p99 ≤ boot + 3 s" asks about), seconds.
    #[serde(default)]
    pub refill_overhead_p99_s: Option<f64>,
    #[serde(default)]
    pub refill_overhead_max_s: Option<f64>,
    pub duration_h: f64,
    pub wall_s: f64,
    pub violations: Vec<String>,
}

/// The `p` quantile of `v` (nearest rank on (n-1)·p, as the other benchmarks); `None` when empty.
pub fn quantile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let idx = ((s.len() as f64 - 1.0) * p).round() as usize;
    Some(s[idx.min(s.len() - 1)])
}

/// Each claim paired with the first later AVAILABLE not paired yet (both sorted, seconds):
/// the lags, and how many claims found none.
pub fn fifo_lags(claimed: &[f64], available: &[f64]) -> (Vec<f64>, usize) {
    let (mut lags, mut unpaired, mut j) = (vec![], 0, 0);
    for &c in claimed {
        while j < available.len() && available[j] < c {
            j += 1;
        }
        if j < available.len() {
            lags.push(available[j] - c);
            j += 1;
        } else {
            unpaired += 1;
        }
    }
    (lags, unpaired)
}

/// Each claim paired, in order, with the first VM created after it that no earlier claim
/// took (`created`: creation time and VM id, sorted by time; with IMMEDIATE_ON_LEASE the
/// claim's replacement): the time from the claim until that VM was AVAILABLE (`available`,
/// by VM id) less the boot the simulator drew for it (`boots`, ms by VM id), i.e. what the
/// reconciler added to the boot. Paired by creation, not by AVAILABLE order as
/// [`fifo_lags`] is, since boots of different lengths finish out of order. Pairs whose VM
/// has no draw or never became AVAILABLE are left out.
pub fn refill_overheads(
    claimed: &[f64],
    created: &[(f64, String)],
    available: &HashMap<String, f64>,
    boots: &HashMap<String, f64>,
) -> Vec<f64> {
    let (mut out, mut j) = (vec![], 0);
    for &c in claimed {
        while j < created.len() && created[j].0 < c {
            j += 1;
        }
        let Some((_, id)) = created.get(j) else { break };
        if let (Some(t), Some(ms)) = (available.get(id), boots.get(id)) {
            out.push(t - c - ms / 1000.0);
        }
        j += 1;
    }
    out
}

/// Direction changes in a series of POOL_SCALED (from, to).
pub fn reversals(scaled: &[(i64, i64)]) -> usize {
    let mut last = 0i64;
    let mut n = 0;
    for &(from, to) in scaled {
        let dir = (to - from).signum();
        if dir == 0 {
            continue;
        }
        if last != 0 && dir != last {
            n += 1;
        }
        last = dir;
    }
    n
}

/// ∫ f(sample) dt over [from, to] (real seconds), each sample holding until the next.
pub fn integrate(samples: &[Sample], from: f64, to: f64, f: impl Fn(&Sample) -> f64) -> f64 {
    let mut sum = 0.0;
    for (i, s) in samples.iter().enumerate() {
        let next = samples.get(i + 1).map_or(to, |n| n.t);
        let (a, b) = (s.t.max(from), next.min(to));
        if b > a {
            sum += f(s) * (b - a);
        }
    }
    sum
}

/// The rolling one-minute warm-hit ratio every `step` seconds over [from, to] (trace seconds):
/// (t, ratio) where the minute before t had claims.
pub fn rolling_ratio(claims: &[ClaimRecord], from: f64, to: f64, step: f64) -> Vec<(f64, f64)> {
    let mut hits: Vec<(f64, bool)> = claims.iter().map(|c| (c.arrival, is_warm_hit(c))).collect();
    hits.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = vec![];
    let mut t = from;
    while t <= to {
        let lo = hits.partition_point(|h| h.0 <= t - 60.0);
        let hi = hits.partition_point(|h| h.0 <= t);
        if hi > lo {
            let n = (hi - lo) as f64;
            out.push((t, hits[lo..hi].iter().filter(|h| h.1).count() as f64 / n));
        }
        t += step;
    }
    out
}

/// The time from `from` (trace seconds) to the first sample at or after it whose `value` is at
/// most `level` (samples are in real seconds, `k` the time scale); `None`: none before the
/// samples end (or no value).
pub fn first_at_most(
    samples: &[Sample],
    k: f64,
    from: f64,
    level: f64,
    value: impl Fn(&Sample) -> Option<f64>,
) -> Option<f64> {
    samples.iter().find(|x| x.t * k >= from && value(x).is_some_and(|v| v <= level)).map(|x| x.t * k - from)
}

pub fn is_warm_hit(c: &ClaimRecord) -> bool {
    c.done_at.is_some() && c.attempts == 1
}

/// From the step's start: the first point at or above `level` after the first point below it
/// during the step, `[start, end]` (0 if it does not drop below during the step, `None` if it
/// does not come back before the series ends).
pub fn recovery(series: &[(f64, f64)], start: f64, end: f64, level: f64) -> Option<f64> {
    let after: Vec<&(f64, f64)> = series.iter().filter(|(t, _)| *t >= start).collect();
    let Some(dip) = after.iter().position(|(t, r)| *t <= end && *r < level) else {
        return Some(0.0);
    };
    after[dip..].iter().find(|(_, r)| *r >= level).map(|(t, _)| t - start)
}

/// From the first claim at or after `start`: the first second (a 1 s grid) from which every
/// rolling minute up to `end` holds at least `level` warm (0 if none falls below; `None` if
/// the last one is below, or no claim came).
pub fn recovery_held(claims: &[ClaimRecord], start: f64, end: f64, level: f64) -> Option<f64> {
    let first = claims.iter().map(|c| c.arrival).filter(|a| *a >= start).reduce(f64::min)?;
    let mut back = None;
    for (t, r) in rolling_ratio(claims, first, end, 1.0) {
        back = if r >= level { back.or(Some(t - first)) } else { None };
    }
    back
}

/// Boot draws (ms) of `pool`'s VMs in a flintlock-sim log: the `boot_delay_ms` of each
/// "microvm created (PENDING)" line whose VM id is `<pool>-<ulid>`.
pub fn boot_draws(log: &str, pool: &str) -> Vec<f64> {
    boot_draws_by_id(log, pool).into_iter().map(|(_, ms)| ms).collect()
}

/// The same draws with the VM id each was drawn for, in the log's order.
pub fn boot_draws_by_id(log: &str, pool: &str) -> Vec<(String, f64)> {
    let field = |line: &str, key: &str| -> Option<String> {
        let at = line.find(&format!(" {key}="))? + key.len() + 2;
        Some(line[at..].split_whitespace().next()?.trim_matches('"').to_owned())
    };
    log.lines()
        .filter(|l| l.contains("microvm created (PENDING)"))
        .filter_map(|l| {
            let id = field(l, "id")?;
            let ms: f64 = field(l, "boot_delay_ms")?.parse().ok()?;
            // `<pool>-` then a 26-character ULID: exactly this pool, not one whose name it prefixes.
            (id.len() == pool.len() + 27 && id.starts_with(pool) && id.as_bytes()[pool.len()] == b'-')
                .then_some((id, ms))
        })
        .collect()
}

/// The model's idle VM-minutes of the row's trace, in trace time: static at the peak's
/// size, or ideal (each phase's own size).
fn model_idle(plan: &RowPlan, ideal: bool) -> f64 {
    let peak = plan.trace.peak_rate();
    if peak <= 0.0 {
        return 0.0;
    }
    let p = plan.peak_load / peak;
    let peak_size = super::trace::erlang_size(plan.peak_load, super::trace::TARGET_WARM);
    plan.trace.model_idle_vm_minutes(p, |a| {
        if ideal { super::trace::erlang_size(a, super::trace::TARGET_WARM) } else { peak_size }
    })
}

/// What the run knew about the row before it started.
pub struct RowPlan<'a> {
    pub trace: &'a Trace,
    pub policy: &'a str,
    pub configuration: &'a str,
    pub pool: &'a str,
    pub scale: f64,
    pub demand: f64,
    pub seed: u64,
    pub hint_lead_s: f64,
    pub pool_size: i64,
    pub autoscaling: Option<(i64, i64)>,
    pub peak_load: f64,
    pub mean_load: f64,
}

/// Everything measured for the row.
pub struct Measured<'a> {
    pub replayed: &'a Replayed,
    pub samples: &'a [Sample],
    pub events: &'a [Event],
    /// The simulator's log of the row's host, if it was given.
    pub sim_log: Option<&'a str>,
    /// Real seconds from the start to the end of the trace, and to the end of the run.
    pub trace_end: f64,
    pub run_end: f64,
}

pub fn row(plan: &RowPlan<'_>, m: &Measured<'_>) -> Row {
    let k = plan.scale;
    let claims = &m.replayed.claims;
    let ok: Vec<&ClaimRecord> = claims.iter().filter(|c| c.done_at.is_some()).collect();
    let waits: Vec<f64> = ok.iter().map(|c| (c.done_at.unwrap_or(c.first_at) - c.first_at) * k).collect();
    let warm_hits = claims.iter().filter(|c| is_warm_hit(c)).count();
    let first_ms: Vec<f64> = claims.iter().map(|c| c.first_latency * 1000.0).collect();
    let mut violations = vec![];

    let events = m.events;
    let of = |kind: &'static str| events.iter().filter(move |e| e.kind == kind && e.t >= 0.0);
    let mut claimed: Vec<f64> = of("VM_CLAIMED").map(|e| e.t).collect();
    let mut available: Vec<f64> = of("VM_AVAILABLE").map(|e| e.t).collect();
    claimed.sort_by(f64::total_cmp);
    available.sort_by(f64::total_cmp);
    let (lags, unpaired) = fifo_lags(&claimed, &available);
    let lags: Vec<f64> = lags.iter().map(|l| l * k).collect();

    let provisioned_at: HashMap<&str, f64> = m
        .events
        .iter()
        .filter(|e| e.kind == "VM_PROVISIONED")
        .filter_map(|e| Some((e.vm_id.as_deref()?, e.t)))
        .collect();
    let provisioning: Vec<f64> = m
        .events
        .iter()
        .filter(|e| e.kind == "VM_AVAILABLE")
        .filter_map(|e| Some((e.t - provisioned_at.get(e.vm_id.as_deref()?)?) * k))
        .collect();
    let boots = of("VM_PROVISIONED").count();
    let scaled: Vec<(i64, i64)> = of("POOL_SCALED")
        .filter(|e| e.t <= m.trace_end)
        .map(|e| (e.payload["from"].as_i64().unwrap_or(0), e.payload["to"].as_i64().unwrap_or(0)))
        .collect();
    let reversal_count = reversals(&scaled);

    let first = m.samples.iter().find(|s| s.t >= 0.0).copied().unwrap_or_default();
    let last = m.samples.last().copied().unwrap_or_default();
    let extra_boots = boots as i64 - ok.len() as i64 - (last.warm() - first.warm());
    let idle_s = integrate(m.samples, 0.0, m.trace_end, |s| s.available as f64) * k;
    let hours = plan.trace.duration / 3600.0;

    let max_total = m.samples.iter().map(Sample::total).max().unwrap_or(0);
    if let Some((_, max)) = plan.autoscaling {
        let above: Vec<&Sample> = m.samples.iter().filter(|s| s.total() > max).collect();
        if let Some(s) = above.first() {
            violations.push(format!(
                "{} samples above the autoscaling max {max} (first at trace second {:.0}: {} VMs)",
                above.len(),
                s.t * k,
                s.total()
            ));
        }
    }
    for c in claims {
        if let Some(f) = &c.failure
            && f != "deadline"
        {
            violations.push(format!("a claim failed with an answer not worth retrying: {f}"));
            break;
        }
    }
    if let Some(c) = claims.iter().find(|c| c.lease_id.is_some() && c.release_status != Some(204)) {
        violations.push(format!("a release answered {:?} instead of 204", c.release_status));
    }

    let (mut rolling_min, mut recovery_s, mut back_down_s, mut pre_step) = (None, None, None, None);
    let mut recovery_held_s = None;
    let (mut model_after, mut desired_back_down_s) = (None, None);
    if let Some((s, e)) = plan.trace.step {
        let series = rolling_ratio(claims, s - 600.0, e + 1800.0, 5.0);
        rolling_min = series.iter().filter(|(t, _)| *t >= s && *t <= e).map(|(_, r)| *r).reduce(f64::min);
        recovery_s = recovery(&series, s, e, 0.95);
        recovery_held_s = recovery_held(claims, s, e, 0.95);
        let before: Vec<&Sample> = m.samples.iter().filter(|x| x.t * k >= s - 600.0 && x.t * k < s).collect();
        if !before.is_empty() {
            let pre = before.iter().map(|x| x.warm() as f64).sum::<f64>() / before.len() as f64;
            pre_step = Some(pre);
            let near = pre + (pre * 0.1).max(1.0);
            back_down_s = first_at_most(m.samples, k, e, near, |x| Some(x.warm() as f64));
        }
        let boot_mean = plan.peak_load / plan.trace.peak_rate().max(1e-9);
        if let Some(after) = plan.trace.phases.iter().find(|p| p.start <= e && e < p.end) {
            let model = i64::from(super::trace::erlang_size(after.rate * boot_mean, super::trace::TARGET_WARM));
            model_after = Some(model);
            let near = model as f64 + (model as f64 * 0.1).max(1.0);
            desired_back_down_s = first_at_most(m.samples, k, e, near, |x| x.desired.map(|d| d as f64));
        }
    }
    let draws: Vec<f64> = m.sim_log.map(|log| boot_draws(log, plan.pool)).unwrap_or_default();

    Row {
        trace: plan.trace.kind.name().to_owned(),
        policy: plan.policy.to_owned(),
        configuration: plan.configuration.to_owned(),
        scale: k,
        demand: plan.demand,
        seed: plan.seed,
        hint_lead_s: (!plan.trace.hints.is_empty() && plan.policy == "autoscaled-hints").then_some(plan.hint_lead_s),
        pool: plan.pool.to_owned(),
        pool_size: plan.pool_size,
        autoscaling_min: plan.autoscaling.map(|a| a.0),
        autoscaling_max: plan.autoscaling.map(|a| a.1),
        peak_load: plan.peak_load,
        model_idle_static_peak_vm_minutes: model_idle(plan, false),
        model_idle_ideal_vm_minutes: model_idle(plan, true),
        mean_load: plan.mean_load,
        claims: claims.len(),
        claims_ok: ok.len(),
        claims_failed: claims.len() - ok.len(),
        warm_hits,
        misses_by_hour: {
            let mut by_hour = vec![0usize; (plan.trace.duration / 3600.0).ceil().max(1.0) as usize];
            for c in claims.iter().filter(|c| !is_warm_hit(c)) {
                let h = ((c.arrival / 3600.0).floor().max(0.0) as usize).min(by_hour.len() - 1);
                by_hour[h] += 1;
            }
            by_hour
        },
        warm_hit_ratio: if claims.is_empty() { f64::NAN } else { warm_hits as f64 / claims.len() as f64 },
        claim_wait_p50_s: quantile(&waits, 0.5).unwrap_or(f64::NAN),
        claim_wait_p99_s: quantile(&waits, 0.99).unwrap_or(f64::NAN),
        claim_wait_max_s: waits.iter().copied().fold(0.0, f64::max),
        attempts_per_claim: claims.iter().map(|c| f64::from(c.attempts)).sum::<f64>() / claims.len().max(1) as f64,
        failures: claims.iter().filter_map(|c| c.failure.as_deref()).fold(BTreeMap::new(), |mut m, f| {
            let key: String = f.chars().take(60).collect();
            *m.entry(key).or_default() += 1;
            m
        }),
        retried: claims.iter().flat_map(|c| &c.retried).fold(BTreeMap::new(), |mut m, s| {
            *m.entry(*s).or_default() += 1;
            m
        }),
        first_attempt_ms_p50: quantile(&first_ms, 0.5).unwrap_or(f64::NAN),
        first_attempt_ms_p99: quantile(&first_ms, 0.99).unwrap_or(f64::NAN),
        idle_vm_minutes: idle_s / 60.0,
        idle_vms_mean: idle_s / 3600.0 / hours.max(1e-9),
        boots,
        extra_boots,
        deleted_on_scale_down: of("VM_DELETED_ON_SCALE_DOWN").count(),
        pool_scaled_events: scaled.len(),
        reversals: reversal_count,
        reversals_per_hour: reversal_count as f64 / hours.max(1e-9),
        refill_lag_p50_s: quantile(&lags, 0.5),
        refill_lag_p99_s: quantile(&lags, 0.99),
        refill_lag_source: format!("scaled run (k = {k})"),
        refill_lag_scaled_p50_s: quantile(&lags, 0.5),
        refill_lag_scaled_p99_s: quantile(&lags, 0.99),
        refills_unpaired: unpaired,
        boot_p50_s: quantile(&draws, 0.5).map(|ms| ms / 1000.0 * k),
        boot_draws: draws.len(),
        provisioning_p50_s: quantile(&provisioning, 0.5),
        provisioning_p99_s: quantile(&provisioning, 0.99),
        max_total_vms: max_total,
        samples: m.samples.len(),
        rolling_min_warm_ratio: rolling_min,
        recovery_to_95_s: recovery_s,
        recovery_held_95_s: recovery_held_s,
        back_down_s,
        pre_step_warm: pre_step,
        model_size_after_step: model_after,
        desired_back_down_s,
        hints_sent: m.replayed.hints.len(),
        hints_accepted: m.replayed.hints.iter().filter(|h| h.status == 202).count(),
        realtime_refill_lag_p50_s: None,
        realtime_refill_lag_p99_s: None,
        refill_overhead_p99_s: None,
        refill_overhead_max_s: None,
        duration_h: hours,
        wall_s: m.run_end,
        violations,
    }
}

/// Leases handed out twice within one database: a VM in two leases, or a lease given to two
/// different claims. One message per violation.
pub fn double_leases<'a>(claims: impl Iterator<Item = &'a ClaimRecord>) -> Vec<String> {
    let mut vm_leases: HashMap<&str, HashSet<&str>> = HashMap::new();
    let mut lease_claims: HashMap<&str, usize> = HashMap::new();
    for c in claims {
        if let (Some(l), Some(vm)) = (c.lease_id.as_deref(), c.vm_id.as_deref()) {
            vm_leases.entry(vm).or_default().insert(l);
            *lease_claims.entry(l).or_default() += 1;
        }
    }
    let mut out: Vec<String> = vm_leases
        .iter()
        .filter(|(_, ls)| ls.len() > 1)
        .map(|(vm, ls)| format!("VM {vm} was handed out in {} leases", ls.len()))
        .collect();
    out.extend(lease_claims.iter().filter(|(_, n)| **n > 1).map(|(l, n)| format!("lease {l} was given to {n} claims")));
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(arrival: f64, attempts: u32, ok: bool) -> ClaimRecord {
        ClaimRecord { arrival, attempts, done_at: ok.then_some(arrival), ..ClaimRecord::default() }
    }

    #[test]
    fn refill_lags_pair_each_claim_with_the_next_unpaired_available() {
        // An AVAILABLE before the first claim is not a refill; a burst of three is refilled in order.
        let (lags, unpaired) = fifo_lags(&[10.0, 20.0, 20.0, 20.0, 50.0], &[1.0, 15.0, 24.0, 25.0, 27.0]);
        assert_eq!(lags, [5.0, 4.0, 5.0, 7.0]);
        assert_eq!(unpaired, 1);
    }

    #[test]
    fn refill_overheads_take_each_replacements_own_boot_off_its_lag() {
        let created = [(0.5, "a".to_owned()), (10.2, "b".to_owned()), (20.1, "c".to_owned()), (21.0, "d".to_owned())];
        let map = |v: &[(&str, f64)]| v.iter().map(|(k, x)| ((*k).to_owned(), *x)).collect::<HashMap<String, f64>>();
        // b boots long and c short: c is AVAILABLE before b, but each claim's own VM counts.
        let available = map(&[("a", 1.0), ("b", 19.0), ("c", 23.6), ("d", 30.0)]);
        let boots = map(&[("b", 8000.0), ("c", 3000.0), ("d", 9000.0)]);
        let o = refill_overheads(&[10.0, 20.0], &created, &available, &boots);
        assert_eq!(o.len(), 2);
        assert!((o[0] - 1.0).abs() < 1e-9 && (o[1] - 0.6).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn reversals_count_direction_changes_only() {
        assert_eq!(reversals(&[(2, 4), (4, 6), (6, 5), (5, 5), (5, 3), (3, 8)]), 2);
        assert_eq!(reversals(&[]), 0);
    }

    #[test]
    fn integrals_hold_each_sample_until_the_next() {
        let s = |t, available| Sample { t, available, ..Sample::default() };
        let samples = [s(0.0, 2), s(1.0, 4), s(3.0, 0)];
        assert_eq!(integrate(&samples, 0.0, 4.0, |x| x.available as f64), 2.0 + 8.0);
        assert_eq!(integrate(&samples, 0.5, 2.0, |x| x.available as f64), 1.0 + 4.0);
    }

    #[test]
    fn the_rolling_ratio_and_its_recovery() {
        // Warm before 100 s, cold from 100 to 160, warm again after.
        let claims: Vec<ClaimRecord> = (0..60)
            .map(|i| f64::from(i) * 5.0)
            .map(|t| claim(t, if (100.0..160.0).contains(&t) { 3 } else { 1 }, true))
            .collect();
        let series = rolling_ratio(&claims, 0.0, 295.0, 5.0);
        assert_eq!(series[0], (0.0, 1.0));
        let at = |t: f64| series.iter().find(|(x, _)| *x == t).unwrap().1;
        assert_eq!(at(100.0), 11.0 / 12.0, "12 claims in (40, 100], the last one cold");
        assert_eq!(at(215.0), 1.0);
        // Below 95 % from 100 s; back at 1.0 once the cold minute has left the window (215 s).
        assert_eq!(recovery(&series, 90.0, 160.0, 0.95), Some(125.0));
        assert_eq!(recovery(&series, 250.0, 295.0, 0.95), Some(0.0));
        // A dip after the step's end is not the step's.
        assert_eq!(recovery(&series, 0.0, 60.0, 0.95), Some(0.0));
        assert_eq!(recovery(&[(0.0, 1.0), (5.0, 0.5)], 0.0, 10.0, 0.95), None);
        // From the first claim at or after 92 s (95 s); the minute (t − 60, t] holds a cold claim
        // until t = 215 s, so 120 s from it, on a 1 s grid.
        assert_eq!(recovery_held(&claims, 92.0, 295.0, 0.95), Some(120.0));
        // One cold claim after the recovery resets it: held only from when it leaves the minute.
        let mut late = claims.clone();
        late.push(claim(250.0, 2, true));
        assert_eq!(recovery_held(&late, 92.0, 400.0, 0.95), Some(310.0 - 95.0));
        assert_eq!(recovery_held(&claims, 220.0, 295.0, 0.95), Some(0.0));
        assert_eq!(recovery_held(&late, 92.0, 280.0, 0.95), None, "still below at the end");
        assert_eq!(recovery_held(&claims, 300.0, 400.0, 0.95), None, "no claim");
    }

    #[test]
    fn back_down_is_the_first_sample_after_the_end_at_or_below_the_level() {
        let at = |t: f64, desired: Option<i64>, available: i64| Sample { t, desired, available, ..Sample::default() };
        // k = 10: samples at 100..104 real seconds are trace seconds 1000..1040.
        let samples = [
            at(100.0, Some(50), 40),
            at(101.0, Some(50), 9),
            at(102.0, None, 3),
            at(103.0, Some(6), 3),
            at(104.0, Some(5), 2),
        ];
        let desired = |x: &Sample| x.desired.map(|d| d as f64);
        assert_eq!(first_at_most(&samples, 10.0, 1000.0, 6.0, desired), Some(30.0), "no desired size is no value");
        assert_eq!(first_at_most(&samples, 10.0, 1000.0, 5.5, desired), Some(40.0));
        assert_eq!(
            first_at_most(&samples, 10.0, 1015.0, 10.0, |x| Some(x.available as f64)),
            Some(5.0),
            "from the end on"
        );
        assert_eq!(first_at_most(&samples, 10.0, 1000.0, 1.0, desired), None, "never");
    }

    #[test]
    fn boot_draws_are_read_per_pool_from_the_sims_log() {
        let log = "2026-12-01T00:00:00Z  INFO flintlock_sim::service: microvm created (PENDING) uid=01J namespace=poolmgr-x id=md-auto-01jabcdefghjkmnpqrstvwxyz0 boot_delay_ms=250\n\
                   2026-12-01T00:00:00Z  INFO flintlock_sim::service: microvm created (PENDING) uid=01K namespace=poolmgr-x id=md-auto-hints-01jabcdefghjkmnpqrstvwxyz0 boot_delay_ms=300\n\
                   2026-12-01T00:00:01Z  INFO flintlock_sim: microvm CREATED uid=01J";
        assert_eq!(boot_draws(log, "md-auto"), [250.0]);
        assert_eq!(boot_draws(log, "md-auto-hints"), [300.0]);
        assert!(boot_draws(log, "md").is_empty());
    }

    #[test]
    fn a_vm_in_two_leases_is_a_double_lease() {
        let held = |l: &str, vm: &str| ClaimRecord {
            lease_id: Some(l.into()),
            vm_id: Some(vm.into()),
            done_at: Some(1.0),
            ..ClaimRecord::default()
        };
        let claims = [held("l1", "vm-a"), held("l2", "vm-b"), held("l3", "vm-a"), held("l2", "vm-b")];
        assert_eq!(
            double_leases(claims.iter()),
            ["VM vm-a was handed out in 2 leases", "lease l2 was given to 2 claims"]
        );
        assert!(double_leases(claims[..2].iter()).is_empty());
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
