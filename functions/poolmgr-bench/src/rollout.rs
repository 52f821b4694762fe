//! The rollout scenarios of issue 24, in real time, in process: one flintlock-sim (fixed boot
//! time), the real reconciler on the local shape's ticker (a pass every 2 s), clients that
//! claim through the service at a fixed rate, hold each VM for a job and release it, and retry
//! a refused claim after a second as `poolmgr-client` does. Each scenario prints one JSON line
//! (`--out` appends them to a file):
//!
//! - `busy`: a 50-VM pool at 0.5 claims/s, the template changed after a warm-up, against the
//!   same trace without a change: `rollout_seconds` (the change to POOL_ROLLOUT_COMPLETED),
//!   `extra_boots` (VM_DELETED_FOR_ROLLOUT), `leases_disrupted` (heartbeats or releases of a
//!   held lease that failed), `warm_hit_delta_pp` (first-attempt warm hits, with minus
//!   without the rollout, over the rollout's span).
//! - `idle`: the same pool with no claims: `rollout_seconds`.
//! - `broken`: a template whose VMs end FAILED: failed VMs before the halt, healthy VMs
//!   retired, the lowest AVAILABLE count seen, whether it rolled back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use poolmgr_core::AppState;
use poolmgr_core::auth::{Principal, Role};
use poolmgr_core::domain::{LeaseId, PoolRef, PoolSpec, RolloutState};
use poolmgr_core::reconcile;
use poolmgr_core::service::{self, claim::ClaimRequest};
use serde_json::json;

use crate::growth;

const POOL: &str = "roll";
const SIZE: i32 = 50;
/// The local shape's ticker.
const PASS_EVERY: Duration = Duration::from_secs(2);

fn spec(image: &str, preference: &str) -> anyhow::Result<PoolSpec> {
    Ok(serde_json::from_value(json!({
        "name": POOL, "size": SIZE, "flintlock_hosts": ["sim"],
        "replenishment": {"strategy": "IMMEDIATE_ON_LEASE"},
        "microvm_template": {
            "root_volume": {"id": "root", "source": {"container_source": image}},
            "interfaces": [{"device_id": "eth1", "type": "TAP"}]
        },
        "rollout": {"claim_preference": preference}
    }))?)
}

fn pool_ref() -> PoolRef {
    PoolRef { namespace: "default".into(), name: POOL.into() }
}

async fn count(state: &AppState, sql: &str) -> anyhow::Result<i64> {
    let c = state.db.raw().get().await?;
    Ok(c.query_one(sql, &[]).await?.get(0))
}

async fn available(state: &AppState) -> anyhow::Result<i64> {
    count(state, "SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await
}

/// A pass every [`PASS_EVERY`] until `stop`.
fn ticker(state: AppState, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            if let Err(e) = reconcile::run_pass(&state).await {
                eprintln!("    pass failed: {e}");
            }
            tokio::time::sleep(PASS_EVERY).await;
        }
    })
}

/// Claims at `rate` per second (each held `hold`, heartbeated every 10 s, then released)
/// until `stop`; counts first-attempt warm hits and misses per second of the run, and held
/// leases whose heartbeat or release failed.
struct Load {
    hits: Arc<std::sync::Mutex<Vec<(f64, bool)>>>,
    disrupted: Arc<AtomicI64>,
}

