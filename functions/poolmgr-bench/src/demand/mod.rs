//! `demand`, `demand-report`: the trace-driven benchmark of issue 22 item 4, driven by
//! `scripts/bench-demand.sh`. Claim traces ([`trace`]) are replayed in scaled time against
//! running poolmgrs (one per configuration: `local`, poolmgr-local with its in-process
//! reconciler; `deployed`, poolmgr-local without one, its reconciler the reconcile function
//! under `lambda-emu schedule`), one pool per (trace, policy, configuration), every row at
//! once; the pools' status is polled throughout and their events read afterwards
//! ([`replay`]); [`metrics`] turns that into one row each, [`report`] into the generated
//! section of `docs/benchmarks.md`. A real-time segment ([`realtime`], k = 1) measures each
//! configuration's refill lag at its own speed. `plan.rs`: the run's arguments, its policies
//! and its rows.
//!
//! Policies: `static-peak` (a static pool Erlang B sizes for 99 % warm hits at the trace's
//! peak load λ·p, p the mean boot time), `static-mean` (the same at the trace's mean rate),
//! `autoscaled` (`autoscaling: {min 1, max, target_warm_ratio 0.99,
//! scale_down_stabilization_seconds}`), `autoscaled-hints` (the same, plus the trace's
//! hints). Every pool is IMMEDIATE_ON_LEASE: a claim's replacement starts at the claim.
//!
//! After the run: no VM handed out in two leases, no lease given to two claims, no pool above
//! its autoscaling max in any sample; `scripts/bench-demand.sh` runs `poolmgr-check --settled`
//! on each database. Measurements only: nothing here asserts a time.

pub mod metrics;
mod plan;
pub mod realtime;
pub mod replay;
pub mod report;
pub mod rollout;
pub mod rollout_report;
pub mod trace;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use metrics::{Measured, RowPlan};
use realtime::RealtimeResult;
use replay::{Api, Clock, Progress, Sample};
use trace::{Trace, TraceKind};

pub use plan::{Args, Policy, pool_spec};
use plan::{Planned, configurations, plan, split_stack, stack_key, trace_scale};

/// What `--summary` holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Summary {
    pub started_at: String,
    pub scale: f64,
    pub step_scale: f64,
    pub stagger_s: f64,
    pub demand: f64,
    pub seed: u64,
    /// `--hint-lead-s` (`None`: a summary from before it, [`trace::HINT_LEAD_S`]).
    #[serde(default)]
    pub hint_lead_s: Option<f64>,
    pub boot: String,
    pub boot_mean_s: f64,
    pub jobs: String,
    /// The autoscaled pools' scale-down stabilization, unscaled (sent as round(S/k), ≥ 1).
    pub stabilization_s: f64,
    pub poll_ms: u64,
    pub retry_floor_ms: u64,
    pub retry_rate: f64,
    pub settings: String,
    pub traces: Vec<Value>,
    pub realtime: Vec<RealtimeResult>,
    pub violations: Vec<String>,
    pub wall_s: f64,
    /// The machine's CPUs busy during the replay (all of them = 100 %).
    pub cpu_busy_percent: Option<f64>,
    /// CPU seconds of each process given (`--cpu-pid`), PostgreSQL's and the benchmark's own,
    /// during the replay.
    pub cpu_seconds: std::collections::BTreeMap<String, f64>,
    pub load_average_before: f64,
    pub load_average_after: f64,
}

fn load_average() -> f64 {
    crate::growth::load_average()
}

