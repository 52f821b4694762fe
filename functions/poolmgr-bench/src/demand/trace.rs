//! The claim traces the demand benchmark replays, in unscaled seconds, and the static sizes
//! Erlang B gives for them. Pure: a trace is a list of arrivals (when, how long the job holds
//! its VM, which matrix burst it belongs to) and hints, drawn from a seeded generator, so every
//! policy and configuration replays exactly the same claims.
//!
//! - `model-day` (24 h, from midnight): 7 h at 0.02 claims/s, 2 h at 2/s (the morning peak),
//!   8 h at 0.5/s, 7 h at 0.02/s, Poisson arrivals; plus matrix bursts (N claims at once, N
//!   uniform in 1..=50) as a Poisson process of [`BURSTS_PER_HOUR`] during working hours
//!   (07:00–17:00). Hints (policy `autoscaled-hints`): each burst of at least
//!   [`HINT_MIN_BURST`] claims is announced a lead before it ([`HINT_LEAD_S`] unless the run
//!   says otherwise).
//! - `step`, `step-hinted`: [`STEP_BEFORE_S`] at 0.02/s, [`STEP_S`] at 2/s, [`STEP_AFTER_S`]
//!   at 0.02/s; the hinted one is the same claims, and announces the step the same lead
//!   before it.
//!
//! Every rate (and the burst rate, not the burst sizes) is multiplied by the demand factor D
//! of the run. Job durations: log-normal, median [`JOB_MEDIAN_S`], σ [`JOB_SIGMA`], at most
//! [`JOB_MAX_S`]. Never touches the network or the clock.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// Job durations: log-normal with this median (seconds) …
pub const JOB_MEDIAN_S: f64 = 300.0;
/// … and this σ (p99 = median · e^(2.326 σ) ≈ 32 min) …
pub const JOB_SIGMA: f64 = 0.8;
/// … cut at two hours.
pub const JOB_MAX_S: f64 = 7200.0;
/// Matrix bursts per hour of working time (07:00–17:00), before the demand factor.
pub const BURSTS_PER_HOUR: f64 = 10.0;
pub const BURST_MAX: u32 = 50;
/// Bursts of at least this many claims are announced (`autoscaled-hints`).
pub const HINT_MIN_BURST: u32 = 10;
/// How long before a burst or the step its hint is sent, by default (`--hint-lead`).
pub const HINT_LEAD_S: f64 = 180.0;
/// A burst's hint covers it and a minute more.
pub const BURST_HINT_AFTER_S: f64 = 60.0;
/// The step's hint announces the claims of its first two minutes.
pub const STEP_HINT_COVERS_S: f64 = 120.0;
/// The step trace: before, during, after.
pub const STEP_BEFORE_S: f64 = 3600.0;
pub const STEP_S: f64 = 1800.0;
pub const STEP_AFTER_S: f64 = 5400.0;
pub const LOW_RATE: f64 = 0.02;
pub const HIGH_RATE: f64 = 2.0;
pub const DAY_RATE: f64 = 0.5;
/// The warm-hit target the static sizes are computed for.
pub const TARGET_WARM: f64 = 0.99;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceKind {
    ModelDay,
    Step,
    StepHinted,
}

impl TraceKind {
    pub const ALL: [TraceKind; 3] = [TraceKind::ModelDay, TraceKind::Step, TraceKind::StepHinted];

    pub fn name(self) -> &'static str {
        match self {
            TraceKind::ModelDay => "model-day",
            TraceKind::Step => "step",
            TraceKind::StepHinted => "step-hinted",
        }
    }

    /// Short, for pool names.
    pub fn short(self) -> &'static str {
        match self {
            TraceKind::ModelDay => "md",
            TraceKind::Step => "st",
            TraceKind::StepHinted => "sh",
        }
    }

    pub fn parse(s: &str) -> Option<TraceKind> {
        TraceKind::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// A phase of constant Poisson rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub start: f64,
    pub end: f64,
    /// Claims per second (after the demand factor).
    pub rate: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Seconds since the trace's start.
    pub t: f64,
    /// How long the job holds its VM.
    pub job: f64,
    /// The matrix burst it arrived in (index), if any.
    pub burst: Option<usize>,
}

