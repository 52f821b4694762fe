//! Process-local Prometheus counters and histograms, with the contract's metric names, and
//! their CloudWatch Embedded Metric Format (EMF) twin for AWS Lambda.
//!
//! Counters live in memory per process (per Lambda instance); they are observations, never
//! state that correctness depends on. Pool gauges are not kept here: they are defined here
//! once ([`POOL_GAUGES`]) and computed from the database when `/metrics` is scraped
//! ([`render_pool_gauges`]).
//!
//! On Lambda nobody scrapes `/metrics`, so with EMF enabled (`Config::metrics_emf`) every
//! observation is also buffered and [`Metrics::flush`] prints it as EMF JSON lines on stdout,
//! which CloudWatch Logs turns into metrics: namespace `poolmgr` (one per stack on AWS:
//! `POOLMGR_METRICS_NAMESPACE`, [`Metrics::in_namespace`]), the same metric names, the
//! Prometheus labels as dimensions. The HTTP functions flush after each request and the
//! reconcile function after each pass (which also emits the pool gauges, see
//! [`Metrics::pool_gauges`]).
//!
//! Beyond the contract's list (which names the pool counters, histograms and gauges), the
//! process exports what an operator's dashboard and alerts need (`infra/monitoring/`):
//! claim latency, reconcile pass duration and the time of the last successful pass,
//! flintlock call errors by host and method, and `poolmgr_build_info`. Every family is in
//! the `/metrics` text from the start, with its HELP and TYPE lines, even before its first
//! sample ([`Metrics::render`]), so a scrape names every metric this binary can export.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;

use prometheus::core::Collector;
use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};
use serde_json::{Map, Value, json};

use crate::domain::PoolRef;
use crate::store::{PoolRow, PoolStatus};

/// How one pool gauge is read off a pool and its status.
pub type PoolGaugeValue = fn(&PoolRow, &PoolStatus) -> f64;

/// The contract's pool gauges: name, help text, value. The one definition of them: the
/// Prometheus text of `/metrics` ([`render_pool_gauges`]) and the EMF lines of the reconcile
/// function ([`Metrics::pool_gauges`]) both read this list.
pub const POOL_GAUGES: [(&str, &str, PoolGaugeValue); 15] = [
    ("poolmgr_pool_size", "Size of the pool's spec.", |p, _| f64::from(p.size)),
    ("poolmgr_pool_available", "AVAILABLE VMs.", |_, s| s.available as f64),
    ("poolmgr_pool_leased", "LEASED VMs, plus VMs being claimed.", |_, s| (s.leased + s.claiming) as f64),
    ("poolmgr_pool_provisioning", "VMs being provisioned or running create hooks.", |_, s| s.provisioning as f64),
    ("poolmgr_pool_quarantined", "QUARANTINED VMs.", |_, s| s.quarantined as f64),
    (
        "poolmgr_pool_desired_size",
        "The size the pool works towards: the autoscaler's, else the spec's size.",
        |p, _| f64::from(p.target_size()),
    ),
    (
        "poolmgr_pool_claims_per_second",
        "Claims that took a VM, per second, over the autoscaler's demand window (0 without autoscaling).",
        |p, _| p.scaling.as_ref().map_or(0.0, |s| s.claims_per_second),
    ),
    (
        "poolmgr_pool_refused_claims_per_second",
        "Claims refused for want of a VM, per second, each request once (0 without autoscaling).",
        |p, _| p.scaling.as_ref().map_or(0.0, |s| s.refused_per_second),
    ),
    (
        "poolmgr_pool_provisioning_seconds",
        "The p90 of recent VMs' creation to AVAILABLE, as the autoscaler uses it (0 without autoscaling).",
        |p, _| p.scaling.as_ref().map_or(0.0, |s| s.provisioning_seconds),
    ),
    ("poolmgr_pool_expected_claims", "Announced claims (POST /expect) not arrived yet.", |p, _| {
        p.scaling.as_ref().map_or(0.0, |s| s.expected_claims as f64)
    }),
    (
        "poolmgr_pool_batch_buffer",
        "Idle VMs the autoscaler keeps for batches of claims at once while they keep coming.",
        |p, _| p.scaling.as_ref().map_or(0.0, |s| s.batch_buffer as f64),
    ),
    ("poolmgr_pool_revision", "The pool's revision (bumped by a template or create-command change).", |p, _| {
        f64::from(p.revision)
    }),
    (
        "poolmgr_pool_stale_vms",
        "VMs of another revision than the pool's, DELETING ones not counted (leased ones included).",
        |p, _| stale_vms(p) as f64,
    ),
    (
        "poolmgr_pool_rollout_halted",
        "1 while the pool's last rollout is HALTED (or ROLLED_BACK after halting), else 0.",
        |p, _| {
            use crate::domain::RolloutState;
            f64::from(u8::from(matches!(p.rollout_state, Some(RolloutState::Halted | RolloutState::RolledBack))))
        },
    ),
    (
        "poolmgr_pool_rollout_extra_boots",
        "Stale AVAILABLE VMs the pool's last rollout retired: boots no claim needed.",
        |p, _| f64::from(p.rollout_extra_boots),
    ),
];

/// The pool's VMs of another revision than its own ([`PoolRow::by_revision`]).
fn stale_vms(p: &PoolRow) -> i64 {
    let own = p.revision.to_string();
    p.by_revision
        .as_ref()
        .map_or(0, |b| b.iter().filter(|(rev, _)| **rev != own).map(|(_, c)| c.values().sum::<i64>()).sum())
}

