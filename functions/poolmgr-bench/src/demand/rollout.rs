//! The `rollout` trace of the demand benchmark (issue 24): a template change replayed in
//! scaled time through the same stacks as the other traces (`local` and `deployed`), one pool
//! per scenario in the namespace [`NAMESPACE`]:
//!
//! - `busy` / `busy-any`: a [`SIZE`]-VM IMMEDIATE_ON_LEASE pool at [`RATE`] claims/s (Poisson,
//!   the run's seed), each job holding its VM [`HOLD_S`]; the template changed after
//!   [`WARMUP_S`] (more than the rollout window, so the last window's claims are all there);
//!   `claim_preference` CURRENT and ANY;
//! - `baseline`: the same claims, no change: the warm hits `warm_hit_delta_pp` is against;
//! - `idle`: no claims, the change at the same time;
//! - `broken`: no claims, a template whose VMs end FAILED (the simulators run with
//!   `--fail-image` [`FAIL_IMAGE`]).
//!
//! Every time of the rollout policy that is real seconds on the server (`window_seconds`,
//! `progress_deadline_seconds`) is sent divided by k; every figure of a row is unscaled.
//! After the run: no VM in two leases, no pool above its ceiling (target + surge, leased VMs
//! not counted under IMMEDIATE_ON_LEASE) in any poll, the rollout events each scenario must
//! have, the status' extra boots equal to the VM_DELETED_FOR_ROLLOUT events. Never asserts a
//! time: the targets are judged in the report.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::metrics::{boot_draws, double_leases, is_warm_hit, quantile};
use super::replay::{self, Api, ClaimRecord, Clock, Event, Progress, Sample};

/// The trace's name in `--traces`.
pub const TRACE: &str = "rollout";
/// Its pools live here, apart from the other traces' (their pollers and waits ignore them).
pub const NAMESPACE: &str = "rollout";
pub const SIZE: i64 = 50;
/// Claims per second of the busy rows (trace time).
pub const RATE: f64 = 0.5;
/// How long each job holds its VM: at 0.5 claims/s about 30 VMs are leased at any time, so
/// the change finds leases to leave alone.
pub const HOLD_S: f64 = 60.0;
/// The rollout policy's window (the server's default) …
pub const WINDOW_S: f64 = 120.0;
/// … and progress deadline (its default too); both sent divided by k.
pub const PROGRESS_DEADLINE_S: f64 = 600.0;
/// The template changes this long after the row's start: more than a window of claims.
pub const WARMUP_S: f64 = 180.0;
/// Claims go on this long after the change.
pub const AFTER_S: f64 = 600.0;
/// A row waits this long after its trace for its rollout to end (trace seconds).
pub const SETTLE_S: f64 = 900.0;
/// `max_surge: 25%` of 50, rounded up as the server does.
pub const SURGE: i64 = 13;
/// The image pattern the simulators fail (`flintlock-sim --fail-image`).
pub const FAIL_IMAGE: &str = "broken";
const IMAGE_OLD: &str = "example.invalid/poolmgr-bench/runner:1";
const IMAGE_NEW: &str = "example.invalid/poolmgr-bench/runner:2";
const IMAGE_BROKEN: &str = "example.invalid/poolmgr-bench/runner-broken:2";
/// Events that end a held lease's VM under it.
const DISRUPTING: [&str; 5] =
    ["VM_DELETED_FOR_ROLLOUT", "VM_DELETED_DUE_TO_EXPIRY", "VM_LOST", "VM_DISCARDED", "VM_DELETED_ON_POOL_DELETE"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    Busy,
    BusyAny,
    Baseline,
    Idle,
    Broken,
}

impl Scenario {
    pub const ALL: [Scenario; 5] =
        [Scenario::Busy, Scenario::BusyAny, Scenario::Baseline, Scenario::Idle, Scenario::Broken];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Busy => "busy",
            Scenario::BusyAny => "busy-any",
            Scenario::Baseline => "baseline",
            Scenario::Idle => "idle",
            Scenario::Broken => "broken",
        }
    }

    fn pool(self) -> String {
        format!("ro-{}", self.name())
    }

    pub fn preference(self) -> &'static str {
        if self == Scenario::BusyAny { "ANY" } else { "CURRENT" }
    }

    fn has_claims(self) -> bool {
        matches!(self, Scenario::Busy | Scenario::BusyAny | Scenario::Baseline)
    }

    /// The image the template changes to, if it changes.
    fn new_image(self) -> Option<&'static str> {
        match self {
            Scenario::Baseline => None,
            Scenario::Broken => Some(IMAGE_BROKEN),
            _ => Some(IMAGE_NEW),
        }
    }
}