/// An announced demand: `POST …/expect {"claims", "within_seconds"}` at `t`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hint {
    pub t: f64,
    pub claims: u32,
    pub within: f64,
}

#[derive(Debug, Clone)]
pub struct Trace {
    pub kind: TraceKind,
    pub duration: f64,
    pub phases: Vec<Phase>,
    pub arrivals: Vec<Arrival>,
    /// Sent by hinting policies only.
    pub hints: Vec<Hint>,
    /// (start, end) of the step, for the step traces.
    pub step: Option<(f64, f64)>,
    /// Sizes of the matrix bursts, in order.
    pub bursts: Vec<u32>,
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn exponential(rng: &mut StdRng, rate: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() / rate
}

pub fn job_mean_s() -> f64 {
    JOB_MEDIAN_S * (JOB_SIGMA * JOB_SIGMA / 2.0).exp()
}

fn job(rng: &mut StdRng) -> f64 {
    (JOB_MEDIAN_S * (JOB_SIGMA * normal(rng)).exp()).min(JOB_MAX_S)
}

/// Poisson arrival times in `phase`.
fn poisson(rng: &mut StdRng, phase: &Phase) -> Vec<f64> {
    let mut out = vec![];
    if phase.rate <= 0.0 {
        return out;
    }
    let mut t = phase.start;
    loop {
        t += exponential(rng, phase.rate);
        if t >= phase.end {
            return out;
        }
        out.push(t);
    }
}

impl Trace {
    /// The trace `kind` at demand factor `demand`, drawn from `seed`, its hints sent `lead`
    /// seconds before what they announce (the claims are the same whatever the lead).
    pub fn generate(kind: TraceKind, demand: f64, seed: u64, lead: f64) -> Trace {
        // One stream per trace's claims: adding a trace to a run does not change the others.
        // The hinted step is the step's claims with a hint: the same stream, so its rows differ
        // from the step's by the hint alone, not by another draw of the claims.
        let claims = if kind == TraceKind::StepHinted { TraceKind::Step } else { kind };
        let mut rng = StdRng::seed_from_u64(seed ^ (claims as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let h = 3600.0;
        let mut arrivals = vec![];
        let mut hints = vec![];
        let mut bursts = vec![];
        let (phases, step) = match kind {
            TraceKind::ModelDay => (
                vec![
                    Phase { start: 0.0, end: 7.0 * h, rate: LOW_RATE * demand },
                    Phase { start: 7.0 * h, end: 9.0 * h, rate: HIGH_RATE * demand },
                    Phase { start: 9.0 * h, end: 17.0 * h, rate: DAY_RATE * demand },
                    Phase { start: 17.0 * h, end: 24.0 * h, rate: LOW_RATE * demand },
                ],
                None,
            ),
            TraceKind::Step | TraceKind::StepHinted => {
                let (s, e) = (STEP_BEFORE_S, STEP_BEFORE_S + STEP_S);
                (
                    vec![
                        Phase { start: 0.0, end: s, rate: LOW_RATE * demand },
                        Phase { start: s, end: e, rate: HIGH_RATE * demand },
                        Phase { start: e, end: e + STEP_AFTER_S, rate: LOW_RATE * demand },
                    ],
                    Some((s, e)),
                )
            }
        };
        for p in &phases {
            for t in poisson(&mut rng, p) {
                arrivals.push(Arrival { t, job: job(&mut rng), burst: None });
            }
        }
        if kind == TraceKind::ModelDay {
            let work = Phase { start: 7.0 * h, end: 17.0 * h, rate: BURSTS_PER_HOUR * demand / h };
            for t in poisson(&mut rng, &work) {
                let n = rng.random_range(1..=BURST_MAX);
                let id = bursts.len();
                bursts.push(n);
                for _ in 0..n {
                    arrivals.push(Arrival { t, job: job(&mut rng), burst: Some(id) });
                }
                if n >= HINT_MIN_BURST {
                    hints.push(Hint { t: (t - lead).max(0.0), claims: n, within: lead + BURST_HINT_AFTER_S });
                }
            }
        }
        if kind == TraceKind::StepHinted {
            let (s, _) = step.expect("a step trace has a step");
            let claims = (HIGH_RATE * demand * STEP_HINT_COVERS_S).ceil().max(1.0) as u32;
            hints.push(Hint { t: s - lead, claims, within: lead + STEP_HINT_COVERS_S });
        }
        arrivals.sort_by(|a, b| a.t.total_cmp(&b.t));
        hints.sort_by(|a, b| a.t.total_cmp(&b.t));
        let duration = phases.last().map_or(0.0, |p| p.end);
        Trace { kind, duration, phases, arrivals, hints, step, bursts }
    }

    /// The highest phase rate (bursts not counted: no steady-state size covers them).
    pub fn peak_rate(&self) -> f64 {
        self.phases.iter().map(|p| p.rate).fold(0.0, f64::max)
    }

    /// The expected claims per second over the whole trace, bursts included.
    pub fn mean_rate(&self, demand: f64) -> f64 {
        let steady: f64 = self.phases.iter().map(|p| p.rate * (p.end - p.start)).sum();
        let bursts = match self.kind {
            TraceKind::ModelDay => BURSTS_PER_HOUR * demand * 10.0 * f64::from(1 + BURST_MAX) / 2.0,
            _ => 0.0,
        };
        (steady + bursts) / self.duration
    }
}

impl Trace {
    /// The model's idle VM-minutes over the trace's phases (bursts not counted) for a pool of
    /// `size(load)` slots in a phase of load `λ·p` (`p`: the mean provisioning time): an Erlang
    /// loss system of n slots carries `a(1 - B(n, a))` of them out on average, the rest are
    /// AVAILABLE. `size` constant at the peak's is the static-peak pool; the phase's own
    /// [`erlang_size`] is the ideal one that follows the demand exactly and at once.
    pub fn model_idle_vm_minutes(&self, p: f64, size: impl Fn(f64) -> u32) -> f64 {
        self.phases
            .iter()
            .map(|ph| {
                let a = ph.rate * p;
                let n = size(a);
                let idle = f64::from(n) - a * (1.0 - erlang_b(n, a));
                idle * (ph.end - ph.start) / 60.0
            })
            .sum()
    }
}

/// Erlang's loss formula B(servers, load), by the stable recursion.
pub fn erlang_b(servers: u32, load: f64) -> f64 {
    let mut b = 1.0;
    for c in 1..=servers {
        b = load * b / (f64::from(c) + load * b);
    }
    b
}

/// The smallest pool whose Erlang-B loss at `load` (claims/s × provisioning s) is at most
/// `1 - warm`: the size for a warm-hit ratio of `warm`. At least 1.
pub fn erlang_size(load: f64, warm: f64) -> u32 {
    let mut c = 1;
    while erlang_b(c, load) > 1.0 - warm && c < 100_000 {
        c += 1;
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The issue's model day at full demand: a static pool sized for the peak (107 VMs) idles
    /// about 2,200 VM-hours a day, one that follows the demand about 180 (8 %).
    #[test]
    fn the_model_days_idle_hours_are_the_issues() {
        let tr = Trace {
            kind: TraceKind::ModelDay,
            duration: 86_400.0,
            phases: vec![
                Phase { start: 0.0, end: 7.0 * 3600.0, rate: 0.02 },
                Phase { start: 7.0 * 3600.0, end: 9.0 * 3600.0, rate: 2.0 },
                Phase { start: 9.0 * 3600.0, end: 17.0 * 3600.0, rate: 0.5 },
                Phase { start: 17.0 * 3600.0, end: 24.0 * 3600.0, rate: 0.02 },
            ],
            arrivals: vec![],
            hints: vec![],
            step: None,
            bursts: vec![],
        };
        let peak = erlang_size(90.0, 0.99);
        assert_eq!(peak, 107);
        let static_h = tr.model_idle_vm_minutes(45.0, |_| peak) / 60.0;
        let ideal_h = tr.model_idle_vm_minutes(45.0, |a| erlang_size(a, 0.99)) / 60.0;
        assert!((2100.0..2300.0).contains(&static_h), "{static_h}");
        assert!((150.0..210.0).contains(&ideal_h), "{ideal_h}");
        assert!((0.07..0.09).contains(&(ideal_h / static_h)), "{}", ideal_h / static_h);
    }

    #[test]
    fn erlang_b_matches_the_tables() {
        assert!((erlang_b(1, 1.0) - 0.5).abs() < 1e-12);
        assert!((erlang_b(2, 1.0) - 0.2).abs() < 1e-12);
        assert!((erlang_b(10, 5.0) - 0.018_385).abs() < 1e-5);
        // 60 erlangs at 1 % loss need 75 servers (B(74) > 1 % ≥ B(75)).
        assert_eq!(erlang_size(60.0, 0.99), 75);
        assert_eq!(erlang_size(0.0, 0.99), 1);
    }

    #[test]
    fn traces_are_reproducible_and_have_their_stated_shape() {
        let a = Trace::generate(TraceKind::ModelDay, 1.0, 7, HINT_LEAD_S);
        let b = Trace::generate(TraceKind::ModelDay, 1.0, 7, HINT_LEAD_S);
        assert_eq!(a.arrivals, b.arrivals, "same seed, same claims");
        // Another lead: the same claims and hints, each hint that much nearer its burst.
        let near = Trace::generate(TraceKind::ModelDay, 1.0, 7, 60.0);
        assert_eq!(near.arrivals, a.arrivals, "the lead changes no claim");
        assert_eq!(near.hints.len(), a.hints.len());
        for (h, far) in near.hints.iter().zip(&a.hints) {
            assert_eq!((h.claims, h.within), (far.claims, 60.0 + BURST_HINT_AFTER_S));
            assert!(far.t < 180.0 || (h.t - far.t - 120.0).abs() < 1e-9, "{h:?} against {far:?}");
        }
        assert_eq!(a.duration, 86_400.0);
        assert!(a.arrivals.windows(2).all(|w| w[0].t <= w[1].t));
        let in_peak = a.arrivals.iter().filter(|x| x.burst.is_none() && (25_200.0..32_400.0).contains(&x.t)).count();
        // 2/s for two hours: 14 400 expected, σ = 120.
        assert!((13_900..14_900).contains(&in_peak), "{in_peak} claims in the peak");
        assert!(a.bursts.iter().all(|n| (1..=BURST_MAX).contains(n)));
        let announced = a.bursts.iter().filter(|&&n| n >= HINT_MIN_BURST).count();
        assert_eq!(a.hints.len(), announced, "every burst of {HINT_MIN_BURST} or more is announced");
        let jobs: Vec<f64> = a.arrivals.iter().map(|x| x.job).collect();
        let mut sorted = jobs.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        assert!((285.0..315.0).contains(&median), "job median {median}");
        assert!(jobs.iter().all(|&j| j > 0.0 && j <= JOB_MAX_S));

        let s = Trace::generate(TraceKind::StepHinted, 0.1, 7, HINT_LEAD_S);
        assert_eq!(s.step, Some((STEP_BEFORE_S, STEP_BEFORE_S + STEP_S)));
        assert_eq!(s.hints.len(), 1);
        assert_eq!(s.hints[0].t, STEP_BEFORE_S - HINT_LEAD_S);
        assert_eq!(s.hints[0].claims, 24);
        assert!((s.peak_rate() - 0.2).abs() < 1e-12);
        let plain = Trace::generate(TraceKind::Step, 0.1, 7, HINT_LEAD_S);
        assert!(plain.hints.is_empty());
        assert_eq!(plain.arrivals, s.arrivals, "the hinted step is the same step, announced");
        assert_ne!(plain.arrivals, Trace::generate(TraceKind::Step, 0.1, 8, HINT_LEAD_S).arrivals);
        let near = Trace::generate(TraceKind::StepHinted, 0.1, 7, 45.0);
        assert_eq!((near.hints[0].t, near.hints[0].within), (STEP_BEFORE_S - 45.0, 45.0 + STEP_HINT_COVERS_S));
        let expected = (0.002 * (STEP_BEFORE_S + STEP_AFTER_S) + 0.2 * STEP_S) / s.duration;
        assert!((s.mean_rate(0.1) - expected).abs() < 1e-12);
    }
}
