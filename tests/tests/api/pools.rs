//! Pools (`/v1/pools…`): create, get, list, update with live status, and delete (drain) —
//! including the race between a non-force delete and claims.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use poolmgr_core::api::{self, ClaimResponse};
use poolmgr_core::domain::{HookFailurePolicy, Phase, PoolSpec, Replenishment, Strategy};
use poolmgr_core::reconcile::{PassReport, ReconcileError};
use poolmgr_core::store::PoolStatus;
use poolmgr_core::template::{IfaceType, NetworkInterface};
use poolmgr_tests::*;
use serde_json::{Value, json};
use tokio::sync::Barrier;

fn zero_status() -> PoolStatus {
    PoolStatus { available: 0, claiming: 0, leased: 0, provisioning: 0, quarantined: 0, deleting: 0 }
}

fn releases_metric(pool: &str, reason: &str) -> String {
    format!("poolmgr_vm_releases_total{{pool_name=\"{pool}\",pool_namespace=\"default\",reason=\"{reason}\"}}")
}

async fn pool_rows(app: &TestApp) -> i64 {
    app.scalar_i64("SELECT count(*) FROM pools").await
}

/// Every VM row of the pool: (id, phase).
async fn vm_phases(app: &TestApp, pool: &str) -> Vec<(String, String)> {
    app.conn()
        .await
        .query("SELECT id, phase FROM vms WHERE pool_name = $1 ORDER BY id", &[&pool])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn sim_state(app: &TestApp, uid: &str) -> Option<i32> {
    app.sim.vm(uid).map(|vm| vm.status.as_ref().map(|s| s.state).unwrap_or_default())
}

/// The flintlock record is gone, or on its way out.
#[track_caller]
fn assert_deleted_in_sim(app: &TestApp, uid: &str) {
    if let Some(state) = sim_state(app, uid) {
        assert_eq!(state, MicroVmState::Deleting as i32, "flintlock VM {uid} still exists and is not DELETING");
    }
}

#[track_caller]
fn assert_alive_in_sim(app: &TestApp, uid: &str) {
    let state = sim_state(app, uid).unwrap_or_else(|| panic!("flintlock VM {uid} is gone"));
    assert_ne!(state, MicroVmState::Deleting as i32, "flintlock VM {uid} is DELETING");
}

// ---------------------------------------------------------------------------------------
// Create
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn create_returns_201_with_zero_status_and_defaults_filled_in() {
    let app = TestApp::spawn().await;
    let minimal = json!({
        "name": "ci",
        "size": 3,
        "flintlock_hosts": [SIM_HOST],
        "replenishment": {"strategy": "REPLACE_ON_DELETE"},
        "microvm_template": template(),
    });
    let r = app.post(ADMIN, "/v1/pools", minimal).await;
    let b = r.assert_ok(201);
    let keys: HashSet<&str> = b.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, HashSet::from(["spec", "revision", "status", "created_at", "updated_at"]), "{b}");
    assert_eq!(b["revision"], json!(1));
    assert_eq!(b["status"]["rollout"], json!(null), "no rollout ever ran");
    // The typed read also parses created_at and updated_at as RFC 3339 and checks that the
    // defaulted lists are on the wire (`[]`, not absent).
    let p: api::Pool = r.json();
    assert_eq!(p.status.counts, zero_status());
    let s = &p.spec;
    assert_eq!(s.namespace, "default");
    assert_eq!(s.name, "ci");
    assert_eq!(s.size, 3);
    assert_eq!(s.flintlock_hosts, [SIM_HOST]);
    assert_eq!(s.replenishment.strategy, Strategy::ReplaceOnDelete);
    assert_eq!(s.hook_failure_policy, HookFailurePolicy::DeleteAndReplace);
    assert_eq!(s.heartbeat_interval_seconds, 30);
    assert_eq!(s.heartbeat_expiry_seconds, 120);
    assert_eq!(s.create_commands, Vec::<String>::new());
    assert_eq!(s.pre_lease_commands, Vec::<String>::new());
    assert_eq!(
        s.microvm_template.interfaces,
        [NetworkInterface { device_id: "eth1".into(), kind: IfaceType::Tap, ..Default::default() }]
    );
    assert_eq!(
        s.microvm_template.kernel.as_ref().map(|k| k.image.as_str()),
        Some("ghcr.io/liquidmetal-dev/kernel:6.1")
    );
    // Stored as returned.
    assert_eq!(app.get_pool("ci").await, p);
    assert_eq!(pool_rows(&app).await, 1);
    // No VM exists until the reconciler provisions.
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 0);
}

#[tokio::test]
async fn create_keeps_every_given_field() {
    let app = TestApp::spawn().await;
    let spec = json!({
        "namespace": "team-a",
        "name": "big",
        "size": 10,
        "flintlock_hosts": [SIM_HOST],
        "replenishment": {"strategy": "MIN_SIZE_THRESHOLD", "min_size": 4},
        "microvm_template": template(),
        // Empty: pools with hook commands are refused while hooks cannot run.
        "create_commands": [],
        "pre_lease_commands": [],
        "hook_failure_policy": "QUARANTINE",
        "heartbeat_interval_seconds": 10,
        "heartbeat_expiry_seconds": 10
    });
    let given: PoolSpec = serde_json::from_value(spec.clone()).unwrap();
    let b = app.created_pool(spec).await;
    // Every field but the template comes back as given.
    assert_eq!(PoolSpec { microvm_template: given.microvm_template.clone(), ..b.spec }, given);
    app.get(ADMIN, "/v1/pools/team-a/big").await.assert_ok(200);
    app.get(ADMIN, "/v1/pools/default/big").await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn create_of_an_existing_pool_is_already_exists_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let first = app.create_pool("ci", 3).await;
    app.post(ADMIN, "/v1/pools", pool_spec("ci", 7)).await.assert_error(409, "ALREADY_EXISTS");
    assert_eq!(app.get_pool("ci").await, first);
    // The same name in another namespace is another pool.
    let mut other_ns = pool_spec("ci", 1);
    other_ns["namespace"] = json!("team-a");
    app.post(ADMIN, "/v1/pools", other_ns).await.assert_ok(201);
    assert_eq!(pool_rows(&app).await, 2);
}