/// The pool of a scenario: IMMEDIATE_ON_LEASE, [`SIZE`] VMs, a `rollout` block with its
/// server-side times divided by `k`.
pub fn spec(host: &str, scenario: Scenario, image: &str, k: f64) -> Value {
    let mut s = super::pool_spec(NAMESPACE, &scenario.pool(), host, SIZE, None);
    s["microvm_template"]["root_volume"]["source"]["container_source"] = json!(image);
    s["rollout"] = json!({
        "max_surge": "25%",
        "max_unavailable": 0,
        "claim_preference": scenario.preference(),
        "window_seconds": scaled_seconds(WINDOW_S, k),
        "progress_deadline_seconds": scaled_seconds(PROGRESS_DEADLINE_S, k),
        "failure_threshold": 3,
        "auto_rollback": true,
    });
    s
}

/// Trace seconds as the whole real seconds the server reads, at least 1.
pub fn scaled_seconds(s: f64, k: f64) -> i64 {
    (s / k).round().max(1.0) as i64
}

/// The busy rows' claims: (arrival, hold) in trace seconds, Poisson at [`RATE`] over the
/// warm-up and [`AFTER_S`], drawn from `seed` (every busy row and the baseline replay them).
pub fn arrivals(seed: u64) -> Vec<(f64, f64)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x524f_4c4c_4f55_5400);
    let (mut t, mut out) = (0.0, vec![]);
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() / RATE;
        if t >= WARMUP_S + AFTER_S {
            return out;
        }
        out.push((t, HOLD_S));
    }
}

/// A status poll of a scenario's pool.
#[derive(Debug, Clone, Default)]
pub struct RSample {
    pub s: Sample,
    pub state: Option<String>,
    pub extra_boots: Option<i64>,
}

impl RSample {
    /// What the ceiling counts under IMMEDIATE_ON_LEASE: every VM not leased or leaving.
    pub fn warm_total(&self) -> i64 {
        self.s.available + self.s.claiming + self.s.provisioning + self.s.quarantined
    }
}

fn rsample(t: f64, pool: &Value) -> RSample {
    let r = &pool["status"]["rollout"];
    RSample {
        s: replay::sample(t, pool),
        state: r["state"].as_str().map(str::to_owned),
        extra_boots: r["extra_boots"].as_i64(),
    }
}

/// One row of `--rollout-results`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RolloutRow {
    pub trace: String,
    pub scenario: String,
    /// The pool policy: a static IMMEDIATE_ON_LEASE pool of `pool_size`.
    pub policy: String,
    pub claim_preference: String,
    pub configuration: String,
    pub scale: f64,
    pub seed: u64,
    pub pool: String,
    pub pool_size: i64,
    pub claims_per_second: f64,
    pub hold_s: f64,
    pub warmup_s: f64,
    pub window_s: f64,
    /// The change (trace seconds since the row's start; none for the baseline).
    pub changed_at_s: Option<f64>,
    pub claims: usize,
    pub claims_failed: usize,
    /// Claims that arrived between the change and the rollout's end (completed or halted;
    /// the trace's end when neither), and their first-attempt warm hits …
    pub claims_in_rollout: usize,
    pub warm_hit_ratio: Option<f64>,
    /// … and the baseline's over the same trace seconds; the difference in points.
    pub warm_hit_baseline: Option<f64>,
    pub warm_hit_delta_pp: Option<f64>,
    /// ROLLOUT_STARTED → POOL_ROLLOUT_COMPLETED.
    pub rollout_seconds: Option<f64>,
    /// ROLLOUT_STARTED → ROLLOUT_HALTED.
    pub halted_after_s: Option<f64>,
    /// The state in the last poll.
    pub rollout_state: Option<String>,
    /// Stale VMs retired actively (VM_DELETED_FOR_ROLLOUT): boots beyond the consumed ones.
    pub extra_boots: i64,
    pub extra_boots_ratio: f64,
    /// The status' `rollout.extra_boots` in the last poll.
    pub status_extra_boots: Option<i64>,
    /// Held leases whose VM was deleted under them, or whose release did not answer 204.
    pub leases_disrupted: usize,
    pub boot_p50_s: Option<f64>,
    /// [`boot_chain`]: the boots the rollout waited for one after the other, their sum, and
    /// the rollout's time less it (what the reconciler added). Completed rollouts only.
    pub boot_chain_vms: Option<usize>,
    pub boot_chain_s: Option<f64>,
    pub rollout_less_boots_s: Option<f64>,
    /// The lowest AVAILABLE count polled from the change to the rollout's end.
    pub min_available: Option<i64>,
    /// AVAILABLE when the template changed (the poll before it).
    pub available_at_change: Option<i64>,
    /// New VMs that failed (VM_HOOK_FAILED of a create) after the change.
    pub failed_vms: usize,
    /// Healthy VMs deleted by the rollout (VM_DELETED_FOR_ROLLOUT of a VM that was AVAILABLE).
    pub healthy_vms_retired: usize,
    /// The most VMs the ceiling counts in any poll (AVAILABLE, claiming, provisioning,
    /// quarantined), against `ceiling` = size + surge.
    pub max_pool_vms: i64,
    pub ceiling: i64,
    /// The rollout events of the pool after the change, counted.
    pub events: BTreeMap<String, usize>,
    pub samples: usize,
    pub wall_s: f64,
    pub violations: Vec<String>,
}

