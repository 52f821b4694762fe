//! What a run of the demand benchmark is told (`demand` arguments, [`Args`]), the policies it
//! compares ([`Policy`]), and its plan: one row per (trace, policy, configuration), each with
//! its pool's spec, size, stack and start offset ([`plan`]). Pure: no I/O.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};

use super::trace::{self, Trace, TraceKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    StaticPeak,
    StaticMean,
    Autoscaled,
    AutoscaledHints,
}

impl Policy {
    pub const ALL: [Policy; 4] = [Policy::StaticPeak, Policy::StaticMean, Policy::Autoscaled, Policy::AutoscaledHints];

    pub fn name(self) -> &'static str {
        match self {
            Policy::StaticPeak => "static-peak",
            Policy::StaticMean => "static-mean",
            Policy::Autoscaled => "autoscaled",
            Policy::AutoscaledHints => "autoscaled-hints",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Policy::StaticPeak => "peak",
            Policy::StaticMean => "mean",
            Policy::Autoscaled => "auto",
            Policy::AutoscaledHints => "hints",
        }
    }

    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The rows a run has unless told otherwise: every policy on model-day; on the plain step
    /// no `autoscaled-hints` (nothing to announce: it would repeat `autoscaled`); on the
    /// hinted step only `autoscaled-hints` (the others send no hint: they would repeat `step`).
    pub fn default_for(self, trace: TraceKind) -> bool {
        match trace {
            TraceKind::ModelDay => true,
            TraceKind::Step => self != Policy::AutoscaledHints,
            TraceKind::StepHinted => self == Policy::AutoscaledHints,
        }
    }
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected NAME=VALUE, got {s:?}")),
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// A configuration's poolmgr for one time scale, NAME@K=URL (repeatable):
    /// local@120=http://127.0.0.1:8080. Without @K: the model-day scale (--scale). A row runs
    /// on the stack of its configuration and its trace's scale; each scale needs its own stack,
    /// because the reconciler's knobs are process-wide.
    #[arg(long = "stack", value_parser = parse_pair, required = true)]
    pub stacks: Vec<(String, String)>,
    /// A configuration's real-time stack (k = 1, its own database), NAME=URL (repeatable): the
    /// refill-lag segment runs there, at the same time as the scaled run.
    #[arg(long = "realtime-stack", value_parser = parse_pair)]
    pub realtime_stacks: Vec<(String, String)>,
    /// The flintlock-sim log of a stack's host, NAME@K=FILE (its boot draws); the real-time
    /// stacks' as NAME-realtime=FILE.
    #[arg(long = "sim-log", value_parser = parse_pair)]
    pub sim_logs: Vec<(String, String)>,
    #[arg(long, env = "POOLMGR_ADMIN_TOKEN")]
    pub admin_token: String,
    /// A client token (claims, releases, hints).
    #[arg(long, env = "POOLMGR_TOKEN")]
    pub client_token: String,
    /// The flintlock host every pool places on (registered on every stack).
    #[arg(long, default_value = "sim")]
    pub host: String,
    #[arg(long, default_value = "bench")]
    pub namespace: String,
    /// k of the model-day trace: durations divided by it, rates multiplied.
    #[arg(long, default_value_t = 120.0)]
    pub scale: f64,
    /// k of the step traces (a smaller one: their minutes matter more than the day's).
    #[arg(long, default_value_t = 20.0)]
    pub step_scale: f64,
    /// The second configuration's rows start this many real seconds after the first's (the
    /// third's twice as many, …), so their busiest minutes do not share the machine.
    #[arg(long, default_value_t = 75.0)]
    pub stagger_s: f64,
    /// D: every arrival rate and the burst rate multiplied by it (burst sizes are not).
    #[arg(long, default_value_t = 0.05)]
    pub demand: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How long before a burst (or the step) `autoscaled-hints` announces it, unscaled seconds.
    #[arg(long, default_value_t = trace::HINT_LEAD_S)]
    pub hint_lead_s: f64,
    #[arg(long, value_delimiter = ',', default_value = "model-day,step,step-hinted")]
    pub traces: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "static-peak,static-mean,autoscaled,autoscaled-hints")]
    pub policies: Vec<String>,
    /// Every (trace, policy) pair, not only the default ones (see `Policy::default_for`).
    #[arg(long)]
    pub all_rows: bool,
    /// The simulator's boot distribution, unscaled: log-normal median (ms) …
    #[arg(long, default_value_t = 30_000.0)]
    pub boot_median_ms: f64,
    /// … and σ (the script starts the simulators with the same, scaled).
    #[arg(long, default_value_t = 0.25)]
    pub boot_sigma: f64,
    /// The autoscaled pools' scale_down_stabilization_seconds, unscaled (sent as S/k, rounded).
    #[arg(long, default_value_t = 300.0)]
    pub stabilization_s: f64,
    /// The shortest real wait between two attempts of one claim (ms): poolmgr-client's waits
    /// divided by k, but never below this.
    #[arg(long, default_value_t = 10)]
    pub retry_floor_ms: u64,
    /// At most this many claim retries per second of wall clock on each stack (0: no limit).
    #[arg(long, default_value_t = 200.0)]
    pub retry_rate: f64,
    /// Real milliseconds between two status polls of every pool.
    #[arg(long, default_value_t = 150)]
    pub poll_ms: u64,
    /// Claims of each real-time segment, their spacing and hold (real seconds).
    #[arg(long, default_value_t = 6)]
    pub realtime_claims: usize,
    #[arg(long, default_value_t = 20.0)]
    pub realtime_gap_s: f64,
    #[arg(long, default_value_t = 10.0)]
    pub realtime_hold_s: f64,
    /// The rows, one JSON line each (overwritten).
    #[arg(long)]
    pub results: PathBuf,
    /// The run's settings, traces, real-time segments and checks, as one JSON document.
    #[arg(long)]
    pub summary: Option<PathBuf>,
    /// What the script set up (scaled knobs, builds), kept in the summary for the report.
    #[arg(long, default_value = "")]
    pub settings: String,
    /// A process whose CPU time (with its children's) during the replay goes into the
    /// summary, NAME=PID (repeatable).
    #[arg(long = "cpu-pid", value_parser = parse_pair)]
    pub cpu_pids: Vec<(String, String)>,
    /// The postmaster's pid: its cluster's CPU time (exited backends included) likewise.
    #[arg(long)]
    pub postmaster_pid: Option<String>,
    /// k of the `rollout` trace ([`super::rollout`]; its stacks are `NAME@K`).
    #[arg(long, default_value_t = 10.0)]
    pub rollout_scale: f64,
    /// The `rollout` trace's rows, one JSON line each (overwritten); needed with `--traces rollout`.
    #[arg(long)]
    pub rollout_results: Option<PathBuf>,
}