fn invalid_specs() -> Vec<(&'static str, Value)> {
    let base = pool_spec("ci", 3);
    let with = |f: &dyn Fn(&mut Value)| {
        let mut s = base.clone();
        f(&mut s);
        s
    };
    vec![
        ("size -1", with(&|s| s["size"] = json!(-1))),
        ("size 10001", with(&|s| s["size"] = json!(10001))),
        ("size not a number", with(&|s| s["size"] = json!("3"))),
        ("size missing", with(&|s| drop(s.as_object_mut().unwrap().remove("size")))),
        ("name missing", with(&|s| drop(s.as_object_mut().unwrap().remove("name")))),
        (
            "min size threshold without min_size",
            with(&|s| s["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD"})),
        ),
        (
            "min size threshold with min_size 0",
            with(&|s| s["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD", "min_size": 0})),
        ),
        (
            "min size threshold with min_size above size",
            with(&|s| s["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD", "min_size": 4})),
        ),
        (
            "min_size with REPLACE_ON_DELETE",
            with(&|s| s["replenishment"] = json!({"strategy": "REPLACE_ON_DELETE", "min_size": 1})),
        ),
        (
            "min_size with IMMEDIATE_ON_LEASE",
            with(&|s| s["replenishment"] = json!({"strategy": "IMMEDIATE_ON_LEASE", "min_size": 1})),
        ),
        ("unknown strategy", with(&|s| s["replenishment"] = json!({"strategy": "SOMETIMES"}))),
        ("lowercase strategy", with(&|s| s["replenishment"] = json!({"strategy": "replace_on_delete"}))),
        ("replenishment missing", with(&|s| drop(s.as_object_mut().unwrap().remove("replenishment")))),
        ("unknown hook policy", with(&|s| s["hook_failure_policy"] = json!("IGNORE"))),
        ("expiry below interval", with(&|s| s["heartbeat_expiry_seconds"] = json!(29))),
        ("expiry 0", with(&|s| s["heartbeat_expiry_seconds"] = json!(0))),
        ("interval 0", with(&|s| s["heartbeat_interval_seconds"] = json!(0))),
        ("uppercase name", with(&|s| s["name"] = json!("CI"))),
        ("name with leading dash", with(&|s| s["name"] = json!("-ci"))),
        ("name with trailing dash", with(&|s| s["name"] = json!("ci-"))),
        ("name with underscore", with(&|s| s["name"] = json!("c_i"))),
        ("name with slash", with(&|s| s["name"] = json!("c/i"))),
        ("empty name", with(&|s| s["name"] = json!(""))),
        ("name of 64 characters", with(&|s| s["name"] = json!("a".repeat(64)))),
        ("uppercase namespace", with(&|s| s["namespace"] = json!("Default"))),
        ("empty namespace", with(&|s| s["namespace"] = json!(""))),
        ("unknown top-level field", with(&|s| s["colour"] = json!("blue"))),
        ("unknown template field", with(&|s| s["microvm_template"]["colour"] = json!("blue"))),
        ("template id is owned by poolmgr", with(&|s| s["microvm_template"]["id"] = json!("x"))),
        ("template without interfaces", with(&|s| s["microvm_template"]["interfaces"] = json!([]))),
        (
            "template with interfaces missing",
            with(&|s| drop(s["microvm_template"].as_object_mut().unwrap().remove("interfaces"))),
        ),
        (
            "MACVTAP interface on firecracker",
            with(&|s| s["microvm_template"]["interfaces"] = json!([{"device_id": "eth1", "type": "MACVTAP"}])),
        ),
        ("vcpu 65", with(&|s| s["microvm_template"]["vcpu"] = json!(65))),
        ("vcpu 0", with(&|s| s["microvm_template"]["vcpu"] = json!(0))),
        ("template missing", with(&|s| drop(s.as_object_mut().unwrap().remove("microvm_template")))),
        ("host listed twice", with(&|s| s["flintlock_hosts"] = json!([SIM_HOST, SIM_HOST]))),
        ("empty create command", with(&|s| s["create_commands"] = json!(["  "]))),
    ]
}

#[tokio::test]
async fn invalid_pool_specs_are_invalid_argument_and_create_nothing() {
    let app = TestApp::spawn().await;
    for (case, spec) in invalid_specs() {
        let r = app.post(ADMIN, "/v1/pools", spec).await;
        assert_eq!(r.status.as_u16(), 400, "{case}: {}", r.body);
        assert_eq!(r.error_status(), "INVALID_ARGUMENT", "{case}: {}", r.body);
        r.assert_error(400, "INVALID_ARGUMENT");
    }
    assert_eq!(pool_rows(&app).await, 0);
    // Not JSON at all.
    let req = axum::http::Request::builder()
        .method("POST")
        .uri("/v1/pools")
        .header("authorization", format!("Bearer {ADMIN}"))
        .header("content-type", "application/json")
        .body(axum::body::Body::from("{\"name\": "))
        .unwrap();
    app.send(req).await.assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(pool_rows(&app).await, 0);
}

