//! The operator's monitoring kit (`infra/monitoring/`) against what the service really
//! exports, and the metrics it needs: every metric and label the alert rules, their promtool
//! tests and the Grafana dashboard name is in a real `/metrics` scrape; claim latency, the
//! reconcile pass metrics, flintlock errors and `poolmgr_build_info` are observed as the
//! kit reads them. promtool itself runs in `scripts/check-monitoring.sh`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;
use std::time::Duration;

use axum::http::Method;
use poolmgr_core::metrics::POOL_LABELS;
use poolmgr_core::store;
use poolmgr_tests::*;
use regex::Regex;
use serde_json::{Value, json};

const KIT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../infra/monitoring");

/// The files of the kit that name metrics, and their text.
fn kit_files() -> Vec<(String, String)> {
    let files = ["poolmgr.rules.yml", "poolmgr.rules.test.yml", "poolmgr-dashboard.json"];
    files
        .iter()
        .map(|f| {
            let path = format!("{KIT}/{f}");
            (f.to_string(), std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
        })
        .collect()
}

/// Metric families of a Prometheus text exposition, by name: their TYPE.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (name, kind) = l.split_once(' ').expect("TYPE line: name and type");
            (name.to_owned(), kind.to_owned())
        })
        .collect()
}

/// What the service exports: the families of a scrape and every label their samples can carry.
struct Exported {
    families: BTreeMap<String, String>,
    labels: BTreeSet<String>,
}

impl Exported {
    async fn of(app: &TestApp) -> Exported {
        let families = families(&app.scrape().await);
        let mut labels: BTreeSet<String> = POOL_LABELS.iter().map(|l| l.to_string()).collect();
        for f in app.state.metrics.families() {
            labels.extend(f.labels.iter().cloned());
        }
        // Histogram buckets, and the labels Prometheus gives every scraped series.
        labels.extend(["le", "job", "instance"].map(String::from));
        Exported { families, labels }
    }

    /// Whether `name` is a series name the scrape can hold: a family, or a histogram's
    /// `_bucket`, `_sum` or `_count`.
    fn has(&self, name: &str) -> bool {
        if self.families.contains_key(name) {
            return true;
        }
        ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix).is_some_and(|base| self.families.get(base).is_some_and(|k| k == "histogram"))
        })
    }

    /// Every metric or label that `text` names and the service does not export, as
    /// `metric NAME` or `label NAME`.
    fn unknown_in(&self, text: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for m in METRIC.find_iter(text) {
            if !self.has(m.as_str()) {
                out.insert(format!("metric {}", m.as_str()));
            }
        }
        for label in referenced_labels(text) {
            if !self.labels.contains(&label) {
                out.insert(format!("label {label}"));
            }
        }
        out
    }
}

/// A poolmgr metric name (alert names are CamelCase, so they never match).
static METRIC: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\bpoolmgr_[a-z0-9_]+").unwrap());

/// Label names a PromQL expression, an alert template or a Grafana legend refers to:
/// matchers (`name="…"`, `!=`, `=~`, `!~`), grouping and matching clauses (`by`, `without`,
/// `on`, `ignoring`, `group_left`, `group_right`), `label_values(…, name)`, `$labels.name`
/// and `{{name}}`.
fn referenced_labels(text: &str) -> BTreeSet<String> {
    static MATCHER: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r#"[{,]\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\\?""#).unwrap());
    static CLAUSE: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([a-zA-Z0-9_,\s]*)\)").unwrap()
    });
    static LABEL_VALUES: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"label_values\([^)]*\)?[^,()]*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)").unwrap());
    static TEMPLATE: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)|\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}").unwrap()
    });
    let mut out = BTreeSet::new();
    for c in MATCHER.captures_iter(text) {
        out.insert(c[1].to_owned());
    }
    for c in CLAUSE.captures_iter(text) {
        out.extend(c[1].split(',').map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned));
    }
    for c in LABEL_VALUES.captures_iter(text) {
        out.insert(c[1].to_owned());
    }
    for c in TEMPLATE.captures_iter(text) {
        out.insert(c.get(1).or(c.get(2)).unwrap().as_str().to_owned());
    }
    out
}