/// Waits until every planned pool of `api` is filled (its size, or an autoscaled pool's
/// desired size if smaller), none PROVISIONING.
async fn wait_all_filled(api: &Api, namespace: &str, rows: &[&Planned], timeout: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let pools = api.pools(namespace).await?;
        let missing: Vec<String> = rows
            .iter()
            .filter_map(|r| {
                let p = pools.get(&r.pool)?;
                let s = replay::sample(0.0, p);
                let want = s.desired.map_or(r.size, |d| d.min(r.size));
                (s.available < want || s.provisioning > 0).then(|| format!("{} {}/{want}", r.pool, s.available))
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if t.elapsed() > timeout {
            bail!(
                "pools on {} not filled after {} s: {}; see the poolmgr-local and reconcile logs",
                api.base(),
                timeout.as_secs(),
                missing.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until no pool of `namespace` has a VM leased, being claimed or provisioning.
async fn wait_quiet(api: &Api, namespace: &str, timeout: Duration) {
    let t = Instant::now();
    while t.elapsed() < timeout {
        match api.pools(namespace).await {
            Ok(pools)
                if pools
                    .values()
                    .map(|p| replay::sample(0.0, p))
                    .all(|s| s.leased + s.claiming + s.provisioning == 0) =>
            {
                return;
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|x| x.is_finite()).map_or("–".into(), |x| format!("{x:.digits$}"))
}

/// Runs the benchmark; `Ok(false)` when a check found a violation (the results are written
/// either way). The `rollout` trace runs beside the others, on its own pools and rows
/// ([`rollout`]); the others' rows and results do not change with it.
pub async fn run(args: Args) -> anyhow::Result<bool> {
    if !args.traces.iter().any(|t| t == rollout::TRACE) {
        return run_traces(args).await;
    }
    let setup = rollout_setup(&args)?;
    let mut others = args.clone();
    others.traces.retain(|t| t != rollout::TRACE);
    if others.traces.is_empty() {
        return rollout::run(setup).await;
    }
    let (a, b) = tokio::join!(run_traces(others), rollout::run(setup));
    Ok(a? & b?)
}

/// The `rollout` trace's stacks (each configuration's at `--rollout-scale`) and settings.
fn rollout_setup(args: &Args) -> anyhow::Result<rollout::Setup> {
    let k = args.rollout_scale;
    // Written so that NaN fails too.
    if k.partial_cmp(&1.0).is_none_or(|o| o.is_lt()) {
        bail!("--rollout-scale must be at least 1");
    }
    let results = args.rollout_results.clone().context("--traces rollout needs --rollout-results FILE")?;
    let urls: HashMap<String, &String> = args.stacks.iter().map(|(n, u)| (split_stack(n, args.scale).1, u)).collect();
    let mut stacks = vec![];
    let mut sim_logs = HashMap::new();
    for c in configurations(args) {
        let key = stack_key(&c, k);
        let url =
            urls.get(&key).with_context(|| format!("the rollout trace needs a stack {key} (--stack {key}=URL)"))?;
        let api = Api::new(url, &args.admin_token, &args.client_token)?.with_retry_budget(args.retry_rate);
        if let Some((_, log)) = args.sim_logs.iter().find(|(n, _)| split_stack(n, args.scale).1 == key) {
            sim_logs.insert(c.clone(), PathBuf::from(log));
        }
        stacks.push((c, Arc::new(api)));
    }
    Ok(rollout::Setup {
        stacks,
        sim_logs,
        host: args.host.clone(),
        k,
        stagger_s: args.stagger_s,
        seed: args.seed,
        retry_floor_ms: args.retry_floor_ms,
        poll_ms: args.poll_ms,
        results,
    })
}

async fn run_traces(args: Args) -> anyhow::Result<bool> {
    // Written so that NaN fails too.
    let sane = args.scale >= 1.0
        && args.step_scale >= 1.0
        && args.demand > 0.0
        && args.stagger_s >= 0.0
        && args.hint_lead_s >= 0.0
        && args.hint_lead_s.is_finite();
    if !sane {
        bail!(
            "--scale and --step-scale must be at least 1, --demand above 0, --stagger-s and --hint-lead-s not negative"
        );
    }
    let traces: Vec<Arc<Trace>> = args
        .traces
        .iter()
        .map(|t| {
            TraceKind::parse(t)
                .map(|k| Arc::new(Trace::generate(k, args.demand, args.seed, args.hint_lead_s)))
                .with_context(|| format!("unknown trace {t:?}: model-day, step or step-hinted"))
        })
        .collect::<anyhow::Result<_>>()?;
    let policies: Vec<Policy> = args
        .policies
        .iter()
        .map(|p| Policy::parse(p).with_context(|| format!("unknown policy {p:?}: {:?}", Policy::ALL.map(Policy::name))))
        .collect::<anyhow::Result<_>>()?;
    let apis: HashMap<String, Arc<Api>> = args
        .stacks
        .iter()
        .map(|(n, url)| {
            let (_, key) = split_stack(n, args.scale);
            Ok((
                key,
                Arc::new(Api::new(url, &args.admin_token, &args.client_token)?.with_retry_budget(args.retry_rate)),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let sim_logs: HashMap<String, PathBuf> = args
        .sim_logs
        .iter()
        .map(|(n, v)| {
            let key = if n.ends_with("-realtime") { n.clone() } else { split_stack(n, args.scale).1 };
            (key, PathBuf::from(v))
        })
        .collect();
    let rows = plan(&args, &traces, &policies);
    if rows.is_empty() {
        bail!("no rows: every (trace, policy) pair given is left out by default; add --all-rows");
    }
    if let Some(r) = rows.iter().find(|r| !apis.contains_key(&r.stack)) {
        bail!(
            "row {} / {} needs a stack {} (--stack {}=URL): its trace runs at k = {}",
            r.trace.kind.name(),
            r.policy.name(),
            r.stack,
            r.stack,
            r.k
        );
    }
    let boot_mean_s = args.boot_median_ms / 1000.0 * (args.boot_sigma * args.boot_sigma / 2.0).exp();
    let started_at = chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string();
    let load_before = load_average();

    for tr in &traces {
        let k = trace_scale(&args, tr.kind);
        eprintln!(
            "==> trace {}: {:.1} h, {} claims ({} in {} bursts), {} hints, peak {:.3}/s, mean {:.4}/s; {:.1} min at k = {k}",
            tr.kind.name(),
            tr.duration / 3600.0,
            tr.arrivals.len(),
            tr.arrivals.iter().filter(|a| a.burst.is_some()).count(),
            tr.bursts.len(),
            tr.hints.len(),
            tr.peak_rate(),
            tr.mean_rate(args.demand),
            tr.duration / k / 60.0
        );
    }
    for r in &rows {
        let sizing = match r.autoscaling {
            None => format!("size {}", r.size),
            Some((min, max)) => format!("autoscaling {min}..{max}, starting at {}", r.size),
        };
        eprintln!(
            "==> row {} / {} / {} (k = {}, from +{:.0} s): pool {}/{} ({sizing}; peak load {:.2}, mean load {:.2} erlangs)",
            r.trace.kind.name(),
            r.policy.name(),
            r.configuration,
            r.k,
            r.offset,
            args.namespace,
            r.pool,
            r.peak_load,
            r.mean_load
        );
    }

    // The real-time segments take minutes of real boots: they run beside everything else.
    let realtime_tasks: Vec<_> = args
        .realtime_stacks
        .iter()
        .map(|(name, url)| {
            let api = Api::new(url, &args.admin_token, &args.client_token);
            let spec = pool_spec(&args.namespace, realtime::POOL, &args.host, realtime::SIZE, None);
            let (name, ns) = (name.clone(), args.namespace.clone());
            let (n, gap, hold) = (args.realtime_claims, args.realtime_gap_s, args.realtime_hold_s);
            let log = sim_logs.get(&format!("{name}-realtime")).cloned();
            tokio::spawn(async move {
                match api {
                    Ok(api) => {
                        let seg = realtime::Segment {
                            configuration: name,
                            namespace: ns,
                            spec,
                            claims: n,
                            gap_s: gap,
                            hold_s: hold,
                            sim_log: log,
                        };
                        realtime::run(Arc::new(api), seg).await
                    }
                    Err(e) => RealtimeResult { configuration: name, error: Some(e.to_string()), ..Default::default() },
                }
            })
        })
        .collect();

    for r in &rows {
        apis[&r.stack].put_pool(&r.spec).await?;
    }
    eprintln!("==> {} pools created; waiting for them to fill", rows.len());
    for (name, api) in &apis {
        let mine: Vec<&Planned> = rows.iter().filter(|r| &r.stack == name).collect();
        wait_all_filled(api, &args.namespace, &mine, Duration::from_secs(300)).await?;
    }

    let (start, t0) = (Instant::now(), SystemTime::now());
    let min_retry = Duration::from_millis(args.retry_floor_ms);
    // The pollers' clock: real seconds since the common start (k does not matter to them).
    let clock = Clock { start, k: 1.0, min_retry };
    let row_clock = |r: &Planned| Clock { start: start + Duration::from_secs_f64(r.offset), k: r.k, min_retry };
    let busy_before = crate::load::machine_busy_ms();
    let cpu_mark = || -> Vec<(String, Option<f64>)> {
        let mut v: Vec<(String, Option<f64>)> =
            args.cpu_pids.iter().map(|(n, p)| (n.clone(), crate::load::tree_cpu_ms(p))).collect();
        v.push(("postgres".into(), crate::load::postgres_cpu_ms(args.postmaster_pid.as_deref())));
        v.push(("poolmgr-bench".into(), crate::load::process_cpu_ms("self")));
        v
    };
    let cpu_before = cpu_mark();
    let stop = Arc::new(AtomicBool::new(false));
    let pollers: HashMap<String, _> = apis
        .iter()
        .map(|(name, api)| {
            let task = replay::poll(
                api.clone(),
                args.namespace.clone(),
                Duration::from_millis(args.poll_ms),
                clock,
                stop.clone(),
            );
            (name.clone(), tokio::spawn(task))
        })
        .collect();
    let last_end = rows.iter().map(|r| r.offset + r.trace.duration / r.k).fold(0.0, f64::max);
    eprintln!("==> replaying {} rows from now; the last trace ends in {:.1} min", rows.len(), last_end / 60.0);
    let progress: Vec<Arc<Progress>> = rows.iter().map(|_| Arc::new(Progress::default())).collect();
    let replays: Vec<_> = rows
        .iter()
        .zip(&progress)
        .map(|(r, p)| {
            let hints = r.policy == Policy::AutoscaledHints;
            let api = apis[&r.stack].clone();
            let (ns, pool, tr, p) = (args.namespace.clone(), r.pool.clone(), r.trace.clone(), p.clone());
            let clock = row_clock(r);
            tokio::spawn(async move {
                tokio::time::sleep_until(clock.start.into()).await;
                replay::replay(api, &ns, &pool, tr, hints, clock, p).await
            })
        })
        .collect();
    let reporter = {
        let lines: Vec<(String, Clock, Arc<Progress>)> = rows
            .iter()
            .zip(&progress)
            .map(|(r, p)| (format!("{}/{}", r.configuration, r.pool), row_clock(r), p.clone()))
            .collect();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(30)).await;
                let parts: Vec<String> = lines
                    .iter()
                    .map(|(n, c, p)| {
                        let t = (Instant::now().saturating_duration_since(c.start)).as_secs_f64() * c.k;
                        let (s, w, f) = (
                            p.started.load(Ordering::Relaxed),
                            p.warm.load(Ordering::Relaxed),
                            p.failed.load(Ordering::Relaxed),
                        );
                        let failed = if f > 0 { format!(" {f} failed") } else { String::new() };
                        format!(
                            "{n} @{:02.0}:{:02.0} {w}/{s} warm{failed}",
                            (t / 3600.0).floor(),
                            (t % 3600.0 / 60.0).floor()
                        )
                    })
                    .collect();
                eprintln!("==> {:.0} s: {}", clock.now(), parts.join(", "));
            }
        })
    };
    let mut replayed = vec![];
    for r in replays {
        replayed.push(r.await.context("a replay task panicked")?);
    }
    reporter.abort();
    eprintln!("==> every job released ({:.0} s after the start); waiting for the pools to settle", clock.now());
    for api in apis.values() {
        wait_quiet(api, &args.namespace, Duration::from_secs(60)).await;
    }
    tokio::time::sleep(Duration::from_millis(3 * args.poll_ms)).await;
    let busy = busy_before.zip(crate::load::machine_busy_ms()).map(|(a, b)| b - a);
    let cpu_seconds: std::collections::BTreeMap<String, f64> =
        cpu_before.into_iter().zip(cpu_mark()).filter_map(|((n, a), (_, b))| Some((n, (b? - a?) / 1000.0))).collect();
    stop.store(true, Ordering::SeqCst);
    let run_end = clock.now();
    let mut samples: HashMap<String, HashMap<String, Vec<Sample>>> = HashMap::new();
    for (name, task) in pollers {
        samples.insert(name, task.await.context("a poller panicked")?);
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let cpu_busy_percent = busy.map(|ms| ms / (run_end * 1000.0 * cpus) * 100.0);

    eprintln!("==> reading the events of {} pools", rows.len());
    let logs: HashMap<String, String> =
        sim_logs.iter().filter_map(|(k, p)| Some((k.clone(), std::fs::read_to_string(p).ok()?))).collect();
    let mut out_rows = vec![];
    for (r, rep) in rows.iter().zip(&replayed) {
        let t0_row = t0 + Duration::from_secs_f64(r.offset);
        let events = apis[&r.stack].events(&args.namespace, &r.pool, t0_row).await?;
        // The row's samples on its own clock.
        let s: Vec<Sample> = samples
            .get(&r.stack)
            .and_then(|m| m.get(&r.pool))
            .map(|v| v.iter().map(|x| Sample { t: x.t - r.offset, ..*x }).collect())
            .unwrap_or_default();
        let plan = RowPlan {
            trace: &r.trace,
            policy: r.policy.name(),
            configuration: &r.configuration,
            pool: &r.pool,
            scale: r.k,
            demand: args.demand,
            seed: args.seed,
            hint_lead_s: args.hint_lead_s,
            pool_size: r.size,
            autoscaling: r.autoscaling,
            peak_load: r.peak_load,
            mean_load: r.mean_load,
        };
        let m = Measured {
            replayed: rep,
            samples: &s,
            events: &events,
            sim_log: logs.get(&r.stack).map(String::as_str),
            trace_end: r.trace.duration / r.k,
            run_end: run_end - r.offset,
        };
        out_rows.push(metrics::row(&plan, &m));
    }

    let mut violations = vec![];
    for name in apis.keys() {
        let claims = rows.iter().zip(&replayed).filter(|(r, _)| &r.stack == name).flat_map(|(_, rep)| &rep.claims);
        for v in metrics::double_leases(claims) {
            violations.push(format!("{name}: {v}"));
        }
    }
    for r in &out_rows {
        violations.extend(r.violations.iter().map(|v| format!("{}/{}: {v}", r.configuration, r.pool)));
    }

    let mut realtime_results = vec![];
    for t in realtime_tasks {
        realtime_results.push(t.await.context("a real-time segment panicked")?);
    }
    for rt in &realtime_results {
        for r in out_rows.iter_mut().filter(|r| r.configuration == rt.configuration) {
            r.realtime_refill_lag_p50_s = rt.refill_lag_p50_s;
            r.realtime_refill_lag_p99_s = rt.refill_lag_p99_s;
            r.refill_overhead_p99_s = rt.refill_overhead_p99_s;
            r.refill_overhead_max_s = rt.refill_overhead_max_s;
            if rt.configuration == "deployed" && rt.error.is_none() {
                r.refill_lag_p50_s = rt.refill_lag_p50_s;
                r.refill_lag_p99_s = rt.refill_lag_p99_s;
                r.refill_lag_source = "real-time segment (k = 1)".into();
            }
        }
    }

    let mut text = String::new();
    for r in &out_rows {
        text.push_str(&serde_json::to_string(r)?);
        text.push('\n');
    }
    std::fs::write(&args.results, text).with_context(|| format!("writing {}", args.results.display()))?;
    let summary = Summary {
        started_at,
        scale: args.scale,
        step_scale: args.step_scale,
        stagger_s: args.stagger_s,
        demand: args.demand,
        seed: args.seed,
        hint_lead_s: Some(args.hint_lead_s),
        boot: format!("log-normal, median {:.1} s, σ {}", args.boot_median_ms / 1000.0, args.boot_sigma),
        boot_mean_s,
        jobs: format!(
            "log-normal, median {:.0} s, σ {}, at most {:.0} s (mean {:.0} s)",
            trace::JOB_MEDIAN_S,
            trace::JOB_SIGMA,
            trace::JOB_MAX_S,
            trace::job_mean_s()
        ),
        stabilization_s: args.stabilization_s,
        poll_ms: args.poll_ms,
        retry_floor_ms: args.retry_floor_ms,
        retry_rate: args.retry_rate,
        settings: args.settings.clone(),
        traces: traces
            .iter()
            .map(|t| {
                json!({"trace": t.kind.name(), "duration_h": t.duration / 3600.0, "claims": t.arrivals.len(),
                       "bursts": t.bursts.len(), "burst_claims": t.arrivals.iter().filter(|a| a.burst.is_some()).count(),
                       "hints": t.hints.len(), "peak_rate": t.peak_rate(), "mean_rate": t.mean_rate(args.demand),
                       "phases": t.phases, "step": t.step})
            })
            .collect(),
        realtime: realtime_results,
        violations: violations.clone(),
        wall_s: run_end,
        cpu_busy_percent,
        cpu_seconds,
        load_average_before: load_before,
        load_average_after: load_average(),
    };
    if let Some(p) = &args.summary {
        std::fs::write(p, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }

    println!(
        "{:<12} {:<17} {:<9} {:>6} {:>7} {:>9} {:>9} {:>9} {:>7} {:>7} {:>9} {:>9}",
        "trace",
        "policy",
        "config",
        "size",
        "warm",
        "wait p99",
        "idle min",
        "extra",
        "rev/h",
        "lag p99",
        "boot p50",
        "failed"
    );
    for r in &out_rows {
        let size = match (r.autoscaling_min, r.autoscaling_max) {
            (Some(a), Some(b)) => format!("{a}..{b}"),
            _ => r.pool_size.to_string(),
        };
        println!(
            "{:<12} {:<17} {:<9} {:>6} {:>7.4} {:>8.1}s {:>9.0} {:>9} {:>7.2} {:>6}s {:>8}s {:>9}",
            r.trace,
            r.policy,
            r.configuration,
            size,
            r.warm_hit_ratio,
            r.claim_wait_p99_s,
            r.idle_vm_minutes,
            r.extra_boots,
            r.reversals_per_hour,
            fmt_opt(r.refill_lag_p99_s, 1),
            fmt_opt(r.boot_p50_s, 1),
            r.claims_failed
        );
    }
    for rt in &summary.realtime {
        println!(
            "real-time segment {}: refill lag p50 {} s, p99 {} s over {} claims; less each replacement's boot p99 {} s, max {} s{}",
            rt.configuration,
            fmt_opt(rt.refill_lag_p50_s, 1),
            fmt_opt(rt.refill_lag_p99_s, 1),
            rt.lags_s.len(),
            fmt_opt(rt.refill_overhead_p99_s, 2),
            fmt_opt(rt.refill_overhead_max_s, 2),
            rt.error.as_ref().map(|e| format!(" (failed: {e})")).unwrap_or_default()
        );
    }
    println!(
        "wall {:.0} s, CPU busy {} %, load average {:.1} -> {:.1}; CPU s: {}",
        run_end,
        fmt_opt(cpu_busy_percent, 0),
        load_before,
        summary.load_average_after,
        summary.cpu_seconds.iter().map(|(n, s)| format!("{n} {s:.0}")).collect::<Vec<_>>().join(", ")
    );
    for v in &violations {
        eprintln!("VIOLATION: {v}");
    }
    Ok(violations.is_empty())
}