#[tokio::test]
async fn invalid_pool_specs_are_invalid_argument_on_update_and_change_nothing() {
    let app = TestApp::spawn().await;
    let before = app.create_pool("ci", 3).await;
    for (case, spec) in invalid_specs() {
        // Cases that rename the pool are a mismatch with the path: also INVALID_ARGUMENT.
        let r = app.put(ADMIN, "/v1/pools/default/ci", spec).await;
        assert_eq!(r.status.as_u16(), 400, "{case}: {}", r.body);
        assert_eq!(r.error_status(), "INVALID_ARGUMENT", "{case}: {}", r.body);
    }
    assert_eq!(app.get_pool("ci").await, before);
}

#[tokio::test]
async fn boundary_values_are_accepted() {
    let app = TestApp::spawn().await;
    let mut cases = Vec::new();
    let mut s = pool_spec("zero", 0);
    cases.push(s.clone());
    s = pool_spec("max", 10000);
    cases.push(s.clone());
    s = pool_spec("min-eq-size", 3);
    s["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD", "min_size": 3});
    cases.push(s.clone());
    s = pool_spec("min-one", 3);
    s["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD", "min_size": 1});
    cases.push(s.clone());
    s = pool_spec("expiry-eq-interval", 1);
    s["heartbeat_interval_seconds"] = json!(1);
    s["heartbeat_expiry_seconds"] = json!(1);
    cases.push(s.clone());
    s = pool_spec("vcpu-64", 1);
    s["microvm_template"]["vcpu"] = json!(64);
    cases.push(s.clone());
    s = pool_spec(&"a".repeat(63), 1);
    cases.push(s.clone());
    s = pool_spec("no-hosts", 1);
    s["flintlock_hosts"] = json!([]);
    cases.push(s.clone());
    s = pool_spec("immediate", 1);
    s["replenishment"] = json!({"strategy": "IMMEDIATE_ON_LEASE"});
    cases.push(s);
    let n = cases.len() as i64;
    for spec in cases {
        let name = spec["name"].as_str().unwrap().to_owned();
        assert_eq!(app.created_pool(spec).await.spec.name, name);
    }
    assert_eq!(pool_rows(&app).await, n);
}

#[tokio::test]
async fn pool_on_an_unregistered_host_is_failed_precondition() {
    let app = TestApp::spawn().await;
    let mut spec = pool_spec("ci", 1);
    spec["flintlock_hosts"] = json!([SIM_HOST, "nowhere"]);
    let r = app.post(ADMIN, "/v1/pools", spec.clone()).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("nowhere"), "names the host: {}", r.body);
    assert_eq!(pool_rows(&app).await, 0);

    // The same on update.
    let before = app.create_pool("ci", 1).await;
    app.put(ADMIN, "/v1/pools/default/ci", spec).await.assert_error(400, "FAILED_PRECONDITION");
    assert_eq!(app.get_pool("ci").await, before);
}

// ---------------------------------------------------------------------------------------
// Get and list
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn get_pool_is_200_for_a_known_pool_and_404_otherwise() {
    let app = TestApp::spawn().await;
    let created = app.create_pool("ci", 2).await;
    assert_eq!(app.get_pool("ci").await, created);
    app.get(ADMIN, "/v1/pools/default/nope").await.assert_error(404, "NOT_FOUND");
    app.get(ADMIN, "/v1/pools/other/ci").await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn list_pools_returns_all_or_one_namespace() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.create_pool("build", 2).await;
    let mut team = pool_spec("ci", 3);
    team["namespace"] = json!("team-a");
    app.post(ADMIN, "/v1/pools", team).await.assert_ok(201);

    let names =
        |pools: &[api::Pool]| -> HashSet<String> { pools.iter().map(|p| p.spec.pool_ref().to_string()).collect() };
    let all = app.list_pools("").await;
    assert_eq!(names(&all), HashSet::from(["default/ci".into(), "default/build".into(), "team-a/ci".into()]));
    assert_eq!(all.len(), 3);
    for p in &all {
        assert_eq!(p.status.counts, zero_status());
    }
    let team = app.list_pools("namespace=team-a").await;
    assert_eq!(names(&team), HashSet::from(["team-a/ci".into()]));
    assert_eq!(team[0].spec.size, 3);
    let default = app.list_pools("namespace=default").await;
    assert_eq!(names(&default), HashSet::from(["default/ci".into(), "default/build".into()]));
    // The typed read checks the body is exactly {"pools": []}.
    assert_eq!(app.list_pools("namespace=nobody").await, []);
}

#[tokio::test]
async fn list_pools_of_an_empty_system_is_an_empty_list() {
    let app = TestApp::spawn().await;
    assert_eq!(app.list_pools("").await, []);
}

// ---------------------------------------------------------------------------------------
// Update and live status
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn status_counts_every_phase_live() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 10).await;
    app.seed_available("ci", 3).await;
    // One real lease: LEASED with a lease row.
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    // Being claimed: PRE_LEASE_HOOK_RUNNING, or LEASED without a lease row.
    app.seed_vm("ci", Phase::PreLeaseHookRunning).await;
    app.seed_vm("ci", Phase::Leased).await;
    app.seed_vm("ci", Phase::Provisioning).await;
    app.seed_vm("ci", Phase::CreateHookRunning).await;
    app.seed_vm("ci", Phase::CreateHookRunning).await;
    app.seed_vm("ci", Phase::Quarantined).await;
    app.seed_vm("ci", Phase::Deleting).await;
    app.seed_vm("ci", Phase::Deleting).await;
    app.seed_vm("ci", Phase::Failed).await;
    // Another pool's VMs do not count.
    app.create_pool("other", 1).await;
    app.seed_available("other", 1).await;
    let expected = PoolStatus { available: 2, claiming: 2, leased: 1, provisioning: 3, quarantined: 1, deleting: 2 };

    assert_eq!(app.get_pool("ci").await.status.counts, expected);
    let listed = app.list_pools("namespace=default").await;
    let ci = listed.iter().find(|p| p.spec.name == "ci").unwrap();
    assert_eq!(ci.status.counts, expected);

    let mut spec = pool_spec("ci", 20);
    spec["heartbeat_expiry_seconds"] = json!(300);
    let b = app.updated_pool("ci", spec).await;
    assert_eq!(b.status.counts, expected, "PUT answers with the live status");
    assert_eq!(b.spec.size, 20);
    assert_eq!(b.spec.heartbeat_expiry_seconds, 300);
    assert_eq!(app.get_pool("ci").await.spec, b.spec);
}