/// What a scenario's row recorded.
pub struct RowRun {
    pub claims: Vec<ClaimRecord>,
    /// Real seconds since the row's start.
    pub changed_at: Option<f64>,
    pub end: f64,
}

/// What was measured of a row: its run, polls (row time), events (row time), the simulator's
/// boot draws (ms, real) and, for the busy rows, the baseline's claims.
#[derive(Clone, Copy)]
pub struct Measured<'a> {
    pub run: &'a RowRun,
    pub samples: &'a [RSample],
    pub events: &'a [Event],
    pub draws: &'a [f64],
    pub baseline: Option<&'a [ClaimRecord]>,
}

/// A row's figures and checks.
pub fn row(scenario: Scenario, configuration: &str, k: f64, seed: u64, m: &Measured<'_>) -> RolloutRow {
    let Measured { run, samples, events, draws, baseline } = *m;
    let change = run.changed_at;
    // The baseline's figures are over the same trace seconds as the others'.
    let span_from = change.unwrap_or(WARMUP_S / k);
    let after = |e: &&Event| e.t >= span_from - 0.5;
    let first = |kind: &str| events.iter().filter(after).find(|e| e.kind == kind).map(|e| e.t);
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for e in events.iter().filter(after) {
        if e.kind.starts_with("ROLLOUT_") || e.kind == "POOL_ROLLOUT_COMPLETED" || e.kind == "VM_DELETED_FOR_ROLLOUT" {
            *counts.entry(e.kind.clone()).or_default() += 1;
        }
    }
    let started = first("ROLLOUT_STARTED");
    let completed = first("POOL_ROLLOUT_COMPLETED");
    let halted = first("ROLLOUT_HALTED");
    let span_end = completed.or(halted).unwrap_or(run.end);
    let chain = started.zip(completed).and_then(|(s, c)| boot_chain(events, s, c));

    let in_span = |c: &&ClaimRecord| c.arrival >= span_from * k && c.arrival <= span_end * k;
    let ratio = |claims: &[ClaimRecord]| {
        let v: Vec<&ClaimRecord> = claims.iter().filter(in_span).collect();
        (!v.is_empty()).then(|| v.iter().filter(|c| is_warm_hit(c)).count() as f64 / v.len() as f64)
    };
    let with = ratio(&run.claims);
    let without = baseline.and_then(ratio);

    let available_vm: HashSet<&str> =
        events.iter().filter(|e| e.kind == "VM_AVAILABLE").filter_map(|e| e.vm_id.as_deref()).collect();
    let retired: Vec<&Event> = events.iter().filter(after).filter(|e| e.kind == "VM_DELETED_FOR_ROLLOUT").collect();
    let claimed: HashSet<&str> = run.claims.iter().filter_map(|c| c.vm_id.as_deref()).collect();
    let mut disrupted: HashSet<String> = events
        .iter()
        .filter(|e| DISRUPTING.contains(&e.kind.as_str()))
        .filter_map(|e| e.vm_id.as_deref())
        .filter(|vm| claimed.contains(vm))
        .map(str::to_owned)
        .collect();
    for c in &run.claims {
        if let Some(l) = &c.lease_id
            && c.release_status != Some(204)
        {
            disrupted.insert(format!("lease {l}"));
        }
    }
    let polls_in = |from: f64, to: f64| samples.iter().filter(move |s| s.s.t >= from && s.s.t <= to);
    let min_available = change.and_then(|c| polls_in(c, span_end).map(|s| s.s.available).min());
    let available_at_change = change.and_then(|c| samples.iter().rfind(|s| s.s.t < c).map(|s| s.s.available));
    let failed_vms = events
        .iter()
        .filter(after)
        .filter(|e| e.kind == "VM_HOOK_FAILED" && e.payload["hook"].as_str() == Some("create"))
        .count();
    let max_pool_vms = samples.iter().filter(|s| s.s.t >= 0.0).map(RSample::warm_total).max().unwrap_or(0);
    let ceiling = SIZE + SURGE;
    let last = samples.last();
    let extra_boots = retired.len() as i64;

    let mut violations = vec![];
    if max_pool_vms > ceiling {
        let n = samples.iter().filter(|s| s.warm_total() > ceiling).count();
        violations.push(format!("{n} polls above the ceiling {ceiling} (at most {max_pool_vms} VMs)"));
    }
    if let Some(d) = double_leases(run.claims.iter()).first() {
        violations.push(d.clone());
    }
    let n = |kind: &str| counts.get(kind).copied().unwrap_or(0);
    match scenario {
        Scenario::Baseline => {
            if n("ROLLOUT_STARTED") > 0 {
                violations.push("a rollout started without a change".into());
            }
        }
        Scenario::Broken => {
            for kind in ["ROLLOUT_STARTED", "ROLLOUT_HALTED", "ROLLOUT_ROLLED_BACK"] {
                if n(kind) == 0 {
                    violations.push(format!("no {kind} event"));
                }
            }
        }
        _ => {
            if n("ROLLOUT_STARTED") != 1 || n("POOL_ROLLOUT_COMPLETED") != 1 {
                violations.push(format!(
                    "{} ROLLOUT_STARTED and {} POOL_ROLLOUT_COMPLETED events (one each expected)",
                    n("ROLLOUT_STARTED"),
                    n("POOL_ROLLOUT_COMPLETED")
                ));
            }
            if n("ROLLOUT_HALTED") > 0 {
                violations.push("the rollout halted".into());
            }
            let status = last.and_then(|s| s.extra_boots);
            if status != Some(extra_boots) {
                violations.push(format!(
                    "the status counts {status:?} extra boots, the events {extra_boots} VM_DELETED_FOR_ROLLOUT"
                ));
            }
        }
    }
    if let Some(c) = run.claims.iter().find(|c| c.failure.as_deref().is_some_and(|f| f != "deadline")) {
        violations.push(format!("a claim failed with an answer not worth retrying: {:?}", c.failure));
    }

    RolloutRow {
        trace: TRACE.into(),
        scenario: scenario.name().into(),
        policy: "static".into(),
        claim_preference: scenario.preference().into(),
        configuration: configuration.into(),
        scale: k,
        seed,
        pool: scenario.pool(),
        pool_size: SIZE,
        claims_per_second: if scenario.has_claims() { RATE } else { 0.0 },
        hold_s: HOLD_S,
        warmup_s: WARMUP_S,
        window_s: WINDOW_S,
        changed_at_s: change.map(|c| c * k),
        claims: run.claims.len(),
        claims_failed: run.claims.iter().filter(|c| c.done_at.is_none()).count(),
        claims_in_rollout: run.claims.iter().filter(in_span).count(),
        warm_hit_ratio: with,
        warm_hit_baseline: without,
        warm_hit_delta_pp: with.zip(without).map(|(a, b)| (a - b) * 100.0),
        rollout_seconds: started.zip(completed).map(|(s, c)| (c - s) * k),
        halted_after_s: started.zip(halted).map(|(s, h)| (h - s) * k),
        rollout_state: last.and_then(|s| s.state.clone()),
        extra_boots,
        extra_boots_ratio: extra_boots as f64 / SIZE as f64,
        status_extra_boots: last.and_then(|s| s.extra_boots),
        leases_disrupted: disrupted.len(),
        boot_p50_s: quantile(draws, 0.5).map(|ms| ms / 1000.0 * k),
        boot_chain_vms: chain.map(|c| c.0),
        boot_chain_s: chain.map(|c| c.1 * k),
        rollout_less_boots_s: started.zip(completed).zip(chain).map(|((s, c), (_, b))| (c - s - b) * k),
        min_available,
        available_at_change,
        failed_vms,
        healthy_vms_retired: retired
            .iter()
            .filter(|e| e.vm_id.as_deref().is_some_and(|v| available_vm.contains(v)))
            .count(),
        max_pool_vms,
        ceiling,
        events: counts,
        samples: samples.len(),
        wall_s: run.end,
        violations,
    }
}