/// The pool gauges of `pools` (as `store::pool_gauges` reads them) in the Prometheus text
/// exposition format: a HELP and TYPE line per gauge, then one sample per pool.
pub fn render_pool_gauges(pools: &[(PoolRow, PoolStatus)]) -> String {
    let mut text = String::new();
    for (name, help, f) in POOL_GAUGES {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (p, s) in pools {
            text.push_str(&format!(
                "{name}{{pool_namespace=\"{}\",pool_name=\"{}\"}} {}\n",
                p.namespace,
                p.name,
                f(p, s)
            ));
        }
    }
    text
}

/// The CloudWatch namespace of EMF metrics unless configured (`POOLMGR_METRICS_NAMESPACE`;
/// the AWS template gives each stack its own, so two stacks in a region never mix series).
pub const EMF_NAMESPACE: &str = "poolmgr";
/// EMF allows at most 100 values per metric in one line.
const EMF_MAX_VALUES: usize = 100;

pub struct Metrics {
    registry: Registry,
    /// Every registered family, in registration order.
    families: Vec<Family>,
    pub claims: IntCounterVec,
    pub claim_failures: IntCounterVec,
    pub releases: IntCounterVec,
    pub provision_duration: HistogramVec,
    pub hook_duration: HistogramVec,
    pub hook_failures: IntCounterVec,
    pub lease_duration: HistogramVec,
    pub orphans: IntCounterVec,
    /// Successful claims (fresh and replayed), from the request to the answer.
    pub claim_duration: HistogramVec,
    /// Every reconcile pass that ran (`run_pass` returned its report), start to end.
    pub reconcile_pass_duration: HistogramVec,
    /// Unix time of the end of the last successful pass: no sample until one succeeded.
    pub reconcile_last_success: GaugeVec,
    /// Failed flintlock calls, by host and gRPC method.
    pub flintlock_errors: IntCounterVec,
    /// Always 1, labelled with this binary's version and the schema version it embeds.
    pub build_info: IntGaugeVec,
    /// Observations not yet flushed as EMF lines; `None` when EMF is off.
    emf: Option<Mutex<EmfBuffer>>,
    /// The CloudWatch namespace of the EMF lines.
    emf_namespace: String,
}

/// Dimension names and values, in dimension order.
type Dims = Vec<(&'static str, String)>;

/// One EMF series: a metric name and its dimension values (in dimension order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct SeriesKey {
    name: &'static str,
    dims: Dims,
}

#[derive(Debug)]
enum SeriesValue {
    /// A counter's increase since the last flush.
    Count(u64),
    /// Histogram observations since the last flush.
    Seconds(Vec<f64>),
    /// A gauge's latest value.
    Gauge(f64),
}

#[derive(Debug, Default)]
struct EmfBuffer {
    series: BTreeMap<SeriesKey, SeriesValue>,
}

/// The labels of every pool metric: the counters and histograms with a pool, and the gauges.
pub const POOL_LABELS: [&str; 2] = ["pool_namespace", "pool_name"];

/// One metric family a [`Metrics`] registers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    pub name: String,
    pub help: String,
    /// `counter`, `histogram` or `gauge`, as the TYPE line says.
    pub kind: &'static str,
    /// Its label names (a histogram's samples add `le`).
    pub labels: Vec<String>,
}

/// Registers the collectors of one family and notes it for [`Metrics::render`] and
/// [`Metrics::families`].
struct Families {
    registry: Registry,
    list: Vec<Family>,
}

impl Families {
    fn add<C: Collector + Clone + 'static>(&mut self, c: C, kind: &'static str) -> C {
        for d in c.desc() {
            self.list.push(Family {
                name: d.fq_name.clone(),
                help: d.help.clone(),
                kind,
                labels: d.variable_labels.clone(),
            });
        }
        self.registry.register(Box::new(c.clone())).expect("unique metric");
        c
    }

    fn counter(&mut self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"), "counter")
    }

    fn histogram(&mut self, name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(buckets);
        self.add(HistogramVec::new(opts, labels).expect("valid metric"), "histogram")
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.add(GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"), "gauge")
    }

    fn int_gauge(&mut self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"), "gauge")
    }
}