fn load(
    state: AppState,
    rate: f64,
    hold: Duration,
    t0: Instant,
    stop: Arc<AtomicBool>,
) -> (Load, tokio::task::JoinHandle<()>) {
    let hits = Arc::new(std::sync::Mutex::new(Vec::new()));
    let disrupted = Arc::new(AtomicI64::new(0));
    let (h, d) = (hits.clone(), disrupted.clone());
    let task = tokio::spawn(async move {
        let principal = Principal { name: "bench".into(), role: Role::Client };
        let mut jobs = vec![];
        let gap = Duration::from_secs_f64(1.0 / rate);
        let mut next = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep_until(tokio::time::Instant::from_std(next)).await;
            next += gap;
            let (state, principal, h, d) = (state.clone(), principal.clone(), h.clone(), d.clone());
            jobs.push(tokio::spawn(async move {
                let mut first = true;
                let lease = loop {
                    let req = ClaimRequest { pool: pool_ref(), request_id: None };
                    match service::claim::claim(&state, &principal, req).await {
                        Ok(r) => {
                            if first {
                                h.lock().unwrap().push((t0.elapsed().as_secs_f64(), true));
                            }
                            break r.lease.lease_id;
                        }
                        Err(_) => {
                            if first {
                                h.lock().unwrap().push((t0.elapsed().as_secs_f64(), false));
                            }
                            first = false;
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                };
                let Ok(id) = LeaseId::parse(&lease) else { return };
                let until = Instant::now() + hold;
                while Instant::now() < until {
                    tokio::time::sleep(Duration::from_secs(10).min(until - Instant::now())).await;
                    if Instant::now() < until && service::lease::heartbeat(&state, &principal, &id).await.is_err() {
                        d.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if service::lease::release(&state, &principal, &id).await.is_err() {
                    d.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for j in jobs {
            let _ = j.await;
        }
    });
    (Load { hits, disrupted }, task)
}

impl Load {
    /// First-attempt warm-hit ratio over [from, to) seconds of the run.
    fn warm_ratio(&self, from: f64, to: f64) -> f64 {
        let h = self.hits.lock().unwrap();
        let span: Vec<bool> = h.iter().filter(|(t, _)| *t >= from && *t < to).map(|(_, hit)| *hit).collect();
        if span.is_empty() { 1.0 } else { span.iter().filter(|h| **h).count() as f64 / span.len() as f64 }
    }
}

/// A fresh database's service with a 50-VM pool filled on a sim booting in `boot`.
async fn setup(
    boot: Duration,
    database_url: Option<&str>,
    preference: &str,
) -> anyhow::Result<(AppState, flintlock_sim::Sim, flintlock_sim::SimServer)> {
    let mut overrides = vec![("POOLMGR_AUTH", "disabled"), ("POOLMGR_RECONCILE_MAX_CREATES", "1000")];
    if let Some(url) = database_url {
        overrides.push(("DATABASE_URL", url));
    }
    let state = growth::bench_state(&overrides).await?;
    let mut cfg = growth::bench_sim_config();
    cfg.boot_delay = boot;
    let (sim, server) = growth::start_sim(&state, "sim", cfg).await?;
    service::pool::create(&state, spec("ghcr.io/x/runner:1", preference)?, "bench")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for _ in 0..200 {
        reconcile::run_pass(&state).await?;
        if available(&state).await? >= i64::from(SIZE) {
            return Ok((state, sim, server));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("the pool never filled")
}

async fn change_template(state: &AppState, image: &str, preference: &str) -> anyhow::Result<()> {
    service::pool::update(state, &pool_ref(), spec(image, preference)?, "bench")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

async fn rollout_state(state: &AppState) -> anyhow::Result<Option<RolloutState>> {
    let p = service::pool::get(state, &pool_ref()).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(p.status.rollout.map(|r| r.state))
}

/// One busy run: warm-up, then (with `roll`) the change; returns (rollout seconds, run's load,
/// change time, end time, extra boots).
async fn busy_run(
    roll: bool,
    boot: Duration,
    warmup: Duration,
    limit: Duration,
    database_url: Option<&str>,
    preference: &str,
) -> anyhow::Result<(Option<f64>, Load, f64, f64, i64)> {
    let (state, _sim, _server) = setup(boot, database_url, preference).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let tick = ticker(state.clone(), stop.clone());
    let (l, task) = load(state.clone(), 0.5, Duration::from_secs(30), t0, stop.clone());
    tokio::time::sleep(warmup).await;
    let changed = t0.elapsed().as_secs_f64();
    let mut done = None;
    if roll {
        change_template(&state, "ghcr.io/x/runner:2", preference).await?;
    }
    while t0.elapsed().as_secs_f64() - changed < limit.as_secs_f64() {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if roll && done.is_none() && rollout_state(&state).await? == Some(RolloutState::Complete) {
            done = Some(t0.elapsed().as_secs_f64() - changed);
            break;
        }
    }
    let end = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = tick.await;
    let _ = task.await;
    let extra = count(&state, "SELECT count(*) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await?;
    Ok((done, l, changed, end, extra))
}

/// `baseline_url`: the (empty) database of the busy scenario's run without a change.
pub async fn run(
    scenario: &str,
    boot_ms: u64,
    baseline_url: Option<&str>,
    out: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let boot = Duration::from_millis(boot_ms);
    let row = match scenario {
        "busy" | "busy-any" => {
            let preference = if scenario == "busy" { "CURRENT" } else { "ANY" };
            eprintln!(
                "==> {scenario}: {SIZE}-VM pool, 0.5 claims/s held 30 s, boot {boot_ms} ms, claim_preference {preference}; with the change"
            );
            // A warm-up of the rollout's whole window (120 s) and a pass more: the rollout
            // counts on the last window's claims to retire stale VMs under ANY, and a pool at a
            // steady 0.5 claims/s has a window of them behind it (a 40 s warm-up held a third).
            let warmup = Duration::from_secs(130);
            let limit = Duration::from_secs(300);
            let baseline =
                baseline_url.ok_or_else(|| anyhow::anyhow!("busy needs --baseline-url (an empty database)"))?;
            let (secs, with, changed, end, extra) = busy_run(true, boot, warmup, limit, None, preference).await?;
            eprintln!("==> the same trace without a change (the baseline)");
            let span = Duration::from_secs_f64(end - changed);
            let (_, without, _, _, _) = busy_run(false, boot, warmup, span, Some(baseline), preference).await?;
            let delta = (with.warm_ratio(changed, end) - without.warm_ratio(changed, end)) * 100.0;
            json!({
                "scenario": scenario, "claim_preference": preference, "pool": SIZE, "claims_per_second": 0.5, "boot_ms": boot_ms,
                "rollout_seconds": secs, "extra_boots": extra,
                "extra_boots_ratio": extra as f64 / f64::from(SIZE),
                "leases_disrupted": with.disrupted.load(Ordering::Relaxed),
                "warm_hit_with": with.warm_ratio(changed, end), "warm_hit_without": without.warm_ratio(changed, end),
                "warm_hit_delta_pp": delta,
            })
        }
        "idle" => {
            eprintln!("==> idle: {SIZE}-VM pool, no claims, boot {boot_ms} ms");
            let (state, _sim, _server) = setup(boot, None, "CURRENT").await?;
            let stop = Arc::new(AtomicBool::new(false));
            let tick = ticker(state.clone(), stop.clone());
            let t = Instant::now();
            change_template(&state, "ghcr.io/x/runner:2", "CURRENT").await?;
            let mut min_available = i64::MAX;
            let mut secs = None;
            while t.elapsed() < Duration::from_secs(300) {
                min_available = min_available.min(available(&state).await?);
                if rollout_state(&state).await? == Some(RolloutState::Complete) {
                    secs = Some(t.elapsed().as_secs_f64());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            stop.store(true, Ordering::Relaxed);
            let _ = tick.await;
            let extra = count(&state, "SELECT count(*) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await?;
            json!({"scenario": "idle", "pool": SIZE, "boot_ms": boot_ms, "rollout_seconds": secs,
                   "extra_boots": extra, "leases_disrupted": 0, "min_available": min_available})
        }
        "broken" => {
            eprintln!("==> broken: {SIZE}-VM pool, a template whose VMs end FAILED");
            let (state, sim, _server) = setup(boot, None, "CURRENT").await?;
            sim.add_failing_image("broken");
            let stop = Arc::new(AtomicBool::new(false));
            let tick = ticker(state.clone(), stop.clone());
            let t = Instant::now();
            change_template(&state, "ghcr.io/x/broken:2", "CURRENT").await?;
            let mut min_available = i64::MAX;
            let mut end = None;
            while t.elapsed() < Duration::from_secs(300) {
                min_available = min_available.min(available(&state).await?);
                if let Some(s @ (RolloutState::Halted | RolloutState::RolledBack)) = rollout_state(&state).await? {
                    end = Some((s, t.elapsed().as_secs_f64()));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            stop.store(true, Ordering::Relaxed);
            let _ = tick.await;
            let failed = count(&state, "SELECT count(*) FROM events WHERE type = 'VM_HOOK_FAILED'").await?;
            let retired = count(&state, "SELECT count(*) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await?;
            json!({"scenario": "broken", "pool": SIZE, "boot_ms": boot_ms,
                   "state": end.map(|(s, _)| s.as_str()), "halted_after_seconds": end.map(|(_, t)| t),
                   "failed_vms": failed, "healthy_vms_retired": retired, "min_available": min_available,
                   "extra_boots": retired, "leases_disrupted": 0, "rollout_seconds": null})
        }
        other => anyhow::bail!("unknown scenario {other:?}: busy, busy-any, idle or broken"),
    };
    println!("{row}");
    if let Some(path) = out {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(f, "{row}")?;
    }
    Ok(())
}