#[tokio::test]
async fn update_replaces_the_spec_and_bumps_updated_at() {
    let app = TestApp::spawn().await;
    let before = app.create_pool("ci", 3).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut spec = pool_spec("ci", 5);
    spec["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD", "min_size": 2});
    spec["hook_failure_policy"] = json!("QUARANTINE");
    spec["heartbeat_interval_seconds"] = json!(60);
    spec["heartbeat_expiry_seconds"] = json!(600);
    let b = app.updated_pool("ci", spec).await;
    assert_eq!(b.spec.size, 5);
    assert_eq!(b.spec.replenishment, Replenishment { strategy: Strategy::MinSizeThreshold, min_size: Some(2) });
    assert_eq!(b.spec.hook_failure_policy, HookFailurePolicy::Quarantine);
    assert_eq!(b.spec.heartbeat_interval_seconds, 60);
    assert_eq!(b.spec.heartbeat_expiry_seconds, 600);
    assert_eq!(b.status.counts, zero_status());
    assert_eq!(b.created_at, before.created_at);
    let (old, new) = (before.updated_at, b.updated_at);
    assert!(new > old, "updated_at moves: {old} → {new}");

    // Omitted optional fields are reset to their defaults: the body is the whole spec.
    let minimal = json!({
        "name": "ci",
        "size": 5,
        "flintlock_hosts": [SIM_HOST],
        "replenishment": {"strategy": "REPLACE_ON_DELETE"},
        "microvm_template": template(),
    });
    let b = app.updated_pool("ci", minimal).await;
    assert_eq!(b.spec.hook_failure_policy, HookFailurePolicy::DeleteAndReplace);
    assert_eq!(b.spec.replenishment, Replenishment { strategy: Strategy::ReplaceOnDelete, min_size: None });
    assert_eq!(b.spec.heartbeat_interval_seconds, 30);
    assert_eq!(b.spec.heartbeat_expiry_seconds, 120);
}

#[tokio::test]
async fn update_with_a_body_naming_another_pool_is_invalid_argument() {
    let app = TestApp::spawn().await;
    let before = app.create_pool("ci", 3).await;
    app.create_pool("other", 1).await;
    app.put(ADMIN, "/v1/pools/default/ci", pool_spec("other", 7)).await.assert_error(400, "INVALID_ARGUMENT");
    let mut ns = pool_spec("ci", 7);
    ns["namespace"] = json!("team-a");
    app.put(ADMIN, "/v1/pools/default/ci", ns).await.assert_error(400, "INVALID_ARGUMENT");
    // The namespace defaults to "default" in the body, so a PUT on another namespace's path
    // without one is a mismatch too.
    let mut no_ns = pool_spec("ci", 7);
    no_ns.as_object_mut().unwrap().remove("namespace");
    app.put(ADMIN, "/v1/pools/team-a/ci", no_ns).await.assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(app.get_pool("ci").await, before);
    assert_eq!(app.get_pool("other").await.spec.size, 1);
}

#[tokio::test]
async fn update_of_an_unknown_pool_is_not_found_and_creates_nothing() {
    let app = TestApp::spawn().await;
    app.put(ADMIN, "/v1/pools/default/ci", pool_spec("ci", 3)).await.assert_error(404, "NOT_FOUND");
    assert_eq!(pool_rows(&app).await, 0);
}

// ---------------------------------------------------------------------------------------
// Delete (drain)
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn delete_removes_the_pool_and_deletes_every_vm() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 4).await;
    let mut vms = app.seed_available("ci", 2).await;
    vms.push(app.seed_vm("ci", Phase::Quarantined).await);
    vms.push(app.seed_vm("ci", Phase::Provisioning).await);
    app.create_pool("other", 1).await;
    let bystander = app.seed_vm("other", Phase::Available).await;

    let r = app.delete(ADMIN, "/v1/pools/default/ci").await;
    r.assert_ok(204);
    assert_eq!(r.body, Value::Null);
    app.get(ADMIN, "/v1/pools/default/ci").await.assert_error(404, "NOT_FOUND");
    assert_eq!(vm_phases(&app, "ci").await, vec![], "every VM row removed once flintlock confirmed");
    for vm in &vms {
        assert_deleted_in_sim(&app, vm.uid.as_deref().unwrap());
    }
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_DELETE), 4);
    // One VM_DELETED_ON_POOL_DELETE per VM, none for a lease.
    assert_eq!(app.count_events("VM_DELETED_ON_POOL_DELETE").await, 4);
    let evs: HashSet<String> = app
        .conn()
        .await
        .query("SELECT vm_id FROM events WHERE type = 'VM_DELETED_ON_POOL_DELETE' AND pool_name = 'ci'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(evs, vms.iter().map(|v| v.id.clone()).collect());
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 0);
    assert_eq!(app.metric(&releases_metric("ci", "pool_delete")), 0.0, "no lease was ended");
    // The other pool is untouched.
    assert_eq!(app.phase_of(&bystander.id).await.as_deref(), Some("AVAILABLE"));
    assert_alive_in_sim(&app, bystander.uid.as_deref().unwrap());
    app.get(ADMIN, "/v1/pools/default/other").await.assert_ok(200);
    // A second delete: the pool is gone.
    app.delete(ADMIN, "/v1/pools/default/ci").await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn delete_of_an_empty_pool_is_204() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    app.delete(ADMIN, "/v1/pools/default/ci?force=false").await.assert_ok(204);
    assert_eq!(pool_rows(&app).await, 0);
    // Only the admin's changes: no VM event.
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM events WHERE type NOT IN ('POOL_CREATED', 'POOL_DELETED')").await,
        0
    );
    assert_eq!(app.scalar_i64("SELECT count(*) FROM events WHERE type = 'POOL_DELETED'").await, 1);
}