/// The pool labels, then `extra`.
fn pool(extra: &[&'static str]) -> Vec<&'static str> {
    POOL_LABELS.iter().chain(extra).copied().collect()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn pool_dims(namespace: &str, name: &str, extra: Option<(&'static str, &str)>) -> Vec<(&'static str, String)> {
    let mut dims = vec![(POOL_LABELS[0], namespace.to_owned()), (POOL_LABELS[1], name.to_owned())];
    if let Some((k, v)) = extra {
        dims.push((k, v.to_owned()));
    }
    dims
}

impl Metrics {
    /// Prometheus only.
    pub fn new() -> Metrics {
        Self::with_emf(false)
    }

    /// Prometheus, plus EMF lines on [`Metrics::flush`] when `emf` is true.
    pub fn with_emf(emf: bool) -> Metrics {
        let mut f = Families { registry: Registry::new(), list: Vec::new() };
        let secs = vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
        let long = vec![1.0, 10.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4.0 * 3600.0, 12.0 * 3600.0, 24.0 * 3600.0];
        // A claim is a few milliseconds; one with a pre-lease hook takes up to the hook
        // deadline (15 s by default).
        let claim = vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0];
        // A pass stops starting work at its deadline (50 s by default).
        let pass = vec![0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0];
        let claims = f.counter(
            "poolmgr_vm_claims_total",
            "Successful claims; replayed=true for request_id replays.",
            &pool(&["replayed"]),
        );
        let claim_failures = f.counter(
            "poolmgr_vm_claim_failures_total",
            "Claims that returned an error, by reason.",
            &pool(&["reason"]),
        );
        let releases = f.counter(
            "poolmgr_vm_releases_total",
            "VMs released, by reason (api, expiry, pool_delete).",
            &pool(&["reason"]),
        );
        let provision_duration = f.histogram(
            "poolmgr_vm_provision_duration_seconds",
            "Time from VM row creation to AVAILABLE.",
            &pool(&[]),
            secs.clone(),
        );
        let hook_duration =
            f.histogram("poolmgr_hook_duration_seconds", "Duration of successful hooks.", &pool(&["hook"]), secs);
        let hook_failures = f.counter("poolmgr_hook_failures_total", "Hook failures.", &pool(&["hook"]));
        let lease_duration =
            f.histogram("poolmgr_lease_duration_seconds", "Time from claim to release or expiry.", &pool(&[]), long);
        let orphans = f.counter("poolmgr_orphans_total", "flintlock VMs without a matching row.", &pool(&["action"]));
        let claim_duration = f.histogram(
            "poolmgr_vm_claim_duration_seconds",
            "Successful claims from request to answer (pre-lease hooks included); replayed=true for replays.",
            &pool(&["replayed"]),
            claim,
        );
        let reconcile_pass_duration = f.histogram(
            "poolmgr_reconcile_pass_duration_seconds",
            "Duration of each reconcile pass this process ran.",
            &[],
            pass,
        );
        let reconcile_last_success = f.gauge(
            "poolmgr_reconcile_last_success_timestamp_seconds",
            "Unix time at which the last reconcile pass of this process that visited every pool without an error ended.",
            &[],
        );
        let flintlock_errors = f.counter(
            "poolmgr_flintlock_errors_total",
            "Failed flintlock calls, by host and gRPC method.",
            &["host", "method"],
        );
        let build_info = f.int_gauge(
            "poolmgr_build_info",
            "Always 1: this binary's version and the schema version it embeds.",
            &["version", "schema_version"],
        );
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION"), &crate::db::latest_version().to_string()]).set(1);
        Metrics {
            claims,
            claim_failures,
            releases,
            provision_duration,
            hook_duration,
            hook_failures,
            lease_duration,
            orphans,
            claim_duration,
            reconcile_pass_duration,
            reconcile_last_success,
            flintlock_errors,
            build_info,
            registry: f.registry,
            families: f.list,
            emf: emf.then(|| Mutex::new(EmfBuffer::default())),
            emf_namespace: EMF_NAMESPACE.to_owned(),
        }
    }

    /// The same metrics, their EMF lines in CloudWatch namespace `namespace`
    /// (`Config::metrics_namespace`).
    pub fn in_namespace(self, namespace: &str) -> Metrics {
        Metrics { emf_namespace: namespace.to_owned(), ..self }
    }

    /// Whether observations are also written as EMF lines.
    pub fn emf_enabled(&self) -> bool {
        self.emf.is_some()
    }

    fn emf_record(&self, key: SeriesKey, update: impl FnOnce(&mut SeriesValue), initial: SeriesValue) {
        if let Some(buf) = &self.emf {
            let mut buf = buf.lock().unwrap_or_else(|e| e.into_inner());
            update(buf.series.entry(key).or_insert(initial));
        }
    }

    fn emf_count(&self, name: &'static str, dims: Vec<(&'static str, String)>) {
        self.emf_record(
            SeriesKey { name, dims },
            |v| {
                if let SeriesValue::Count(n) = v {
                    *n += 1;
                }
            },
            SeriesValue::Count(0),
        );
    }

    fn emf_seconds(&self, name: &'static str, dims: Vec<(&'static str, String)>, secs: f64) {
        self.emf_record(
            SeriesKey { name, dims },
            |v| {
                if let SeriesValue::Seconds(values) = v {
                    values.push(secs);
                }
            },
            SeriesValue::Seconds(Vec::new()),
        );
    }

    pub fn claim(&self, pool: &PoolRef, replayed: bool) {
        let replayed = if replayed { "true" } else { "false" };
        self.claims.with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), replayed]).inc();
        self.emf_count("poolmgr_vm_claims_total", pool_dims(&pool.namespace, &pool.name, Some(("replayed", replayed))));
    }

    pub fn claim_failure(&self, pool: &PoolRef, reason: &str) {
        self.claim_failures.with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), reason]).inc();
        self.emf_count(
            "poolmgr_vm_claim_failures_total",
            pool_dims(&pool.namespace, &pool.name, Some(("reason", reason))),
        );
    }

    pub fn release(&self, pool: &PoolRef, reason: &str, lease_seconds: Option<f64>) {
        self.releases.with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), reason]).inc();
        self.emf_count("poolmgr_vm_releases_total", pool_dims(&pool.namespace, &pool.name, Some(("reason", reason))));
        if let Some(s) = lease_seconds {
            let s = s.max(0.0);
            self.lease_duration.with_label_values(&[pool.namespace.as_str(), pool.name.as_str()]).observe(s);
            self.emf_seconds("poolmgr_lease_duration_seconds", pool_dims(&pool.namespace, &pool.name, None), s);
        }
    }

    /// A VM became AVAILABLE `secs` after its row was created.
    pub fn provisioned(&self, namespace: &str, name: &str, secs: f64) {
        let secs = secs.max(0.0);
        self.provision_duration.with_label_values(&[namespace, name]).observe(secs);
        self.emf_seconds("poolmgr_vm_provision_duration_seconds", pool_dims(namespace, name, None), secs);
    }

    /// A hook (`create` or `pre_lease`) succeeded after `secs`.
    pub fn hook_succeeded(&self, namespace: &str, name: &str, hook: &str, secs: f64) {
        let secs = secs.max(0.0);
        self.hook_duration.with_label_values(&[namespace, name, hook]).observe(secs);
        self.emf_seconds("poolmgr_hook_duration_seconds", pool_dims(namespace, name, Some(("hook", hook))), secs);
    }

    /// A hook (`create` or `pre_lease`) failed.
    pub fn hook_failed(&self, namespace: &str, name: &str, hook: &str) {
        self.hook_failures.with_label_values(&[namespace, name, hook]).inc();
        self.emf_count("poolmgr_hook_failures_total", pool_dims(namespace, name, Some(("hook", hook))));
    }

    /// An orphan flintlock VM was `adopted` or `deleted`.
    pub fn orphan(&self, namespace: &str, name: &str, action: &str) {
        self.orphans.with_label_values(&[namespace, name, action]).inc();
        self.emf_count("poolmgr_orphans_total", pool_dims(namespace, name, Some(("action", action))));
    }

    /// A successful claim answered `secs` after its request arrived.
    pub fn claim_duration(&self, pool: &PoolRef, replayed: bool, secs: f64) {
        let replayed = if replayed { "true" } else { "false" };
        let secs = secs.max(0.0);
        self.claim_duration.with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), replayed]).observe(secs);
        self.emf_seconds(
            "poolmgr_vm_claim_duration_seconds",
            pool_dims(&pool.namespace, &pool.name, Some(("replayed", replayed))),
            secs,
        );
    }

    /// A reconcile pass ran for `secs`; `succeeded` (it visited every pool and no step
    /// failed) also stamps the last success with `end_unix_seconds`.
    pub fn reconcile_pass(&self, secs: f64, succeeded: bool, end_unix_seconds: f64) {
        let secs = secs.max(0.0);
        self.reconcile_pass_duration.with_label_values::<&str>(&[]).observe(secs);
        self.emf_seconds("poolmgr_reconcile_pass_duration_seconds", Vec::new(), secs);
        if succeeded {
            self.reconcile_last_success.with_label_values::<&str>(&[]).set(end_unix_seconds);
            let value = end_unix_seconds.trunc();
            self.emf_record(
                SeriesKey { name: "poolmgr_reconcile_last_success_timestamp_seconds", dims: Vec::new() },
                |v| *v = SeriesValue::Gauge(value),
                SeriesValue::Gauge(value),
            );
        }
    }

    /// A flintlock call (`method`, the gRPC method's name) to `host` failed.
    pub fn flintlock_error(&self, host: &str, method: &str) {
        self.flintlock_errors.with_label_values(&[host, method]).inc();
        self.emf_count(
            "poolmgr_flintlock_errors_total",
            vec![("host", host.to_owned()), ("method", method.to_owned())],
        );
    }

    /// Records the contract's pool gauges ([`POOL_GAUGES`]) for EMF. Prometheus computes them
    /// at scrape time instead ([`render_pool_gauges`]), so this does nothing without EMF.
    pub fn pool_gauges(&self, pools: &[(PoolRow, PoolStatus)]) {
        if self.emf.is_none() {
            return;
        }
        for (p, s) in pools {
            for (name, _, f) in POOL_GAUGES {
                let value = f(p, s);
                self.emf_record(
                    SeriesKey { name, dims: pool_dims(&p.namespace, &p.name, None) },
                    |v| *v = SeriesValue::Gauge(value),
                    SeriesValue::Gauge(value),
                );
            }
        }
    }

    /// Takes everything recorded since the last call as EMF JSON lines stamped `timestamp_ms`:
    /// one line per dimension set, holding every metric recorded with those dimensions.
    pub fn take_emf_lines(&self, timestamp_ms: i64) -> Vec<String> {
        let Some(buf) = &self.emf else { return Vec::new() };
        let series = std::mem::take(&mut buf.lock().unwrap_or_else(|e| e.into_inner()).series);
        let mut groups: BTreeMap<Dims, Vec<(&'static str, SeriesValue)>> = BTreeMap::new();
        for (key, value) in series {
            groups.entry(key.dims).or_default().push((key.name, value));
        }
        let mut lines = Vec::new();
        for (dims, metrics) in groups {
            // Histograms with more values than one line may carry continue on lines of
            // their own.
            let mut rest: Vec<(&'static str, Vec<f64>)> = Vec::new();
            let first: Vec<(&'static str, &'static str, Value)> = metrics
                .into_iter()
                .map(|(name, v)| match v {
                    SeriesValue::Count(n) => (name, "Count", json!(n)),
                    // Whole numbers as integers, as they were before gauges could be fractional.
                    SeriesValue::Gauge(g) if g.fract() == 0.0 && g.abs() < 9e15 => (name, "Count", json!(g as i64)),
                    SeriesValue::Gauge(g) => (name, "Count", json!(g)),
                    SeriesValue::Seconds(mut values) => {
                        if values.len() > EMF_MAX_VALUES {
                            rest.push((name, values.split_off(EMF_MAX_VALUES)));
                        }
                        (name, "Seconds", json!(values))
                    }
                })
                .collect();
            lines.push(emf_line(&self.emf_namespace, timestamp_ms, &dims, &first));
            for (name, values) in rest {
                for chunk in values.chunks(EMF_MAX_VALUES) {
                    lines.push(emf_line(&self.emf_namespace, timestamp_ms, &dims, &[(name, "Seconds", json!(chunk))]));
                }
            }
        }
        lines
    }

    /// Prints the pending EMF lines on stdout (nothing without EMF, or with nothing pending).
    pub fn flush(&self) {
        if self.emf.is_none() {
            return;
        }
        let lines = self.take_emf_lines(chrono::Utc::now().timestamp_millis());
        if lines.is_empty() {
            return;
        }
        let mut out = String::new();
        for l in lines {
            out.push_str(&l);
            out.push('\n');
        }
        let mut stdout = std::io::stdout().lock();
        if let Err(e) = stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
            tracing::warn!(error = %e, "cannot write EMF metrics to stdout");
        }
    }

    /// Prometheus text of every counter, histogram and process gauge in this process: the
    /// families with samples as the encoder writes them, then the HELP and TYPE lines of
    /// every registered family without a sample yet (the encoder leaves those out), so that
    /// a scrape always names every family.
    pub fn render(&self) -> String {
        let gathered = self.registry.gather();
        let mut text = TextEncoder::new().encode_to_string(&gathered).unwrap_or_default();
        for Family { name, help, kind, .. } in &self.families {
            if !gathered.iter().any(|mf| mf.name() == name) {
                text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            }
        }
        text
    }

    /// Every family this process's registry holds (not the pool gauges: [`POOL_GAUGES`],
    /// labelled [`POOL_LABELS`]).
    pub fn families(&self) -> &[Family] {
        &self.families
    }
}