/// The chain of boots a rollout had to wait for one after the other (issue 24's "rolled within
/// a minute plus its boots"), from the events (row time): the new VM that became AVAILABLE
/// last, the new VM whose AVAILABLE came last at or before its creation (whose surge slot it
/// may have taken), and so on back to a VM created before any new one was AVAILABLE. Returns
/// (the chain's VMs, the sum of their boots, VM_PROVISIONED → VM_AVAILABLE, in row seconds);
/// the rollout's time less that sum is what the reconciler added: its steps between one boot
/// and the next, at the start and at the end.
pub fn boot_chain(events: &[Event], from: f64, until: f64) -> Option<(usize, f64)> {
    let created: HashMap<&str, f64> = events
        .iter()
        .filter(|e| e.kind == "VM_PROVISIONED" && e.t >= from && e.t <= until)
        .filter_map(|e| Some((e.vm_id.as_deref()?, e.t)))
        .collect();
    // (available, created) of every new VM that became AVAILABLE, by availability.
    let mut booted: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e.kind == "VM_AVAILABLE" && e.t <= until)
        .filter_map(|e| Some((e.t, *created.get(e.vm_id.as_deref()?)?)))
        .collect();
    booted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut available, mut made) = *booted.last()?;
    let (mut n, mut sum) = (0, 0.0);
    loop {
        n += 1;
        sum += available - made;
        match booted.iter().rev().find(|(a, _)| *a <= made) {
            Some(&(a, c)) => (available, made) = (a, c),
            None => return Some((n, sum)),
        }
    }
}