#[tokio::test]
async fn delete_with_a_leased_vm_without_force_is_refused_and_changes_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.seed_available("ci", 3).await;
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let lease_id = claim.lease.lease_id.clone();
    let phases = vm_phases(&app, "ci").await;
    let events = app.scalar_i64("SELECT count(*) FROM events").await;
    let pool_before = app.get_pool("ci").await;

    for path in ["/v1/pools/default/ci", "/v1/pools/default/ci?force=false"] {
        let r = app.delete(ADMIN, path).await;
        r.assert_error(400, "FAILED_PRECONDITION");
        assert!(r.body["error"]["message"].as_str().unwrap().contains("force"), "{}", r.body);
    }

    assert_eq!(app.get_pool("ci").await, pool_before, "pool unchanged");
    assert_eq!(vm_phases(&app, "ci").await, phases, "every VM in its phase");
    assert_eq!(app.get_lease(CLIENT_A, &lease_id).await, claim.lease);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM events").await, events, "no event");
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_DELETE), 0, "no flintlock delete");
    for vm in app.sim.vms() {
        assert_alive_in_sim(&app, vm.spec.as_ref().unwrap().uid.as_deref().unwrap());
    }
    // The lease still works.
    app.heartbeat(CLIENT_A, &lease_id).await.assert_ok(200);
    assert!(app.claimed(CLIENT_A, "ci", Some("r-1")).await.replayed);
}

/// Reference §4.6: a VM in its pre-lease hook is being leased, so it blocks a plain delete.
#[tokio::test]
async fn delete_with_a_vm_being_claimed_without_force_is_refused() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    let claiming = app.seed_vm("ci", Phase::PreLeaseHookRunning).await;
    let available = app.seed_vm("ci", Phase::Available).await;
    app.delete(ADMIN, "/v1/pools/default/ci").await.assert_error(400, "FAILED_PRECONDITION");
    app.get(ADMIN, "/v1/pools/default/ci").await.assert_ok(200);
    assert_eq!(app.phase_of(&claiming.id).await.as_deref(), Some("PRE_LEASE_HOOK_RUNNING"));
    assert_eq!(app.phase_of(&available.id).await.as_deref(), Some("AVAILABLE"));
}

#[tokio::test]
async fn force_delete_ends_the_leases_and_deletes_every_vm() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    let vms = app.seed_available("ci", 3).await;
    let a = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let b = app.claimed(CLIENT_B, "ci", None).await;
    let leased: HashSet<String> = [a.lease.lease_id, b.lease.lease_id].into();

    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);

    app.get(ADMIN, "/v1/pools/default/ci").await.assert_error(404, "NOT_FOUND");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0, "leases removed");
    assert_eq!(vm_phases(&app, "ci").await, vec![], "VM rows removed");
    for vm in &vms {
        assert_deleted_in_sim(&app, vm.uid.as_deref().unwrap());
    }
    assert_eq!(app.count_events("VM_DELETED_ON_POOL_DELETE").await, 3);
    // The events of the leased VMs name their lease.
    let with_lease: HashSet<String> = app
        .conn()
        .await
        .query("SELECT lease_id FROM events WHERE type = 'VM_DELETED_ON_POOL_DELETE' AND lease_id IS NOT NULL", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(with_lease, leased);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 0, "not a release");
    assert_eq!(app.metric(&releases_metric("ci", "pool_delete")), 2.0);
    assert_eq!(app.metric(&releases_metric("ci", "api")), 0.0);
    // The holders find out on their next call.
    for lease_id in &leased {
        app.heartbeat(CLIENT_A, lease_id).await.assert_error(404, "NOT_FOUND");
        app.release(CLIENT_A, lease_id).await.assert_error(404, "NOT_FOUND");
    }
}

#[tokio::test]
async fn delete_with_flintlock_failing_is_204_and_leaves_vms_deleting_for_the_reconciler() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    let vms = app.seed_available("ci", 2).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    app.sim.fail_deletes(u32::MAX);

    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);

    app.get(ADMIN, "/v1/pools/default/ci").await.assert_error(404, "NOT_FOUND");
    let phases = vm_phases(&app, "ci").await;
    assert_eq!(phases.len(), 2, "rows kept for the reconciler: {phases:?}");
    assert!(phases.iter().all(|(_, p)| p == "DELETING"), "{phases:?}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE lease_id IS NOT NULL").await, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0, "leases removed at once");
    assert_eq!(app.count_events("VM_DELETED_ON_POOL_DELETE").await, 2);
    assert_eq!(app.metric(&releases_metric("ci", "pool_delete")), 1.0);
    assert!(app.sim.calls(flintlock_sim::METHOD_DELETE) >= 2, "each VM's delete was tried");
    for vm in &vms {
        assert_alive_in_sim(&app, vm.uid.as_deref().unwrap());
    }
    app.heartbeat(CLIENT_A, &claim.lease.lease_id).await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn delete_with_flintlock_failing_once_deletes_the_rest() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.seed_available("ci", 3).await;
    app.sim.fail_deletes(1);

    app.delete(ADMIN, "/v1/pools/default/ci").await.assert_ok(204);

    let phases = vm_phases(&app, "ci").await;
    assert_eq!(phases.len(), 1, "only the failed delete is left: {phases:?}");
    assert_eq!(phases[0].1, "DELETING");
    assert_eq!(app.count_events("VM_DELETED_ON_POOL_DELETE").await, 3);
}