/// One EMF document: the `_aws` metadata, the dimension values and the metric values as
/// top-level members.
fn emf_line(
    namespace: &str,
    timestamp_ms: i64,
    dims: &[(&'static str, String)],
    metrics: &[(&'static str, &'static str, Value)],
) -> String {
    let names: Vec<&str> = dims.iter().map(|(k, _)| *k).collect();
    let defs: Vec<Value> = metrics.iter().map(|(name, unit, _)| json!({"Name": name, "Unit": unit})).collect();
    let mut doc = Map::new();
    doc.insert(
        "_aws".into(),
        json!({
            "Timestamp": timestamp_ms,
            "CloudWatchMetrics": [{"Namespace": namespace, "Dimensions": [names], "Metrics": defs}],
        }),
    );
    for (k, v) in dims {
        doc.insert((*k).into(), Value::String(v.clone()));
    }
    for (name, _, value) in metrics {
        doc.insert((*name).into(), value.clone());
    }
    Value::Object(doc).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str) -> PoolRef {
        PoolRef { namespace: "default".into(), name: name.into() }
    }

    fn parse(lines: &[String]) -> Vec<Value> {
        lines.iter().map(|l| serde_json::from_str(l).expect("each EMF line is one JSON document")).collect()
    }

    /// The document whose dimension values match `dims`.
    fn doc_with<'a>(docs: &'a [Value], dims: &[(&str, &str)]) -> &'a Value {
        docs.iter()
            .find(|d| dims.iter().all(|(k, v)| d[*k] == json!(v)))
            .unwrap_or_else(|| panic!("no EMF document with {dims:?} in {docs:#?}"))
    }

    #[test]
    fn emf_counter_lines_carry_namespace_dimensions_units_timestamp_and_values() {
        let m = Metrics::with_emf(true);
        m.claim(&pool("ci"), false);
        m.claim(&pool("ci"), false);
        m.claim(&pool("ci"), true);
        m.claim_failure(&pool("ci"), "exhausted");
        let docs = parse(&m.take_emf_lines(1_700_000_000_123));
        assert_eq!(docs.len(), 3, "one line per dimension set: {docs:#?}");

        let fresh = doc_with(&docs, &[("pool_name", "ci"), ("replayed", "false")]);
        let aws = &fresh["_aws"];
        assert_eq!(aws["Timestamp"], json!(1_700_000_000_123_i64));
        let directive = &aws["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], json!("poolmgr"));
        assert_eq!(directive["Dimensions"], json!([["pool_namespace", "pool_name", "replayed"]]));
        assert_eq!(directive["Metrics"], json!([{"Name": "poolmgr_vm_claims_total", "Unit": "Count"}]));
        assert_eq!(fresh["pool_namespace"], json!("default"));
        assert_eq!(fresh["poolmgr_vm_claims_total"], json!(2));

        let replayed = doc_with(&docs, &[("replayed", "true")]);
        assert_eq!(replayed["poolmgr_vm_claims_total"], json!(1));
        let failed = doc_with(&docs, &[("reason", "exhausted")]);
        assert_eq!(
            failed["_aws"]["CloudWatchMetrics"][0]["Dimensions"],
            json!([["pool_namespace", "pool_name", "reason"]])
        );
        assert_eq!(failed["poolmgr_vm_claim_failures_total"], json!(1));

        assert!(m.take_emf_lines(1).is_empty(), "a flush empties the buffer");
        assert!(
            m.render()
                .contains("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"false\"} 2")
        );
    }

    #[test]
    fn emf_lines_carry_the_configured_namespace() {
        let m = Metrics::with_emf(true).in_namespace("poolmgr/stack-a");
        m.claim(&pool("ci"), false);
        let docs = parse(&m.take_emf_lines(1));
        assert_eq!(docs[0]["_aws"]["CloudWatchMetrics"][0]["Namespace"], json!("poolmgr/stack-a"));
    }

    #[test]
    fn emf_histograms_are_value_arrays_in_seconds_and_share_a_line_with_their_dimension_set() {
        let m = Metrics::with_emf(true);
        m.release(&pool("ci"), "api", Some(12.5));
        m.release(&pool("ci"), "api", Some(-1.0));
        m.provisioned("default", "ci", 0.25);
        m.hook_succeeded("default", "ci", "create", 1.5);
        m.hook_failed("default", "ci", "pre_lease");
        m.orphan("default", "ci", "adopted");
        let docs = parse(&m.take_emf_lines(7));

        // lease and provision durations have the same dimensions: one document, two metrics.
        let plain = docs
            .iter()
            .find(|d| d["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == json!([["pool_namespace", "pool_name"]]))
            .expect("pool-only document");
        let mut defs = plain["_aws"]["CloudWatchMetrics"][0]["Metrics"].as_array().unwrap().clone();
        defs.sort_by_key(|d| d["Name"].as_str().unwrap().to_owned());
        assert_eq!(
            defs,
            vec![
                json!({"Name": "poolmgr_lease_duration_seconds", "Unit": "Seconds"}),
                json!({"Name": "poolmgr_vm_provision_duration_seconds", "Unit": "Seconds"}),
            ]
        );
        assert_eq!(plain["poolmgr_lease_duration_seconds"], json!([12.5, 0.0]));
        assert_eq!(plain["poolmgr_vm_provision_duration_seconds"], json!([0.25]));

        let released = doc_with(&docs, &[("reason", "api")]);
        assert_eq!(released["poolmgr_vm_releases_total"], json!(2));
        let create = doc_with(&docs, &[("hook", "create")]);
        assert_eq!(create["poolmgr_hook_duration_seconds"], json!([1.5]));
        let pre_lease = doc_with(&docs, &[("hook", "pre_lease")]);
        assert_eq!(pre_lease["poolmgr_hook_failures_total"], json!(1));
        let orphan = doc_with(&docs, &[("action", "adopted")]);
        assert_eq!(orphan["poolmgr_orphans_total"], json!(1));
    }

    #[test]
    fn emf_splits_more_than_100_values_over_lines() {
        let m = Metrics::with_emf(true);
        for i in 0..250 {
            m.provisioned("default", "ci", f64::from(i));
        }
        let docs = parse(&m.take_emf_lines(1));
        let sizes: Vec<usize> =
            docs.iter().map(|d| d["poolmgr_vm_provision_duration_seconds"].as_array().unwrap().len()).collect();
        assert_eq!(sizes, vec![100, 100, 50]);
        for d in &docs {
            assert_eq!(d["_aws"]["CloudWatchMetrics"][0]["Metrics"][0]["Unit"], json!("Seconds"));
        }
    }

    fn pool_row(name: &str, size: i32) -> PoolRow {
        serde_json::from_value(json!({
            "namespace": "default", "name": name, "size": size, "flintlock_hosts": ["h1"],
            "strategy": "IMMEDIATE_ON_LEASE", "min_size": null, "microvm_template": {},
            "create_commands": [], "pre_lease_commands": [],
            "hook_failure_policy": crate::domain::HookFailurePolicy::ALL[0].as_str(),
            "heartbeat_interval_seconds": 30, "heartbeat_expiry_seconds": 60,
            "created_at": "2024-01-01T00:00:00Z", "updated_at": "2024-01-01T00:00:00Z"
        }))
        .expect("a pools row")
    }

    fn status() -> PoolStatus {
        PoolStatus { available: 2, claiming: 1, leased: 4, provisioning: 5, quarantined: 6, deleting: 7 }
    }

    #[test]
    fn pool_gauges_render_as_prometheus_text_with_help_and_type_then_one_sample_per_pool() {
        let mut rolled = pool_row("a", 3);
        rolled.revision = 3;
        rolled.rollout_state = Some(crate::domain::RolloutState::Halted);
        rolled.rollout_extra_boots = 2;
        rolled.by_revision =
            serde_json::from_value(json!({"2": {"available": 1, "leased": 2}, "3": {"available": 4}})).unwrap();
        let pools = vec![(rolled, status()), (pool_row("b", 0), PoolStatus::default())];
        let want = [
            "# HELP poolmgr_pool_size Size of the pool's spec.",
            "# TYPE poolmgr_pool_size gauge",
            r#"poolmgr_pool_size{pool_namespace="default",pool_name="a"} 3"#,
            r#"poolmgr_pool_size{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_available AVAILABLE VMs.",
            "# TYPE poolmgr_pool_available gauge",
            r#"poolmgr_pool_available{pool_namespace="default",pool_name="a"} 2"#,
            r#"poolmgr_pool_available{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_leased LEASED VMs, plus VMs being claimed.",
            "# TYPE poolmgr_pool_leased gauge",
            r#"poolmgr_pool_leased{pool_namespace="default",pool_name="a"} 5"#,
            r#"poolmgr_pool_leased{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_provisioning VMs being provisioned or running create hooks.",
            "# TYPE poolmgr_pool_provisioning gauge",
            r#"poolmgr_pool_provisioning{pool_namespace="default",pool_name="a"} 5"#,
            r#"poolmgr_pool_provisioning{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_quarantined QUARANTINED VMs.",
            "# TYPE poolmgr_pool_quarantined gauge",
            r#"poolmgr_pool_quarantined{pool_namespace="default",pool_name="a"} 6"#,
            r#"poolmgr_pool_quarantined{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_desired_size The size the pool works towards: the autoscaler's, else the spec's size.",
            "# TYPE poolmgr_pool_desired_size gauge",
            r#"poolmgr_pool_desired_size{pool_namespace="default",pool_name="a"} 3"#,
            r#"poolmgr_pool_desired_size{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_claims_per_second Claims that took a VM, per second, over the autoscaler's demand window (0 without autoscaling).",
            "# TYPE poolmgr_pool_claims_per_second gauge",
            r#"poolmgr_pool_claims_per_second{pool_namespace="default",pool_name="a"} 0"#,
            r#"poolmgr_pool_claims_per_second{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_refused_claims_per_second Claims refused for want of a VM, per second, each request once (0 without autoscaling).",
            "# TYPE poolmgr_pool_refused_claims_per_second gauge",
            r#"poolmgr_pool_refused_claims_per_second{pool_namespace="default",pool_name="a"} 0"#,
            r#"poolmgr_pool_refused_claims_per_second{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_provisioning_seconds The p90 of recent VMs' creation to AVAILABLE, as the autoscaler uses it (0 without autoscaling).",
            "# TYPE poolmgr_pool_provisioning_seconds gauge",
            r#"poolmgr_pool_provisioning_seconds{pool_namespace="default",pool_name="a"} 0"#,
            r#"poolmgr_pool_provisioning_seconds{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_expected_claims Announced claims (POST /expect) not arrived yet.",
            "# TYPE poolmgr_pool_expected_claims gauge",
            r#"poolmgr_pool_expected_claims{pool_namespace="default",pool_name="a"} 0"#,
            r#"poolmgr_pool_expected_claims{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_batch_buffer Idle VMs the autoscaler keeps for batches of claims at once while they keep coming.",
            "# TYPE poolmgr_pool_batch_buffer gauge",
            r#"poolmgr_pool_batch_buffer{pool_namespace="default",pool_name="a"} 0"#,
            r#"poolmgr_pool_batch_buffer{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_revision The pool's revision (bumped by a template or create-command change).",
            "# TYPE poolmgr_pool_revision gauge",
            r#"poolmgr_pool_revision{pool_namespace="default",pool_name="a"} 3"#,
            r#"poolmgr_pool_revision{pool_namespace="default",pool_name="b"} 1"#,
            "# HELP poolmgr_pool_stale_vms VMs of another revision than the pool's, DELETING ones not counted (leased ones included).",
            "# TYPE poolmgr_pool_stale_vms gauge",
            r#"poolmgr_pool_stale_vms{pool_namespace="default",pool_name="a"} 3"#,
            r#"poolmgr_pool_stale_vms{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_rollout_halted 1 while the pool's last rollout is HALTED (or ROLLED_BACK after halting), else 0.",
            "# TYPE poolmgr_pool_rollout_halted gauge",
            r#"poolmgr_pool_rollout_halted{pool_namespace="default",pool_name="a"} 1"#,
            r#"poolmgr_pool_rollout_halted{pool_namespace="default",pool_name="b"} 0"#,
            "# HELP poolmgr_pool_rollout_extra_boots Stale AVAILABLE VMs the pool's last rollout retired: boots no claim needed.",
            "# TYPE poolmgr_pool_rollout_extra_boots gauge",
            r#"poolmgr_pool_rollout_extra_boots{pool_namespace="default",pool_name="a"} 2"#,
            r#"poolmgr_pool_rollout_extra_boots{pool_namespace="default",pool_name="b"} 0"#,
        ];
        assert_eq!(render_pool_gauges(&pools), want.map(|l| format!("{l}\n")).concat());
        assert_eq!(
            render_pool_gauges(&[]),
            want.iter().filter(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect::<String>()
        );
    }

    #[test]
    fn emf_pool_gauges_carry_the_same_gauges_and_values_as_the_prometheus_text() {
        let m = Metrics::with_emf(true);
        m.pool_gauges(&[(pool_row("a", 3), status())]);
        let docs = parse(&m.take_emf_lines(1));
        assert_eq!(docs.len(), 1, "{docs:#?}");
        let doc = doc_with(&docs, &[("pool_namespace", "default"), ("pool_name", "a")]);
        let mut got: Vec<&str> = doc["_aws"]["CloudWatchMetrics"][0]["Metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["Name"].as_str().unwrap())
            .collect();
        let mut want: Vec<&str> = POOL_GAUGES.iter().map(|(name, _, _)| *name).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        for (name, value) in [
            ("poolmgr_pool_size", 3),
            ("poolmgr_pool_available", 2),
            ("poolmgr_pool_leased", 5),
            ("poolmgr_pool_provisioning", 5),
            ("poolmgr_pool_quarantined", 6),
            ("poolmgr_pool_desired_size", 3),
            ("poolmgr_pool_expected_claims", 0),
        ] {
            assert_eq!(doc[name], json!(value), "{name}");
        }

        let without = Metrics::new();
        without.pool_gauges(&[(pool_row("a", 3), status())]);
        assert!(without.take_emf_lines(1).is_empty(), "Prometheus computes the gauges at scrape time");
    }

    #[test]
    fn render_names_every_family_with_help_and_type_once_before_and_after_its_first_sample() {
        let m = Metrics::new();
        let families: Vec<(&str, &str, Vec<&str>)> = m
            .families()
            .iter()
            .map(|f| (f.name.as_str(), f.kind, f.labels.iter().map(String::as_str).collect()))
            .collect();
        for want in [
            ("poolmgr_vm_claim_duration_seconds", "histogram", vec!["pool_namespace", "pool_name", "replayed"]),
            ("poolmgr_reconcile_pass_duration_seconds", "histogram", vec![]),
            ("poolmgr_reconcile_last_success_timestamp_seconds", "gauge", vec![]),
            ("poolmgr_flintlock_errors_total", "counter", vec!["host", "method"]),
            ("poolmgr_build_info", "gauge", vec!["version", "schema_version"]),
        ] {
            assert!(families.contains(&want), "{want:?} not in {families:#?}");
        }
        let check = |text: &str| {
            for f in m.families() {
                let type_line = format!("# TYPE {} {}", f.name, f.kind);
                assert_eq!(text.lines().filter(|l| *l == type_line).count(), 1, "{type_line} once in:\n{text}");
                assert!(text.contains(&format!("# HELP {} {}\n", f.name, f.help)), "{} HELP in:\n{text}", f.name);
            }
        };
        let fresh = m.render();
        check(&fresh);
        assert!(!fresh.contains("poolmgr_vm_claims_total{"), "no sample before the first claim:\n{fresh}");
        m.claim(&pool("ci"), false);
        m.flintlock_error("h", "ListMicroVMs");
        let later = m.render();
        check(&later);
        assert!(later.contains(r#"poolmgr_flintlock_errors_total{host="h",method="ListMicroVMs"} 1"#), "{later}");
    }

    #[test]
    fn build_info_is_one_with_the_version_and_the_embedded_schema_version() {
        let text = Metrics::new().render();
        let line = format!(
            "poolmgr_build_info{{schema_version=\"{}\",version=\"{}\"}} 1",
            crate::db::latest_version(),
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
    }

    #[test]
    fn only_a_successful_pass_stamps_the_last_success_and_every_pass_is_timed() {
        let m = Metrics::new();
        let sample = |m: &Metrics| {
            m.render()
                .lines()
                .find_map(|l| l.strip_prefix("poolmgr_reconcile_last_success_timestamp_seconds "))
                .map(str::to_owned)
        };
        m.reconcile_pass(1.5, false, 1_700_000_000.5);
        assert_eq!(sample(&m), None, "no sample before a successful pass");
        m.reconcile_pass(2.5, true, 1_700_000_100.25);
        m.reconcile_pass(0.5, false, 1_700_000_200.0);
        assert_eq!(sample(&m).as_deref(), Some("1700000100.25"), "a failed pass leaves the last success");
        let text = m.render();
        assert!(text.contains("poolmgr_reconcile_pass_duration_seconds_count 3\n"), "{text}");
        assert!(text.contains("poolmgr_reconcile_pass_duration_seconds_sum 4.5\n"), "{text}");
    }

    #[test]
    fn emf_carries_claim_latency_the_pass_metrics_and_flintlock_errors() {
        let m = Metrics::with_emf(true);
        m.claim_duration(&pool("ci"), true, 0.02);
        m.reconcile_pass(1.5, false, 1_700_000_000.9);
        m.reconcile_pass(2.5, true, 1_700_000_100.2);
        m.flintlock_error("host-a", "CreateMicroVM");
        m.flintlock_error("host-a", "CreateMicroVM");
        let docs = parse(&m.take_emf_lines(1));
        assert_eq!(docs.len(), 3, "{docs:#?}");

        let pass = docs
            .iter()
            .find(|d| d["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == json!([[]]))
            .expect("a document without dimensions");
        assert_eq!(pass["poolmgr_reconcile_pass_duration_seconds"], json!([1.5, 2.5]));
        assert_eq!(pass["poolmgr_reconcile_last_success_timestamp_seconds"], json!(1_700_000_100_i64));

        let flintlock = doc_with(&docs, &[("host", "host-a"), ("method", "CreateMicroVM")]);
        assert_eq!(flintlock["_aws"]["CloudWatchMetrics"][0]["Dimensions"], json!([["host", "method"]]));
        assert_eq!(flintlock["poolmgr_flintlock_errors_total"], json!(2));

        let claim = doc_with(&docs, &[("pool_name", "ci"), ("replayed", "true")]);
        assert_eq!(claim["poolmgr_vm_claim_duration_seconds"], json!([0.02]));
    }

    #[test]
    fn without_emf_nothing_is_buffered() {
        let m = Metrics::new();
        m.claim(&pool("ci"), false);
        assert!(!m.emf_enabled());
        assert!(m.take_emf_lines(1).is_empty());
        assert!(m.render().contains("poolmgr_vm_claims_total"));
    }
}