/// What [`run`] needs of the demand run's arguments.
pub struct Setup {
    /// (configuration, its stack at the rollout's k), in order.
    pub stacks: Vec<(String, Arc<Api>)>,
    /// Each configuration's simulator log, if given.
    pub sim_logs: HashMap<String, PathBuf>,
    pub host: String,
    pub k: f64,
    pub stagger_s: f64,
    pub seed: u64,
    pub retry_floor_ms: u64,
    pub poll_ms: u64,
    pub results: PathBuf,
}

/// Polls [`NAMESPACE`] on `api` every `every` until `stop`; samples by pool, real seconds
/// since `start`.
async fn poll(api: Arc<Api>, every: Duration, start: Instant, stop: Arc<AtomicBool>) -> HashMap<String, Vec<RSample>> {
    let samples: Arc<Mutex<HashMap<String, Vec<RSample>>>> = Arc::default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let t = start.elapsed().as_secs_f64();
        if let Ok(pools) = api.pools(NAMESPACE).await {
            let mut s = samples.lock().unwrap();
            for (name, p) in pools {
                s.entry(name).or_default().push(rsample(t, &p));
            }
        }
    }
    std::mem::take(&mut *samples.lock().unwrap())
}

/// The rollout state of `pool` now, if the stack answers.
async fn state(api: &Api, pool: &str) -> Option<String> {
    let pools = api.pools(NAMESPACE).await.ok()?;
    pools.get(pool)?["status"]["rollout"]["state"].as_str().map(str::to_owned)
}