/// A row before it runs.
pub(super) struct Planned {
    pub(super) trace: Arc<Trace>,
    pub(super) policy: Policy,
    pub(super) configuration: String,
    /// The stack it runs on: `configuration@k`.
    pub(super) stack: String,
    pub(super) k: f64,
    /// Real seconds after the common start at which its trace begins.
    pub(super) offset: f64,
    pub(super) pool: String,
    pub(super) spec: Value,
    pub(super) size: i64,
    pub(super) autoscaling: Option<(i64, i64)>,
    pub(super) peak_load: f64,
    pub(super) mean_load: f64,
}

/// The pool every row uses: IMMEDIATE_ON_LEASE on `host`, leases that outlive every job
/// without heartbeats (heartbeats are not what this measures).
pub fn pool_spec(namespace: &str, name: &str, host: &str, size: i64, autoscaling: Option<Value>) -> Value {
    let mut spec = json!({
        "namespace": namespace,
        "name": name,
        "size": size,
        "flintlock_hosts": [host],
        "replenishment": {"strategy": "IMMEDIATE_ON_LEASE"},
        "heartbeat_interval_seconds": 3600,
        "heartbeat_expiry_seconds": 7200,
        "microvm_template": {
            "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
            "interfaces": [{"device_id": "eth1", "type": "TAP"}]
        }
    });
    if let Some(a) = autoscaling {
        spec["autoscaling"] = a;
    }
    spec
}