/// Every PromQL expression of the dashboard (panel targets and template variables).
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                        ("query", Value::Object(q)) => {
                            if let Some(Value::String(s)) = q.get("query") {
                                out.push(s.clone());
                            }
                        }
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(dashboard, &mut out);
    out
}

#[tokio::test]
async fn the_rules_their_tests_and_the_dashboard_name_only_metrics_and_labels_the_service_exports() {
    let app = TestApp::spawn().await;
    let exported = Exported::of(&app).await;
    let mut unknown = BTreeMap::new();
    let mut named = BTreeSet::new();
    for (file, text) in kit_files() {
        named.extend(METRIC.find_iter(&text).map(|m| m.as_str().to_owned()));
        let bad = exported.unknown_in(&text);
        if !bad.is_empty() {
            unknown.insert(file, bad);
        }
    }
    assert!(unknown.is_empty(), "infra/monitoring names what /metrics does not export: {unknown:#?}");

    // What the kit is for: each of these is read by a rule or a panel.
    for name in [
        "poolmgr_pool_size",
        "poolmgr_pool_available",
        "poolmgr_pool_leased",
        "poolmgr_pool_provisioning",
        "poolmgr_pool_quarantined",
        "poolmgr_vm_claims_total",
        "poolmgr_vm_claim_failures_total",
        "poolmgr_vm_claim_duration_seconds_bucket",
        "poolmgr_vm_releases_total",
        "poolmgr_reconcile_pass_duration_seconds_bucket",
        "poolmgr_reconcile_last_success_timestamp_seconds",
        "poolmgr_flintlock_errors_total",
        "poolmgr_build_info",
        // Demand sizing and rollouts.
        "poolmgr_pool_desired_size",
        "poolmgr_pool_claims_per_second",
        "poolmgr_pool_refused_claims_per_second",
        "poolmgr_pool_rollout_halted",
        "poolmgr_pool_stale_vms",
    ] {
        assert!(named.contains(name), "infra/monitoring never reads {name}");
    }

    // The dashboard is a Grafana dashboard whose every target has a PromQL expression on the
    // data source variable.
    let (_, text) = kit_files().into_iter().find(|(f, _)| f.ends_with(".json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], json!("poolmgr"));
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 15, "{exprs:#?}");
    for panel in dashboard["panels"].as_array().unwrap().iter().filter(|p| p["type"] != json!("row")) {
        assert_eq!(panel["datasource"]["uid"], json!("${datasource}"), "{}", panel["title"]);
        for t in panel["targets"].as_array().unwrap() {
            assert!(METRIC.is_match(t["expr"].as_str().unwrap()), "{}: {}", panel["title"], t["expr"]);
        }
    }
}

/// The expressions of the rules file: (alert name, PromQL).
fn rule_exprs() -> Vec<(String, String)> {
    rules()
        .into_iter()
        .map(|r| (r["alert"].as_str().unwrap().to_owned(), r["expr"].as_str().unwrap().to_owned()))
        .collect()
}

/// Every rule of `poolmgr.rules.yml`.
fn rules() -> Vec<yaml_serde::Value> {
    let path = format!("{KIT}/poolmgr.rules.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let doc: yaml_serde::Value = yaml_serde::from_str(&text).expect("the rules are YAML");
    let groups = doc["groups"].as_sequence().expect("groups");
    groups.iter().flat_map(|g| g["rules"].as_sequence().expect("rules").iter().cloned()).collect()
}

/// The pool gauges `expr` reads other than once per pool: every process exports the same
/// database-derived value, so a gauge must be taken as `max without(instance, job) (gauge…)`
/// before anything else (infra/monitoring/README.md, "Counting once").
fn pool_gauges_not_taken_once(expr: &str) -> Vec<String> {
    let gauges: BTreeSet<&str> = poolmgr_core::metrics::POOL_GAUGES.iter().map(|(name, _, _)| *name).collect();
    METRIC
        .find_iter(expr)
        .filter(|m| gauges.contains(m.as_str()))
        .filter(|m| {
            let before: String = expr[..m.start()].chars().filter(|c| !c.is_whitespace()).collect();
            !before.ends_with("maxwithout(instance,job)(")
        })
        .map(|m| m.as_str().to_owned())
        .collect()
}

/// Issue 26 item 7: with two processes scraped, a per-instance comparison fires each alert
/// twice and a `sum` counts each VM twice. Every rule and every dashboard query reads the
/// pool gauges once per pool (the template variables' `label_values` only list label values).
#[test]
fn every_rule_and_dashboard_query_takes_each_pool_gauge_once_per_pool() {
    let mut wrong = Vec::new();
    let rules = rule_exprs();
    assert!(rules.len() >= 10, "{rules:?}");
    for (alert, expr) in &rules {
        for g in pool_gauges_not_taken_once(expr) {
            wrong.push(format!("rule {alert}: {g}"));
        }
    }
    let (_, text) = kit_files().into_iter().find(|(f, _)| f.ends_with(".json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let exprs = dashboard_exprs(&dashboard);
    let gauge_queries = exprs.iter().filter(|e| e.contains("poolmgr_pool_") && !e.starts_with("label_values(")).count();
    assert!(gauge_queries >= 15, "the dashboard's pool, demand and rollout panels: {exprs:#?}");
    for expr in exprs.iter().filter(|e| !e.starts_with("label_values(")) {
        for g in pool_gauges_not_taken_once(expr) {
            wrong.push(format!("dashboard {expr}: {g}"));
        }
    }
    assert!(wrong.is_empty(), "pool gauges read per process (wrap them in max without(instance, job)): {wrong:#?}");
}

/// The check above can fail: a bare gauge, a sum over the processes and a max that keeps the
/// instance are reported; the gauge taken once passes whatever the spacing.
#[test]
fn the_once_per_pool_check_reports_a_summed_or_bare_pool_gauge() {
    assert_eq!(pool_gauges_not_taken_once("poolmgr_pool_available + 1 < 3"), ["poolmgr_pool_available"]);
    assert_eq!(pool_gauges_not_taken_once("sum(poolmgr_pool_leased{pool_name=~\"$pool\"})"), ["poolmgr_pool_leased"]);
    assert_eq!(pool_gauges_not_taken_once("max by (instance) (poolmgr_pool_size)"), ["poolmgr_pool_size"]);
    assert!(
        pool_gauges_not_taken_once("sum(max without (instance, job)\n  (poolmgr_pool_leased{a=\"b\"}))").is_empty()
    );
    // Per-process metrics are not pool gauges: summing them is right.
    assert!(pool_gauges_not_taken_once("sum(rate(poolmgr_vm_claims_total[5m]))").is_empty());
}

/// A heading's anchor as GitHub makes it: lower case, punctuation but `-` and `_` dropped,
/// spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Issue 26 item 7: every alert links its own section of docs/troubleshooting.md, and every
/// link inside that page lands on one of its headings.
#[test]
fn every_alert_has_a_runbook_url_to_its_section_of_the_troubleshooting_page() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/troubleshooting.md");
    let page = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let anchors: BTreeSet<String> =
        page.lines().filter_map(|l| l.strip_prefix('#')).map(|h| anchor(h.trim_start_matches('#'))).collect();
    let rules = rules();
    assert!(rules.len() >= 10);
    for rule in &rules {
        let alert = rule["alert"].as_str().expect("every rule is an alert");
        let url = rule["annotations"]["runbook_url"].as_str().unwrap_or_else(|| panic!("{alert} has no runbook_url"));
        let want = format!("docs/troubleshooting.md#{}", anchor(alert));
        assert_eq!(url, want, "{alert}");
        assert!(anchors.contains(&anchor(alert)), "docs/troubleshooting.md has no section {alert}");
    }
    // The symptoms the page promises, and its own links.
    for section in [
        "a-pool-is-stuck-below-its-size",
        "claims-answer-429-resource_exhausted",
        "503s-after-a-deploy",
        "flintlock-host-errors",
    ] {
        assert!(anchors.contains(section), "no section #{section}: {anchors:?}");
    }
    let link = Regex::new(r"\]\(#([^)]+)\)").unwrap();
    let links: Vec<String> = link.captures_iter(&page).map(|c| c[1].to_owned()).collect();
    assert!(links.len() >= 10, "{links:?}");
    for l in links {
        assert!(anchors.contains(&l), "docs/troubleshooting.md links to #{l}, which is no heading of it");
    }
}

/// The check above can fail: a misspelt metric, a histogram suffix on a counter and a
/// label the service never sets are each reported.
#[tokio::test]
async fn the_kit_check_reports_a_wrong_metric_or_label() {
    let app = TestApp::spawn().await;
    let exported = Exported::of(&app).await;
    let ok = r#"sum by (pool_namespace, le) (rate(poolmgr_vm_claim_duration_seconds_bucket{pool_name=~"$pool"}[5m]))"#;
    assert_eq!(exported.unknown_in(ok), BTreeSet::new());
    let bad = r#"sum by (pool, replayed) (rate(poolmgr_vm_claim_total{pool_namespace="x", hots!="y"}[5m]))
                 + poolmgr_vm_claims_total_bucket  # {{ $labels.pool_nmae }} {{hots}}"#;
    let want: BTreeSet<String> = [
        "metric poolmgr_vm_claim_total",
        "metric poolmgr_vm_claims_total_bucket",
        "label pool",
        "label hots",
        "label pool_nmae",
    ]
    .map(String::from)
    .into();
    assert_eq!(exported.unknown_in(bad), want);
}

#[tokio::test]
async fn a_fresh_scrape_names_every_family_once_with_help_and_type_and_build_info() {
    let app = TestApp::spawn().await;
    let text = app.scrape().await;
    let fams = families(&text);
    for f in app.state.metrics.families() {
        assert_eq!(fams.get(&f.name).map(String::as_str), Some(f.kind), "{} in:\n{text}", f.name);
        assert_eq!(text.matches(&format!("# TYPE {} ", f.name)).count(), 1, "{}", f.name);
    }
    for (name, _, _) in poolmgr_core::metrics::POOL_GAUGES {
        assert_eq!(fams.get(name).map(String::as_str), Some("gauge"), "{name}");
    }
    let build = format!(
        "poolmgr_build_info{{schema_version=\"{}\",version=\"{}\"}} 1",
        poolmgr_core::db::latest_version(),
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.lines().any(|l| l == build), "{build} not in:\n{text}");
}

#[tokio::test]
async fn successful_claims_are_timed_by_replayed_and_failed_ones_are_not() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    app.seed_available("ci", 1).await;
    let count = |replayed: &str| {
        app.metric(&format!(
            "poolmgr_vm_claim_duration_seconds_count{{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"{replayed}\"}}"
        ))
    };
    app.claimed(CLIENT_A, "ci", Some("job-1")).await;
    app.claimed(CLIENT_A, "ci", Some("job-1")).await;
    app.claimed(CLIENT_A, "ci", Some("job-1")).await;
    app.claim(CLIENT_A, "ci", Some("job-2")).await.assert_error(429, "RESOURCE_EXHAUSTED");
    app.claim(CLIENT_A, "nope", None).await.assert_error(404, "NOT_FOUND");
    assert_eq!((count("false"), count("true")), (1.0, 2.0));
    let text = app.scrape().await;
    assert!(
        text.contains(
            r#"poolmgr_vm_claim_duration_seconds_bucket{pool_name="ci",pool_namespace="default",replayed="false",le="+Inf"} 1"#
        ),
        "{text}"
    );
    assert!(!text.contains(r#"poolmgr_vm_claim_duration_seconds_count{pool_name="nope""#), "{text}");
}

/// The value of the unlabelled sample `name` in a scrape.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).map(|v| v.parse().unwrap())
}

#[tokio::test]
async fn every_pass_is_timed_and_only_a_successful_one_stamps_the_last_success() {
    let app = TestApp::spawn().await;
    let text = app.scrape().await;
    assert_eq!(sample(&text, "poolmgr_reconcile_last_success_timestamp_seconds"), None, "no pass yet:\n{text}");
    assert_eq!(sample(&text, "poolmgr_reconcile_pass_duration_seconds_count"), None);

    app.create_pool("ci", 1).await;
    let before = chrono::Utc::now().timestamp_millis() as f64 / 1000.0;
    let report = app.pass().await;
    let after = chrono::Utc::now().timestamp_millis() as f64 / 1000.0;
    assert!(report.errors.is_empty() && !report.deadline_reached, "{report:?}");
    let text = app.scrape().await;
    let stamp = sample(&text, "poolmgr_reconcile_last_success_timestamp_seconds").expect("stamped");
    assert!(before <= stamp && stamp <= after, "{before} <= {stamp} <= {after}");
    assert_eq!(sample(&text, "poolmgr_reconcile_pass_duration_seconds_count"), Some(1.0));
    let seconds = sample(&text, "poolmgr_reconcile_pass_duration_seconds_sum").unwrap();
    assert!(seconds > 0.0 && seconds <= after - before + 0.01, "{seconds}");

    // A pass whose step fails (the database refuses its statements) is timed, not stamped.
    // (`leases`: the pass's start reads hosts and VMs, a pool's step reads leases.)
    app.conn().await.batch_execute("ALTER TABLE leases RENAME TO leases_away").await.unwrap();
    let report = app.pass().await;
    app.conn().await.batch_execute("ALTER TABLE leases_away RENAME TO leases").await.unwrap();
    assert!(!report.errors.is_empty(), "{report:?}");
    let text = app.scrape().await;
    assert_eq!(sample(&text, "poolmgr_reconcile_last_success_timestamp_seconds"), Some(stamp));
    assert_eq!(sample(&text, "poolmgr_reconcile_pass_duration_seconds_count"), Some(2.0));
}

#[tokio::test]
async fn a_pass_stopped_by_its_deadline_is_not_a_success() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_RECONCILE_DEADLINE_SECONDS".into(), "0".into()))).await;
    app.create_pool("ci", 1).await;
    let report = app.pass().await;
    assert!(report.deadline_reached, "{report:?}");
    let text = app.scrape().await;
    assert_eq!(sample(&text, "poolmgr_reconcile_pass_duration_seconds_count"), Some(1.0));
    assert_eq!(sample(&text, "poolmgr_reconcile_last_success_timestamp_seconds"), None, "{text}");
}

#[tokio::test]
async fn failed_flintlock_calls_are_counted_by_host_and_method_and_answers_are_not() {
    let app = TestApp::spawn().await;
    // A host whose port nothing listens on.
    let port = unused_port();
    app.post(
        ADMIN,
        "/v1/hosts",
        json!({"name": "dead", "address": format!("127.0.0.1:{port}"), "tls": {"insecure": true}}),
    )
    .await
    .assert_ok(201);
    let errors = |host: &str, method: &str| {
        app.metric(&format!("poolmgr_flintlock_errors_total{{host=\"{host}\",method=\"{method}\"}}"))
    };

    // The reconciler's CreateMicroVM on the dead host fails (and marks the host sick, so the
    // pass's orphan scan skips it: issue 14 item 7); a list on it fails too, by its own name.
    let mut spec = pool_spec("ci", 1);
    spec["flintlock_hosts"] = json!(["dead"]);
    app.created_pool(spec).await;
    app.pass().await;
    assert_eq!(errors("dead", "CreateMicroVM"), 1.0);
    assert_eq!(errors("dead", "ListMicroVMs"), 0.0);
    let dead = {
        let conn = app.conn().await;
        store::host_get(&**conn, "dead").await.unwrap().unwrap().0.endpoint()
    };
    app.state.flintlock.list(&dead, "", None).await.expect_err("nothing listens on the dead host");
    assert_eq!(errors("dead", "ListMicroVMs"), 1.0);

    // A VM flintlock does not know is an answer of get and delete, not a failure.
    let sim = {
        let conn = app.conn().await;
        store::host_get(&**conn, SIM_HOST).await.unwrap().unwrap().0.endpoint()
    };
    const UNKNOWN: &str = "01NOSUCHVM0000000000000000";
    assert_eq!(app.state.flintlock.get(&sim, UNKNOWN).await.unwrap(), None);
    app.state.flintlock.delete(&sim, UNKNOWN).await.unwrap();
    assert_eq!((errors(SIM_HOST, "GetMicroVM"), errors(SIM_HOST, "DeleteMicroVM")), (0.0, 0.0));

    // Nor are a command's non-zero exit code and a guest agent that is not up yet.
    app.sim.set_exec_exit_code("exit-three", 3);
    let vm = app.seed_vm("ci", poolmgr_core::domain::Phase::Available).await;
    let uid = vm.uid.as_deref().unwrap();
    let t0 = std::time::Instant::now();
    while !app.state.flintlock.wait_ready(&sim, uid, Duration::from_secs(2)).await.unwrap() {
        assert!(t0.elapsed() < Duration::from_secs(30), "the simulated VM never booted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = app.state.flintlock.exec(&sim, uid, "exit-three", Duration::from_secs(5)).await.unwrap();
    assert_eq!(out.exit_code, 3);
    app.sim.set_guest_agent_delay(Duration::from_secs(600));
    assert!(!app.state.flintlock.wait_ready(&sim, uid, Duration::from_secs(2)).await.unwrap());
    assert_eq!(errors(SIM_HOST, "ExecCommand"), 0.0);

    // A failure on a live host is counted under its method.
    let err = app.state.flintlock.exec(&sim, UNKNOWN, "true", Duration::from_secs(5)).await;
    assert!(err.is_err(), "{err:?}");
    assert_eq!(errors(SIM_HOST, "ExecCommand"), 1.0);
    app.sim.set_unavailable(true);
    assert!(app.state.flintlock.get(&sim, UNKNOWN).await.is_err());
    assert_eq!(errors(SIM_HOST, "GetMicroVM"), 1.0);
}

// /livez, /readyz and /healthz

async fn probe(app: &TestApp, path: &str) -> TestResponse {
    app.request(Method::GET, path, None, None, &[]).await
}

#[tokio::test]
async fn readyz_and_healthz_need_the_database_to_carry_this_binarys_newest_migration() {
    let app = TestApp::spawn().await;
    for path in ["/livez", "/readyz", "/healthz"] {
        let r = probe(&app, path).await;
        assert_eq!((r.status.as_u16(), &r.body), (200, &json!({"status": "ok"})), "{path}");
    }
    let unready = |r: TestResponse, says: &str| {
        r.assert_error(503, "UNAVAILABLE");
        assert_eq!(r.headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        let message = r.body["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains(says), "{message:?} should say {says:?}");
    };
    let sql = |s: &'static str| {
        let app = &app;
        async move { app.conn().await.batch_execute(s).await.unwrap() }
    };

    // A newer build migrated the database after this process connected.
    sql("INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
         VALUES (9999, 'from_the_future', '2030-01-01T00:00:00Z', '0')")
    .await;
    unready(probe(&app, "/readyz").await, "Deploy the newer binaries");
    unready(probe(&app, "/healthz").await, "Deploy the newer binaries");
    assert_eq!(probe(&app, "/livez").await.status.as_u16(), 200, "liveness never asks the database");
    sql("DELETE FROM refinery_schema_history WHERE version = 9999").await;
    assert_eq!(probe(&app, "/readyz").await.status.as_u16(), 200);

    // The newest migration rolled back: the database is behind this binary.
    sql("CREATE TABLE saved_history AS SELECT * FROM refinery_schema_history
         WHERE version = (SELECT max(version) FROM refinery_schema_history);
         DELETE FROM refinery_schema_history WHERE version = (SELECT version FROM saved_history)")
    .await;
    unready(probe(&app, "/readyz").await, "run the migrate step");
    sql("INSERT INTO refinery_schema_history SELECT * FROM saved_history").await;
    assert_eq!(probe(&app, "/readyz").await.status.as_u16(), 200);

    // Same version, another migration: a different build.
    sql("UPDATE refinery_schema_history SET checksum = '12345'
         WHERE version = (SELECT version FROM saved_history)")
    .await;
    unready(probe(&app, "/readyz").await, "a different build of poolmgr migrated it");
    unready(probe(&app, "/healthz").await, "a different build of poolmgr migrated it");
    sql("UPDATE refinery_schema_history h SET checksum = s.checksum FROM saved_history s WHERE h.version = s.version")
        .await;
    assert_eq!(probe(&app, "/readyz").await.status.as_u16(), 200);
}

#[tokio::test]
async fn livez_answers_without_a_database_and_readyz_does_not() {
    let port = unused_port();
    let env = [
        ("DATABASE_URL".to_owned(), format!("postgres://postgres@127.0.0.1:{port}/poolmgr")),
        ("POOLMGR_ADMIN_TOKENS".to_owned(), format!("admin:{ADMIN}")),
        ("POOLMGR_DB_CONNECT_TIMEOUT_SECONDS".to_owned(), "2".to_owned()),
    ];
    let cfg = poolmgr_core::Config::from_lookup(|k| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()))
        .expect("config");
    let state = poolmgr_core::AppState::new(&cfg, poolmgr_core::db::pool_from_config(&cfg).unwrap());
    let router = poolmgr_core::http::router(state);
    let get = |path: &'static str| {
        let router = router.clone();
        async move {
            use http_body_util::BodyExt;
            use tower::ServiceExt;
            let req = axum::http::Request::get(path).body(axum::body::Body::empty()).unwrap();
            let resp = router.oneshot(req).await.unwrap();
            let status = resp.status().as_u16();
            let body: Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
            (status, body)
        }
    };
    assert_eq!(get("/livez").await, (200, json!({"status": "ok"})));
    for path in ["/readyz", "/healthz"] {
        let (status, body) = get(path).await;
        assert_eq!((status, &body["error"]["status"]), (503, &json!("UNAVAILABLE")), "{path}: {body}");
    }
}

const FROM_THE_FUTURE: &str = "INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
     VALUES (9999, 'from_the_future', '2030-01-01T00:00:00Z', '0')";

/// An app whose probes answer from a cache kept `seconds`.
async fn with_health_cache(seconds: &str) -> TestApp {
    let seconds = seconds.to_owned();
    TestApp::spawn_with(move |env| env.push(("POOLMGR_HEALTH_CACHE_SECONDS".into(), seconds.clone()))).await
}

#[tokio::test]
async fn readyz_and_healthz_answer_from_a_short_cache_of_the_last_check_success_or_failure() {
    // A success is kept: the schema changes, and within the period the probes do not ask.
    let app = with_health_cache("60").await;
    assert_eq!(probe(&app, "/readyz").await.status.as_u16(), 200);
    app.conn().await.batch_execute(FROM_THE_FUTURE).await.unwrap();
    assert_eq!(probe(&app, "/readyz").await.status.as_u16(), 200, "answered from the cache");
    assert_eq!(probe(&app, "/healthz").await.status.as_u16(), 200, "one cache for both probes");

    // A failure is kept too: a flood of probes against a broken database asks it once.
    let app = with_health_cache("60").await;
    app.conn().await.batch_execute(FROM_THE_FUTURE).await.unwrap();
    probe(&app, "/readyz").await.assert_error(503, "UNAVAILABLE");
    app.conn().await.batch_execute("DELETE FROM refinery_schema_history WHERE version = 9999").await.unwrap();
    let r = probe(&app, "/healthz").await;
    r.assert_error(503, "UNAVAILABLE");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("Deploy the newer binaries"), "{}", r.body);

    // Past the period the next probe checks again.
    let app = with_health_cache("1").await;
    assert_eq!(probe(&app, "/readyz").await.status.as_u16(), 200);
    app.conn().await.batch_execute(FROM_THE_FUTURE).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    probe(&app, "/readyz").await.assert_error(503, "UNAVAILABLE");
}

#[tokio::test]
async fn concurrent_probes_wait_for_one_check_instead_of_each_asking_the_database() {
    // No statement timeout: the held check must wait as long as this test takes.
    let app = std::sync::Arc::new(
        TestApp::spawn_with(|env| {
            env.push(("POOLMGR_HEALTH_CACHE_SECONDS".into(), "60".into()));
            env.push(("POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS".into(), "0".into()));
        })
        .await,
    );
    // Hold the check on a lock: every probe that starts its own check would wait on it too.
    let mut locker = app.db.client().await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE refinery_schema_history IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let probes: Vec<_> = (0..20)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { probe(&app, if i % 2 == 0 { "/readyz" } else { "/healthz" }).await })
        })
        .collect();
    let waiting = || async {
        app.conn()
            .await
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%refinery_schema_history%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let mut n = waiting().await;
    for _ in 0..200 {
        if n > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        n = waiting().await;
    }
    assert_eq!(n, 1, "one check reached the database");
    // Give the other probes every chance to start a check of their own.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(waiting().await, 1, "the other 19 probes wait for that check");
    tx.rollback().await.unwrap();
    for p in probes {
        assert_eq!(p.await.unwrap().status.as_u16(), 200);
    }
}