#[tokio::test]
async fn delete_of_an_unknown_pool_is_not_found() {
    let app = TestApp::spawn().await;
    app.delete(ADMIN, "/v1/pools/default/nope").await.assert_error(404, "NOT_FOUND");
    app.delete(ADMIN, "/v1/pools/default/nope?force=true").await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn delete_with_an_invalid_force_is_invalid_argument_and_deletes_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    for q in ["force=maybe", "force=1", "force=", "colour=red"] {
        let r = app.delete(ADMIN, &format!("/v1/pools/default/ci?{q}")).await;
        assert_eq!(r.status.as_u16(), 400, "{q}: {}", r.body);
        r.assert_error(400, "INVALID_ARGUMENT");
    }
    app.get(ADMIN, "/v1/pools/default/ci").await.assert_ok(200);
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"));
}

#[tokio::test]
async fn pool_routes_need_an_admin_token() {
    let app = TestApp::spawn().await;
    let before = app.create_pool("ci", 1).await;
    let routes: Vec<(axum::http::Method, &str, Option<Value>)> = vec![
        (axum::http::Method::POST, "/v1/pools", Some(pool_spec("new", 1))),
        (axum::http::Method::GET, "/v1/pools", None),
        (axum::http::Method::GET, "/v1/pools/default/ci", None),
        (axum::http::Method::PUT, "/v1/pools/default/ci", Some(pool_spec("ci", 9))),
        (axum::http::Method::DELETE, "/v1/pools/default/ci?force=true", None),
    ];
    for (method, path, body) in routes {
        for client in [CLIENT_A, CLIENT_B] {
            app.request(method.clone(), path, Some(client), body.clone(), &[])
                .await
                .assert_error(403, "PERMISSION_DENIED");
        }
        app.request(method.clone(), path, None, body.clone(), &[]).await.assert_error(401, "UNAUTHENTICATED");
        app.request(method, path, Some("nope"), body, &[]).await.assert_error(401, "UNAUTHENTICATED");
    }
    assert_eq!(app.get_pool("ci").await, before);
    assert_eq!(pool_rows(&app).await, 1);
}

// ---------------------------------------------------------------------------------------
// Race: claims against a non-force delete
// ---------------------------------------------------------------------------------------

/// 16 claims race one non-force delete, several rounds. Either the delete is refused (the
/// pool stays, with every successful claim's lease) or it wins (the pool is gone, no claim
/// succeeded and no lease is left); in every case every lease row's VM is LEASED.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_racing_a_non_force_delete_never_leave_a_lease_on_a_deleted_vm() {
    let app = Arc::new(TestApp::spawn().await);
    let (mut refused, mut deleted) = (0, 0);
    for round in 0..8u64 {
        let name = format!("race-{round}");
        app.create_pool(&name, 20).await;
        app.seed_available(&name, 20).await;
        let barrier = Arc::new(Barrier::new(17));
        let claims: Vec<_> = (0..16)
            .map(|i| {
                let (app, barrier, name) = (app.clone(), barrier.clone(), name.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    // Spread the claims over a few milliseconds; even rounds give the delete
                    // a head start, odd rounds the claims, so both outcomes happen.
                    let head_start = if round % 2 == 0 { 2 * round + 2 } else { 0 };
                    tokio::time::sleep(Duration::from_millis(head_start + i % 4)).await;
                    app.claim(CLIENT_A, &name, None).await
                })
            })
            .collect();
        let delete = {
            let (app, barrier, name) = (app.clone(), barrier.clone(), name.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let head_start = if round % 2 == 1 { round } else { 0 };
                tokio::time::sleep(Duration::from_millis(head_start)).await;
                let r = app.delete(ADMIN, &format!("/v1/pools/default/{name}")).await;
                (r.status.as_u16(), r.body)
            })
        };
        let mut won = Vec::new();
        for t in claims {
            let r = t.await.unwrap();
            let body = &r.body;
            match r.status.as_u16() {
                200 => won.push(r.json::<ClaimResponse>().lease.lease_id),
                // The pool was gone, or every VM was locked by the delete.
                404 => assert_eq!(body["error"]["status"], json!("NOT_FOUND"), "{body}"),
                429 => assert_eq!(body["error"]["status"], json!("RESOURCE_EXHAUSTED"), "{body}"),
                other => panic!("unexpected claim {other}: {body}"),
            }
        }
        let (status, body) = delete.await.unwrap();
        let leases_of_pool: i64 = app
            .conn()
            .await
            .query_one("SELECT count(*) FROM leases WHERE pool_name = $1", &[&name])
            .await
            .unwrap()
            .get(0);
        match status {
            204 => {
                deleted += 1;
                assert!(won.is_empty(), "round {round}: the delete went through after claims {won:?} succeeded");
                app.get(ADMIN, &format!("/v1/pools/default/{name}")).await.assert_error(404, "NOT_FOUND");
                assert_eq!(leases_of_pool, 0, "round {round}");
                let live: i64 = app
                    .conn()
                    .await
                    .query_one("SELECT count(*) FROM vms WHERE pool_name = $1 AND phase <> 'DELETING'", &[&name])
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(live, 0, "round {round}: every VM of the deleted pool is DELETING or gone");
            }
            400 => {
                refused += 1;
                assert_eq!(body["error"]["status"], json!("FAILED_PRECONDITION"), "{body}");
                assert!(!won.is_empty(), "round {round}: refused without any lease");
                app.get(ADMIN, &format!("/v1/pools/default/{name}")).await.assert_ok(200);
                assert_eq!(leases_of_pool, won.len() as i64, "round {round}");
                for lease_id in &won {
                    app.get(CLIENT_A, &format!("/v1/leases/{lease_id}")).await.assert_ok(200);
                }
                let deleting: i64 = app
                    .conn()
                    .await
                    .query_one("SELECT count(*) FROM vms WHERE pool_name = $1 AND phase = 'DELETING'", &[&name])
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(deleting, 0, "round {round}: a refused delete marks nothing");
            }
            other => panic!("unexpected delete {other}: {body}"),
        }
        // The invariant, across every pool: a lease always points at a LEASED VM.
        let bad = app
            .scalar_i64(
                "SELECT count(*) FROM leases l LEFT JOIN vms v ON v.id = l.vm_id
                 WHERE v.id IS NULL OR v.phase <> 'LEASED' OR v.lease_id IS DISTINCT FROM l.lease_id",
            )
            .await;
        assert_eq!(bad, 0, "round {round}: a lease points at a VM that is not LEASED by it");
    }
    eprintln!("non-force delete vs claims: {deleted} deleted, {refused} refused");
}

