//! Process-local Prometheus counters and histograms, with the contract's metric names.
//!
//! Counters live in memory per process (per Lambda instance); they are observations, never
//! state that correctness depends on. Pool gauges are not kept here at all: `/metrics`
//! computes them from the database at scrape time.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};

use crate::domain::PoolRef;

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

impl Metrics {
    pub fn new() -> Metrics {
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
        }
    }

    pub fn claim(&self, pool: &PoolRef, replayed: bool) {
        self.claims
            .with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), if replayed { "true" } else { "false" }])
            .inc();
    }

    pub fn claim_failure(&self, pool: &PoolRef, reason: &str) {
        self.claim_failures.with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), reason]).inc();
    }

    pub fn release(&self, pool: &PoolRef, reason: &str, lease_seconds: Option<f64>) {
        self.releases.with_label_values(&[pool.namespace.as_str(), pool.name.as_str(), reason]).inc();
        if let Some(s) = lease_seconds {
            self.lease_duration.with_label_values(&[pool.namespace.as_str(), pool.name.as_str()]).observe(s.max(0.0));
        }
    }

    /// Prometheus text of every counter and histogram in this process.
    pub fn render(&self) -> String {
        TextEncoder::new().encode_to_string(&self.registry.gather()).unwrap_or_default()
    }
}
