//! The real-time segment (k = 1): a few claims on a pool of a configuration's real-time stack,
//! each claim's replacement timed to AVAILABLE. The scaled run cannot measure the deployed
//! refill lag: a Lambda invoke, an INIT and a loop's pauses take real milliseconds that k
//! would multiply, so this segment runs them at their own speed.
//!
//! Never asserts a time.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::bail;
use serde::{Deserialize, Serialize};

use super::metrics::{boot_draws_by_id, fifo_lags, quantile, refill_overheads};
use super::replay::{self, Api, Clock, Progress};
use super::trace::{Arrival, Trace, TraceKind};

pub const POOL: &str = "rt-refill";
/// The pool's size: replacements never wait behind each other's boots for long.
pub const SIZE: i64 = 2;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RealtimeResult {
    pub configuration: String,
    pub claims: usize,
    pub gap_s: f64,
    pub hold_s: f64,
    /// Claim → the replacement AVAILABLE (events paired in order), seconds.
    pub lags_s: Vec<f64>,
    pub refill_lag_p50_s: Option<f64>,
    pub refill_lag_p99_s: Option<f64>,
    pub unpaired: usize,
    /// Each lag less its replacement's own boot draw: what the reconciler added (seconds).
    #[serde(default)]
    pub overheads_s: Vec<f64>,
    #[serde(default)]
    pub refill_overhead_p50_s: Option<f64>,
    #[serde(default)]
    pub refill_overhead_p99_s: Option<f64>,
    #[serde(default)]
    pub refill_overhead_max_s: Option<f64>,
    pub warm_hits: usize,
    /// The simulator's boot draws for the pool (its log), and VM_PROVISIONED → VM_AVAILABLE.
    pub boot_p50_s: Option<f64>,
    pub provisioning_p50_s: Option<f64>,
    pub wall_s: f64,
    pub error: Option<String>,
}