/// One scenario on one stack, from `clock.start`: the claims, the change, then a wait for
/// the rollout to end.
async fn run_row(api: Arc<Api>, scenario: Scenario, host: String, claims: Vec<(f64, f64)>, clock: Clock) -> RowRun {
    tokio::time::sleep_until(clock.start.into()).await;
    let pool = scenario.pool();
    let progress = Arc::new(Progress::default());
    let mut tasks = vec![];
    let mut changed_at = None;
    let mut pending = scenario.new_image();
    let claims = if scenario.has_claims() { claims } else { vec![] };
    for (t, hold) in claims {
        if let Some(image) = pending.filter(|_| t >= WARMUP_S) {
            changed_at = Some(change(&api, &host, scenario, image, clock).await);
            pending = None;
        }
        tokio::time::sleep_until(clock.at(t).into()).await;
        let c = replay::one_claim(api.clone(), NAMESPACE.into(), pool.clone(), t, hold, clock, progress.clone());
        tasks.push(tokio::spawn(c));
    }
    if let Some(image) = pending {
        changed_at = Some(change(&api, &host, scenario, image, clock).await);
    }
    let mut out = vec![];
    for t in tasks {
        if let Ok(c) = t.await {
            out.push(c);
        }
    }
    tokio::time::sleep_until(clock.at(WARMUP_S + AFTER_S).into()).await;
    if scenario.new_image().is_some() {
        let until = clock.at(WARMUP_S + AFTER_S + SETTLE_S);
        while Instant::now() < until {
            let s = state(&api, &pool).await;
            let done = match scenario {
                Scenario::Broken => s.as_deref().is_some_and(|s| s != "PROGRESSING"),
                _ => s.as_deref() == Some("COMPLETE"),
            };
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    RowRun { claims: out, changed_at, end: clock.now() }
}

/// The template change at trace second [`WARMUP_S`]; the real second it was sent.
async fn change(api: &Api, host: &str, scenario: Scenario, image: &str, clock: Clock) -> f64 {
    tokio::time::sleep_until(clock.at(WARMUP_S).into()).await;
    let at = clock.now();
    if let Err(e) = api.put_pool(&spec(host, scenario, image, clock.k)).await {
        eprintln!("==> rollout/{}: the template change failed: {e:#}", scenario.name());
    }
    at
}

/// Runs every scenario on every stack; writes the rows to `setup.results`. `Ok(false)` when
/// a check found a violation.
pub async fn run(setup: Setup) -> anyhow::Result<bool> {
    let k = setup.k;
    let claims = arrivals(setup.seed);
    eprintln!(
        "==> trace rollout: {} claims at {RATE}/s held {HOLD_S:.0} s, the template changed at {WARMUP_S:.0} s, \
         claims for {AFTER_S:.0} s more; {:.1} min at k = {k} (window_seconds {} and progress_deadline_seconds {} sent)",
        claims.len(),
        (WARMUP_S + AFTER_S) / k / 60.0,
        scaled_seconds(WINDOW_S, k),
        scaled_seconds(PROGRESS_DEADLINE_S, k)
    );
    for (_, api) in &setup.stacks {
        for sc in Scenario::ALL {
            api.put_pool(&spec(&setup.host, sc, IMAGE_OLD, k)).await?;
        }
    }
    eprintln!("==> rollout: {} pools created; waiting for them to fill", setup.stacks.len() * Scenario::ALL.len());
    for (c, api) in &setup.stacks {
        for sc in Scenario::ALL {
            let ok = super::realtime::wait_filled(api, NAMESPACE, &sc.pool(), SIZE, Duration::from_secs(300)).await;
            if !ok {
                bail!(
                    "rollout pool {} on {c} not filled after 300 s; see the poolmgr-local and reconcile logs",
                    sc.pool()
                );
            }
        }
    }
    let (start, t0) = (Instant::now(), SystemTime::now());
    let min_retry = Duration::from_millis(setup.retry_floor_ms);
    let stop = Arc::new(AtomicBool::new(false));
    let pollers: Vec<_> = setup
        .stacks
        .iter()
        .map(|(_, api)| tokio::spawn(poll(api.clone(), Duration::from_millis(setup.poll_ms), start, stop.clone())))
        .collect();
    let mut tasks = vec![];
    for (i, (c, api)) in setup.stacks.iter().enumerate() {
        let offset = i as f64 * setup.stagger_s;
        let clock = Clock { start: start + Duration::from_secs_f64(offset), k, min_retry };
        for sc in Scenario::ALL {
            let task = tokio::spawn(run_row(api.clone(), sc, setup.host.clone(), claims.clone(), clock));
            tasks.push((c.clone(), offset, sc, task));
        }
    }
    let mut runs = vec![];
    for (c, offset, sc, task) in tasks {
        let r = task.await.context("a rollout row panicked")?;
        eprintln!("==> rollout/{}/{c}: done {:.0} s after its start ({} claims)", sc.name(), r.end, r.claims.len());
        runs.push((c, offset, sc, r));
    }
    tokio::time::sleep(Duration::from_millis(3 * setup.poll_ms)).await;
    stop.store(true, Ordering::SeqCst);
    let mut samples = vec![];
    for p in pollers {
        samples.push(p.await.context("a poller panicked")?);
    }
    let mut rows = vec![];
    for (c, offset, sc, r) in &runs {
        let i = setup.stacks.iter().position(|(n, _)| n == c).unwrap_or(0);
        let api = &setup.stacks[i].1;
        let events = api.events(NAMESPACE, &sc.pool(), t0 + Duration::from_secs_f64(*offset)).await?;
        let s: Vec<RSample> = samples[i]
            .get(&sc.pool())
            .map(|v| v.iter().map(|x| RSample { s: Sample { t: x.s.t - offset, ..x.s }, ..x.clone() }).collect())
            .unwrap_or_default();
        let log = setup.sim_logs.get(c).and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default();
        let draws = boot_draws(&log, &sc.pool());
        let baseline = runs
            .iter()
            .find(|(bc, _, bs, _)| bc == c && *bs == Scenario::Baseline)
            .map(|(_, _, _, b)| b.claims.as_slice())
            .filter(|_| sc.has_claims());
        let m = Measured { run: r, samples: &s, events: &events, draws: &draws, baseline };
        rows.push(row(*sc, c, k, setup.seed, &m));
    }
    let mut violations = vec![];
    for (i, (c, _)) in setup.stacks.iter().enumerate() {
        let all = runs.iter().filter(|(rc, ..)| rc == c).flat_map(|(.., r)| &r.claims);
        violations.extend(double_leases(all).into_iter().map(|v| format!("{c}: {v}")));
        let _ = i;
    }
    for r in &rows {
        violations.extend(r.violations.iter().map(|v| format!("rollout/{}/{}: {v}", r.scenario, r.configuration)));
    }
    let mut text = String::new();
    for r in &rows {
        text.push_str(&serde_json::to_string(r)?);
        text.push('\n');
    }
    std::fs::write(&setup.results, text).with_context(|| format!("writing {}", setup.results.display()))?;
    println!(
        "{:<9} {:<9} {:<8} {:>9} {:>7} {:>6} {:>8} {:>9} {:>8} {:>7} {:>6} {:>7} {:>9}",
        "scenario",
        "config",
        "pref",
        "rollout",
        "extra",
        "disr",
        "warm Δpp",
        "boot p50",
        "min avl",
        "failed",
        "max",
        "retired",
        "state"
    );
    let o = |v: Option<f64>, d: usize| v.map_or("–".into(), |x| format!("{x:.d$}"));
    for r in &rows {
        println!(
            "{:<9} {:<9} {:<8} {:>8}s {:>7} {:>6} {:>8} {:>8}s {:>8} {:>7} {:>6} {:>7} {:>9}",
            r.scenario,
            r.configuration,
            r.claim_preference,
            o(r.rollout_seconds.or(r.halted_after_s), 1),
            r.extra_boots,
            r.leases_disrupted,
            o(r.warm_hit_delta_pp, 2),
            o(r.boot_p50_s, 1),
            r.min_available.map_or("–".into(), |v| v.to_string()),
            r.failed_vms,
            r.max_pool_vms,
            r.healthy_vms_retired,
            r.rollout_state.as_deref().unwrap_or("–")
        );
    }
    for v in &violations {
        eprintln!("VIOLATION: {v}");
    }
    Ok(violations.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: &str, vm: Option<&str>, t: f64) -> Event {
        Event { kind: kind.into(), vm_id: vm.map(str::to_owned), t, payload: json!({"hook": "create"}) }
    }

    fn poll(t: f64, available: i64, provisioning: i64, extra: i64) -> RSample {
        RSample {
            s: Sample { t, available, provisioning, ..Sample::default() },
            state: Some("COMPLETE".into()),
            extra_boots: Some(extra),
        }
    }

    #[test]
    fn a_rows_figures_come_from_its_events_polls_and_claims() {
        let k = 10.0;
        let held = |arrival: f64, vm: &str, attempts: u32| ClaimRecord {
            arrival,
            attempts,
            done_at: Some(arrival / k),
            lease_id: Some(format!("l-{vm}")),
            vm_id: Some(vm.into()),
            release_status: Some(204),
            ..ClaimRecord::default()
        };
        // The change at 18 real s (180 trace s); started at once, completed 9 s later.
        let run = RowRun {
            claims: vec![held(100.0, "a", 1), held(190.0, "b", 2), held(200.0, "c", 1), held(400.0, "d", 1)],
            changed_at: Some(18.0),
            end: 80.0,
        };
        let events = [
            ev("VM_AVAILABLE", Some("s1"), -5.0),
            ev("ROLLOUT_STARTED", None, 18.1),
            ev("VM_DELETED_FOR_ROLLOUT", Some("s1"), 20.0),
            ev("VM_DELETED_FOR_ROLLOUT", Some("c"), 21.0),
            ev("POOL_ROLLOUT_COMPLETED", None, 27.1),
        ];
        let polls = [poll(17.0, 50, 0, 0), poll(20.0, 48, 13, 1), poll(30.0, 50, 0, 2)];
        let baseline = [held(190.0, "x", 1), held(200.0, "y", 1)];
        let m = Measured {
            run: &run,
            samples: &polls,
            events: &events,
            draws: &[3000.0, 2000.0, 4000.0],
            baseline: Some(&baseline),
        };
        let r = row(Scenario::Busy, "local", k, 1, &m);
        assert!((r.rollout_seconds.unwrap() - 90.0).abs() < 1e-9);
        assert_eq!((r.extra_boots, r.healthy_vms_retired, r.leases_disrupted), (2, 1, 1));
        // Claims from 180 to 271 trace s: b (a miss) and c; the baseline's two are hits.
        assert_eq!(r.claims_in_rollout, 2);
        assert_eq!(r.warm_hit_delta_pp, Some(-50.0));
        assert_eq!((r.min_available, r.available_at_change, r.max_pool_vms), (Some(48), Some(50), 61));
        assert_eq!(r.boot_p50_s, Some(30.0));
        assert!(r.violations.is_empty(), "{:?}", r.violations);

        let over = [poll(20.0, 50, 14, 2)];
        let m = Measured { run: &run, samples: &over, events: &events[..4], draws: &[], baseline: None };
        let r = row(Scenario::Idle, "local", k, 1, &m);
        assert_eq!(r.violations.len(), 2, "{:?}", r.violations);
        assert!(r.violations[0].contains("ceiling 63"));
        assert!(r.violations[1].contains("0 POOL_ROLLOUT_COMPLETED"));
    }

    #[test]
    fn the_boot_chain_follows_each_vm_back_to_the_availability_that_came_before_its_creation() {
        // Surge of 2, started at 0: a and b (a canary pair), c created when a was AVAILABLE,
        // d when b was, e when c was; e is the last. The chain is e ← c ← a: boots 3 + 4 + 2.
        let events = [
            ev("VM_PROVISIONED", Some("old"), -10.0),
            ev("VM_PROVISIONED", Some("a"), 0.5),
            ev("VM_PROVISIONED", Some("b"), 0.5),
            ev("VM_AVAILABLE", Some("a"), 3.5),
            ev("VM_PROVISIONED", Some("c"), 4.0),
            ev("VM_AVAILABLE", Some("b"), 5.0),
            ev("VM_PROVISIONED", Some("d"), 5.5),
            ev("VM_AVAILABLE", Some("old"), 6.0),
            ev("VM_AVAILABLE", Some("d"), 7.0),
            ev("VM_AVAILABLE", Some("c"), 8.0),
            ev("VM_PROVISIONED", Some("e"), 8.5),
            ev("VM_AVAILABLE", Some("e"), 10.5),
        ];
        let (n, sum) = boot_chain(&events, 0.0, 11.0).unwrap();
        assert_eq!(n, 3);
        assert!((sum - 9.0).abs() < 1e-9, "{sum}");
        // Nothing new became AVAILABLE: no chain.
        assert_eq!(boot_chain(&events[..3], 0.0, 11.0), None);
        // In a row: the rollout took 11 s, 9 of them boots.
        let run = RowRun { claims: vec![], changed_at: Some(0.0), end: 20.0 };
        let mut all = vec![ev("ROLLOUT_STARTED", None, 0.0)];
        all.extend(events);
        all.push(ev("POOL_ROLLOUT_COMPLETED", None, 11.0));
        let m = Measured { run: &run, samples: &[], events: &all, draws: &[], baseline: None };
        let r = row(Scenario::Idle, "local", 10.0, 1, &m);
        assert_eq!(r.boot_chain_vms, Some(3));
        assert!((r.boot_chain_s.unwrap() - 90.0).abs() < 1e-9);
        assert!((r.rollout_less_boots_s.unwrap() - 20.0).abs() < 1e-9);
    }

    #[test]
    fn the_broken_row_needs_its_halt_and_its_rollback_and_the_baseline_no_rollout() {
        let run = RowRun { claims: vec![], changed_at: Some(18.0), end: 40.0 };
        let events = [
            ev("ROLLOUT_STARTED", None, 18.1),
            ev("VM_HOOK_FAILED", Some("n1"), 19.0),
            ev("VM_HOOK_FAILED", Some("n2"), 19.0),
            ev("VM_HOOK_FAILED", Some("n3"), 19.1),
            ev("ROLLOUT_HALTED", None, 19.5),
        ];
        let m = Measured { run: &run, samples: &[], events: &events, draws: &[], baseline: None };
        let r = row(Scenario::Broken, "deployed", 10.0, 1, &m);
        assert_eq!(r.failed_vms, 3);
        assert!((r.halted_after_s.unwrap() - 14.0).abs() < 1e-9);
        assert_eq!(r.violations, ["no ROLLOUT_ROLLED_BACK event"]);
        let none = RowRun { claims: vec![], changed_at: None, end: 40.0 };
        let quiet = Measured { run: &none, samples: &[], events: &[], draws: &[], baseline: None };
        assert!(row(Scenario::Baseline, "local", 10.0, 1, &quiet).violations.is_empty());
        let r = row(Scenario::Baseline, "local", 10.0, 1, &Measured { events: &events, ..quiet });
        assert_eq!(r.violations, ["a rollout started without a change"]);
    }

    #[test]
    fn the_claims_are_the_seeds_and_the_server_times_are_scaled() {
        let a = arrivals(1);
        assert_eq!(a, arrivals(1));
        assert_ne!(a, arrivals(2));
        // 0.5/s over 780 s: 390 expected, σ ≈ 20.
        assert!((320..460).contains(&a.len()), "{}", a.len());
        let s = spec("sim", Scenario::BusyAny, IMAGE_NEW, 10.0);
        assert_eq!(s["rollout"]["window_seconds"], 12);
        assert_eq!(s["rollout"]["progress_deadline_seconds"], 60);
        assert_eq!(s["rollout"]["claim_preference"], "ANY");
        assert_eq!(s["namespace"], NAMESPACE);
        assert_eq!(scaled_seconds(120.0, 480.0), 1);
        assert!(
            IMAGE_BROKEN.contains(FAIL_IMAGE) && !IMAGE_NEW.contains(FAIL_IMAGE) && !IMAGE_OLD.contains(FAIL_IMAGE)
        );
    }
}
