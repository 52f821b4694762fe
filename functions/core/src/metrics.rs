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

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Mutex;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};
use serde_json::{Map, Value, json};

use crate::domain::PoolRef;
use crate::store::{PoolRow, PoolStatus};

/// How one pool gauge is read off a pool and its status.
pub type PoolGaugeValue = fn(&PoolRow, &PoolStatus) -> i64;

/// The contract's pool gauges: name, help text, value. The one definition of them: the
/// Prometheus text of `/metrics` ([`render_pool_gauges`]) and the EMF lines of the reconcile
/// function ([`Metrics::pool_gauges`]) both read this list.
pub const POOL_GAUGES: [(&str, &str, PoolGaugeValue); 5] = [
    ("poolmgr_pool_size", "Target size of the pool.", |p, _| i64::from(p.size)),
    ("poolmgr_pool_available", "AVAILABLE VMs.", |_, s| s.available),
    ("poolmgr_pool_leased", "LEASED VMs, plus VMs being claimed.", |_, s| s.leased + s.claiming),
    ("poolmgr_pool_provisioning", "VMs being provisioned or running create hooks.", |_, s| s.provisioning),
    ("poolmgr_pool_quarantined", "QUARANTINED VMs.", |_, s| s.quarantined),
];

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
    pub claims: IntCounterVec,
    pub claim_failures: IntCounterVec,
    pub releases: IntCounterVec,
    pub provision_duration: HistogramVec,
    pub hook_duration: HistogramVec,
    pub hook_failures: IntCounterVec,
    pub lease_duration: HistogramVec,
    pub orphans: IntCounterVec,
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
    Gauge(i64),
}

#[derive(Debug, Default)]
struct EmfBuffer {
    series: BTreeMap<SeriesKey, SeriesValue>,
}

const POOL: [&str; 2] = ["pool_namespace", "pool_name"];

fn counter(registry: &Registry, name: &str, help: &str, extra: &[&str]) -> IntCounterVec {
    let labels: Vec<&str> = POOL.iter().chain(extra).copied().collect();
    let c = IntCounterVec::new(Opts::new(name, help), &labels).expect("valid metric");
    registry.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn histogram(registry: &Registry, name: &str, help: &str, extra: &[&str], buckets: Vec<f64>) -> HistogramVec {
    let labels: Vec<&str> = POOL.iter().chain(extra).copied().collect();
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), &labels).expect("valid metric");
    registry.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn pool_dims(namespace: &str, name: &str, extra: Option<(&'static str, &str)>) -> Vec<(&'static str, String)> {
    let mut dims = vec![(POOL[0], namespace.to_owned()), (POOL[1], name.to_owned())];
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
        let r = Registry::new();
        let secs = vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
        let long = vec![1.0, 10.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4.0 * 3600.0, 12.0 * 3600.0, 24.0 * 3600.0];
        Metrics {
            claims: counter(
                &r,
                "poolmgr_vm_claims_total",
                "Successful claims; replayed=true for request_id replays.",
                &["replayed"],
            ),
            claim_failures: counter(
                &r,
                "poolmgr_vm_claim_failures_total",
                "Claims that returned an error, by reason.",
                &["reason"],
            ),
            releases: counter(
                &r,
                "poolmgr_vm_releases_total",
                "VMs released, by reason (api, expiry, pool_delete).",
                &["reason"],
            ),
            provision_duration: histogram(
                &r,
                "poolmgr_vm_provision_duration_seconds",
                "Time from VM row creation to AVAILABLE.",
                &[],
                secs.clone(),
            ),
            hook_duration: histogram(
                &r,
                "poolmgr_hook_duration_seconds",
                "Duration of successful hooks.",
                &["hook"],
                secs,
            ),
            hook_failures: counter(&r, "poolmgr_hook_failures_total", "Hook failures.", &["hook"]),
            lease_duration: histogram(
                &r,
                "poolmgr_lease_duration_seconds",
                "Time from claim to release or expiry.",
                &[],
                long,
            ),
            orphans: counter(&r, "poolmgr_orphans_total", "flintlock VMs without a matching row.", &["action"]),
            registry: r,
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

    /// Prometheus text of every counter and histogram in this process.
    pub fn render(&self) -> String {
        TextEncoder::new().encode_to_string(&self.registry.gather()).unwrap_or_default()
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
        let pools = vec![(pool_row("a", 3), status()), (pool_row("b", 0), PoolStatus::default())];
        let want = [
            "# HELP poolmgr_pool_size Target size of the pool.",
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
        ] {
            assert_eq!(doc[name], json!(value), "{name}");
        }

        let without = Metrics::new();
        without.pool_gauges(&[(pool_row("a", 3), status())]);
        assert!(without.take_emf_lines(1).is_empty(), "Prometheus computes the gauges at scrape time");
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