/// `NAME@K` of a `--stack` (K defaults to `default_k`): (configuration, key).
pub(super) fn split_stack(name: &str, default_k: f64) -> (String, String) {
    match name.split_once('@') {
        Some((c, k)) => (c.to_owned(), stack_key(c, k.parse().unwrap_or(default_k))),
        None => (name.to_owned(), stack_key(name, default_k)),
    }
}

pub(super) fn stack_key(configuration: &str, k: f64) -> String {
    format!("{configuration}@{k}")
}

/// The configurations of the stacks given, in order, each once.
pub(super) fn configurations(args: &Args) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    for (name, _) in &args.stacks {
        let (c, _) = split_stack(name, args.scale);
        if !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

pub(super) fn trace_scale(args: &Args, kind: TraceKind) -> f64 {
    match kind {
        TraceKind::ModelDay => args.scale,
        TraceKind::Step | TraceKind::StepHinted => args.step_scale,
    }
}

/// The rows of this run, their pools' specs and sizes.
pub(super) fn plan(args: &Args, traces: &[Arc<Trace>], policies: &[Policy]) -> Vec<Planned> {
    let boot_mean_s = args.boot_median_ms / 1000.0 * (args.boot_sigma * args.boot_sigma / 2.0).exp();
    let mut out = vec![];
    for (index, configuration) in configurations(args).iter().enumerate() {
        for tr in traces {
            let k = trace_scale(args, tr.kind);
            let stab = (args.stabilization_s / k).round().max(1.0) as i64;
            let peak_load = tr.peak_rate() * boot_mean_s;
            let mean_load = tr.mean_rate(args.demand) * boot_mean_s;
            let peak_size = i64::from(trace::erlang_size(peak_load, trace::TARGET_WARM));
            let mean_size = i64::from(trace::erlang_size(mean_load, trace::TARGET_WARM));
            // The ceiling counts leased VMs too: twice the peak's busy VMs (Little), twice the
            // peak's warm size and the largest burst.
            let burst = if tr.kind == TraceKind::ModelDay { i64::from(trace::BURST_MAX) } else { 0 };
            let max = (2.0 * tr.peak_rate() * trace::job_mean_s()).ceil() as i64 + 2 * peak_size + burst;
            for &policy in policies {
                if !args.all_rows && !policy.default_for(tr.kind) {
                    continue;
                }
                let pool = format!("{}-{}", tr.kind.short(), policy.short());
                let (size, autoscaling) = match policy {
                    Policy::StaticPeak => (peak_size, None),
                    Policy::StaticMean => (mean_size, None),
                    Policy::Autoscaled | Policy::AutoscaledHints => (mean_size.max(1), Some((1, max))),
                };
                let block = autoscaling.map(|(min, max)| {
                    json!({"min": min, "max": max, "target_warm_ratio": trace::TARGET_WARM, "buffer": null,
                           "scale_down_stabilization_seconds": stab})
                });
                out.push(Planned {
                    trace: tr.clone(),
                    policy,
                    configuration: configuration.clone(),
                    stack: stack_key(configuration, k),
                    k,
                    offset: index as f64 * args.stagger_s,
                    spec: pool_spec(&args.namespace, &pool, &args.host, size, block),
                    pool,
                    size,
                    autoscaling,
                    peak_load,
                    mean_load,
                });
            }
        }
    }
    out
}