/// A force delete racing the lease holders' releases and heartbeats: nobody sees a server
/// error, and afterwards the pool, its leases and its VMs are all gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn releases_and_heartbeats_racing_a_force_delete_never_fail() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 8).await;
    let vms = app.seed_available("ci", 8).await;
    let mut leases = Vec::new();
    for _ in 0..6 {
        leases.push(app.claimed(CLIENT_A, "ci", None).await.lease.lease_id);
    }
    let barrier = Arc::new(Barrier::new(2 * leases.len() + 1));
    let mut holders = Vec::new();
    for lease_id in &leases {
        for release in [true, false] {
            let (app, barrier, lease_id) = (app.clone(), barrier.clone(), lease_id.clone());
            holders.push(tokio::spawn(async move {
                barrier.wait().await;
                let r = if release {
                    app.release(CLIENT_A, &lease_id).await
                } else {
                    app.heartbeat(CLIENT_A, &lease_id).await
                };
                (release, r.status.as_u16(), r.body)
            }));
        }
    }
    let delete = {
        let (app, barrier) = (app.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let r = app.delete(ADMIN, "/v1/pools/default/ci?force=true").await;
            (r.status.as_u16(), r.body)
        })
    };
    let (status, body) = delete.await.unwrap();
    assert_eq!(status, 204, "{body}");
    for h in holders {
        let (release, status, body) = h.await.unwrap();
        match (release, status) {
            (true, 204) | (false, 200) => {}
            (_, 404) => assert_eq!(body["error"]["status"], json!("NOT_FOUND"), "{body}"),
            _ => panic!("unexpected {} {status}: {body}", if release { "release" } else { "heartbeat" }),
        }
    }
    app.get(ADMIN, "/v1/pools/default/ci").await.assert_error(404, "NOT_FOUND");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(vm_phases(&app, "ci").await, vec![], "every VM row removed");
    for vm in &vms {
        assert_deleted_in_sim(&app, vm.uid.as_deref().unwrap());
    }
    // Each lease ended once: by its release or by the pool delete.
    let ended = app.metric(&releases_metric("ci", "api")) + app.metric(&releases_metric("ci", "pool_delete"));
    assert_eq!(ended, leases.len() as f64);
}

/// The one definition of a pool's VM counts by phase (`store::vm_counts_for_pool`; the pool
/// status, the gauges and `poolmgr-check` share its SQL): every phase lands in its bucket, and
/// a LEASED VM counts as leased only once its lease row exists (before that it is claiming).
#[tokio::test]
async fn vm_counts_sort_every_phase_as_the_strategies_count_them() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    for phase in Phase::ALL {
        app.seed_vm("ci", *phase).await;
    }
    app.seed_vm("ci", Phase::Available).await;
    // One of the two AVAILABLE VMs becomes LEASED with its lease row.
    app.claimed(CLIENT_A, "ci", None).await;

    let counts = poolmgr_core::store::vm_counts_for_pool(&**app.conn().await, &pool("ci")).await.unwrap();
    assert_eq!(
        counts,
        poolmgr_core::domain::VmCounts {
            available: 1,
            claiming: 2,
            leased: 1,
            provisioning: 2,
            quarantined: 1,
            deleting: 1,
            rows: 9,
        }
    );
    let status = app.get(ADMIN, "/v1/pools/default/ci").await.assert_ok(200)["status"].clone();
    assert_eq!(
        status,
        json!({"available": 1, "claiming": 2, "leased": 1, "provisioning": 2, "quarantined": 1, "deleting": 1,
               "desired_size": 0, "autoscaling": null, "rollout": null})
    );
}

// ---------------------------------------------------------------------------------------
// A forced delete against the expiry sweep (issue 14 item 10)
// ---------------------------------------------------------------------------------------