/// Waits until `pool` has `want` AVAILABLE VMs and none PROVISIONING; false after `timeout`.
pub async fn wait_filled(api: &Api, namespace: &str, pool: &str, want: i64, timeout: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if let Ok(pools) = api.pools(namespace).await
            && let Some(p) = pools.get(pool)
        {
            let s = replay::sample(0.0, p);
            if s.available >= want && s.provisioning == 0 {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    false
}

/// One segment: pool [`POOL`] of [`SIZE`] (`spec`), `claims` claims `gap_s` apart, each held
/// `hold_s`; `sim_log` is its simulator's log (boot draws).
pub struct Segment {
    pub configuration: String,
    pub namespace: String,
    pub spec: serde_json::Value,
    pub claims: usize,
    pub gap_s: f64,
    pub hold_s: f64,
    pub sim_log: Option<std::path::PathBuf>,
}

/// Runs `seg` on `api`; an error is in the result, never a panic.
pub async fn run(api: Arc<Api>, seg: Segment) -> RealtimeResult {
    let mut out = RealtimeResult {
        configuration: seg.configuration.clone(),
        claims: seg.claims,
        gap_s: seg.gap_s,
        hold_s: seg.hold_s,
        ..Default::default()
    };
    match segment(&api, &seg, &mut out).await {
        Ok(()) => out,
        Err(e) => {
            eprintln!("==> real-time segment of {} failed: {e:#}", seg.configuration);
            out.error = Some(format!("{e:#}"));
            out
        }
    }
}

async fn segment(api: &Arc<Api>, seg: &Segment, out: &mut RealtimeResult) -> anyhow::Result<()> {
    let Segment { configuration, namespace, spec, claims, gap_s, hold_s, sim_log } = seg;
    let (claims, gap_s, hold_s) = (*claims, *gap_s, *hold_s);
    api.put_pool(spec).await?;
    eprintln!("==> real-time segment ({configuration}): filling {namespace}/{POOL} ({SIZE} VMs, real boot times)");
    if !wait_filled(api, namespace, POOL, SIZE, Duration::from_secs(300)).await {
        bail!("{namespace}/{POOL} on {} did not fill within 300 s", api.base());
    }
    let arrivals: Vec<Arrival> =
        (0..claims).map(|i| Arrival { t: i as f64 * gap_s, job: hold_s, burst: None }).collect();
    let duration = arrivals.last().map_or(0.0, |a| a.t);
    let trace = Arc::new(Trace {
        kind: TraceKind::Step,
        duration,
        phases: vec![],
        arrivals,
        hints: vec![],
        step: None,
        bursts: vec![],
    });
    let (start, t0) = (Instant::now(), SystemTime::now());
    let clock = Clock { start, k: 1.0, min_retry: Duration::ZERO };
    eprintln!("==> real-time segment ({configuration}): {claims} claims {gap_s} s apart, each held {hold_s} s");
    let replayed =
        replay::replay(api.clone(), namespace, POOL, trace, false, clock, Arc::new(Progress::default())).await;
    wait_filled(api, namespace, POOL, SIZE, Duration::from_secs(300)).await;
    out.wall_s = clock.now();
    let events = api.events(namespace, POOL, t0).await?;
    let mut claimed: Vec<f64> = events.iter().filter(|e| e.kind == "VM_CLAIMED" && e.t >= 0.0).map(|e| e.t).collect();
    let mut available: Vec<f64> =
        events.iter().filter(|e| e.kind == "VM_AVAILABLE" && e.t >= 0.0).map(|e| e.t).collect();
    claimed.sort_by(f64::total_cmp);
    available.sort_by(f64::total_cmp);
    let (lags, unpaired) = fifo_lags(&claimed, &available);
    out.refill_lag_p50_s = quantile(&lags, 0.5);
    out.refill_lag_p99_s = quantile(&lags, 0.99);
    out.lags_s = lags;
    out.unpaired = unpaired;
    out.warm_hits = replayed.claims.iter().filter(|c| super::metrics::is_warm_hit(c)).count();
    let provisioned: std::collections::HashMap<&str, f64> =
        events.iter().filter(|e| e.kind == "VM_PROVISIONED").filter_map(|e| Some((e.vm_id.as_deref()?, e.t))).collect();
    let prov: Vec<f64> = events
        .iter()
        .filter(|e| e.kind == "VM_AVAILABLE")
        .filter_map(|e| Some(e.t - provisioned.get(e.vm_id.as_deref()?)?))
        .collect();
    out.provisioning_p50_s = quantile(&prov, 0.5);
    if let Some(path) = sim_log
        && let Ok(log) = std::fs::read_to_string(path)
    {
        let draws = boot_draws_by_id(&log, POOL);
        let ms: Vec<f64> = draws.iter().map(|(_, ms)| *ms).collect();
        out.boot_p50_s = quantile(&ms, 0.5).map(|ms| ms / 1000.0);
        let boots: std::collections::HashMap<String, f64> = draws.into_iter().collect();
        let avail: std::collections::HashMap<String, f64> =
            events.iter().filter(|e| e.kind == "VM_AVAILABLE").filter_map(|e| Some((e.vm_id.clone()?, e.t))).collect();
        let mut created: Vec<(f64, String)> = events
            .iter()
            .filter(|e| e.kind == "VM_PROVISIONED" && e.t >= 0.0)
            .filter_map(|e| Some((e.t, e.vm_id.clone()?)))
            .collect();
        created.sort_by(|a, b| a.0.total_cmp(&b.0));
        out.overheads_s = refill_overheads(&claimed, &created, &avail, &boots);
        out.refill_overhead_p50_s = quantile(&out.overheads_s, 0.5);
        out.refill_overhead_p99_s = quantile(&out.overheads_s, 0.99);
        out.refill_overhead_max_s = out.overheads_s.iter().copied().reduce(f64::max);
    }
    eprintln!(
        "==> real-time segment ({configuration}): refill lag p50 {} p99 {} over {} claims; less each replacement's boot: p50 {} p99 {} max {}",
        fmt_s(out.refill_lag_p50_s),
        fmt_s(out.refill_lag_p99_s),
        out.lags_s.len(),
        fmt_s(out.refill_overhead_p50_s),
        fmt_s(out.refill_overhead_p99_s),
        fmt_s(out.refill_overhead_max_s)
    );
    Ok(())
}

fn fmt_s(v: Option<f64>) -> String {
    v.map_or("–".into(), |s| format!("{s:.1} s"))
}