/// Waits until `n` lock requests of the test database's sessions wait (not granted).
async fn wait_for_lock_waiters(app: &TestApp, n: i64) {
    let sql = format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE NOT l.granted AND a.datname = '{}'",
        app.db.name
    );
    for _ in 0..500 {
        if app.scalar_i64(&sql).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{n} lock waiters never appeared");
}

/// A session of the test's own holding `lease_id`'s row (`FOR UPDATE`) until it sends
/// `ROLLBACK`: whatever locks the lease next waits there, holding what it locked before.
async fn hold_lease_row(app: &TestApp, lease_id: &str) -> tokio_postgres::Client {
    let holder = app.db.client().await;
    holder.batch_execute("BEGIN").await.unwrap();
    holder.execute("SELECT 1 FROM leases WHERE lease_id = $1 FOR UPDATE", &[&lease_id]).await.unwrap();
    holder
}

/// Asserts that another session (`who`) holds `vm_id`'s row: a `NOWAIT` lock on it fails.
async fn assert_vm_row_locked(app: &TestApp, vm_id: &str, who: &str) {
    let probe = app.db.client().await;
    let err = probe
        .query("SELECT 1 FROM vms WHERE id = $1 FOR UPDATE NOWAIT", &[&vm_id])
        .await
        .expect_err(&format!("{who} must already hold its VM"));
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE), "{err}");
}

/// A pool of one VM whose lease has expired (by the app's clock), with the lease id.
async fn pool_with_an_expired_lease(app: &TestApp) -> (String, String) {
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let lease = app.claimed(CLIENT_A, "ci", Some("r-1")).await.lease.lease_id;
    app.advance_clock(Duration::from_secs(121));
    (vm.id, lease)
}

/// A pool of one VM whose lease has expired, a session holding that lease's row
/// ([`hold_lease_row`]) and a reconcile pass started and waiting for it in the expiry sweep.
async fn a_sweep_stopped_at_a_held_lease(
    app: &TestApp,
) -> (String, tokio_postgres::Client, tokio::task::JoinHandle<Result<PassReport, ReconcileError>>) {
    let (vm_id, lease_id) = pool_with_an_expired_lease(app).await;
    let holder = hold_lease_row(app, &lease_id).await;
    let pass = {
        let state = app.state.clone();
        tokio::spawn(async move { poolmgr_core::reconcile::run_pass(&state).await })
    };
    wait_for_lock_waiters(app, 1).await;
    (vm_id, holder, pass)
}

/// Issue 14 item 10: the expiry sweep locks a lease's VM before the lease, as a forced pool
/// delete does (VM rows first, by id, then leases). Forced here: the test holds the expired
/// lease's row, so the sweep stops at it; by then it must already hold the VM row (a
/// `NOWAIT` lock on it fails). Taking the lease first and the VM second, the sweep and a
/// forced delete (VM first, lease second) deadlocked.
#[tokio::test]
async fn the_expiry_sweep_locks_the_vm_before_the_lease() {
    let app = TestApp::spawn().await;
    let (vm_id, holder, pass) = a_sweep_stopped_at_a_held_lease(&app).await;
    assert_vm_row_locked(&app, &vm_id, "the sweep waiting for the lease").await;

    holder.batch_execute("ROLLBACK").await.unwrap();
    let report = pass.await.unwrap().unwrap();
    assert_eq!(report.expired, 1);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

/// Issue 14 item 10: a forced pool delete and the expiry sweep working on the same VM and
/// lease at the same moment. Forced order: the sweep takes the expired lease's row the
/// moment the test lets it go, while the delete already waits behind it. With the sweep
/// locking lease then VM (and the delete VM then lease) this deadlocked: one of them failed.
/// Both finish now, without an error.
#[tokio::test]
async fn a_forced_pool_delete_racing_the_expiry_sweep_does_not_deadlock() {
    let app = Arc::new(TestApp::spawn().await);
    let (vm_id, holder, pass) = a_sweep_stopped_at_a_held_lease(&app).await;
    let delete = {
        let app = app.clone();
        tokio::spawn(async move { app.delete(ADMIN, "/v1/pools/default/ci?force=true").await })
    };
    wait_for_lock_waiters(&app, 2).await;
    holder.batch_execute("ROLLBACK").await.unwrap();

    let report = pass.await.unwrap().unwrap();
    let deleted = delete.await.unwrap();
    assert_eq!(deleted.status.as_u16(), 204, "{}", deleted.body);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM pools").await, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.phase_of(&vm_id).await, None, "the VM is deleted");
}

/// Issue 14 item 10: a claim that expires its request_id's dead lease (item 2) locks the
/// lease's VM before the lease too, like the sweep and a forced pool delete. Forced here as
/// for the sweep: the test holds the expired lease's row, so the retried claim stops at it;
/// by then it must already hold the VM row (a `NOWAIT` lock on it fails). Taking the lease
/// first, it could deadlock with a forced delete of the pool.
#[tokio::test]
async fn a_claim_expiring_its_dead_lease_locks_the_vm_before_the_lease() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 2).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let lease_id = app.claimed(CLIENT_A, "ci", Some("r-1")).await.lease.lease_id;
    let spare = app.seed_vm("ci", Phase::Available).await;
    app.advance_clock(Duration::from_secs(121));
    let holder = hold_lease_row(&app, &lease_id).await;

    let retry = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for_lock_waiters(&app, 1).await;
    assert_vm_row_locked(&app, &vm.id, "the claim waiting for the lease").await;

    holder.batch_execute("ROLLBACK").await.unwrap();
    let claimed: api::ClaimResponse = retry.await.unwrap().assert_ok_response(200).json();
    assert!(!claimed.replayed);
    assert_eq!(claimed.vm.id, spare.id, "a fresh VM, the dead lease's is being deleted");
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("DELETING"));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
}
