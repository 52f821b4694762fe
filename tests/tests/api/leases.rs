//! Leases: GetLease, Heartbeat, ReleaseVM and ListLeases (`/v1/leases…`), and their races.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::DateTime;
use flintlock_proto::types::micro_vm_status::MicroVmState;
use poolmgr_core::api::{ClaimResponse, HeartbeatResponse, LeaseRecord};
use poolmgr_core::domain::Phase;
use poolmgr_core::store;
use poolmgr_tests::*;
use serde_json::{Value, json};
use tokio::sync::Barrier;

const RELEASES_API: &str = "poolmgr_vm_releases_total{pool_name=\"ci\",pool_namespace=\"default\",reason=\"api\"}";

/// The (lease id, VM id, flintlock uid) of a claim.
fn ids_of(claim: &ClaimResponse) -> (String, String, String) {
    (claim.lease.lease_id.clone(), claim.vm.id.clone(), claim.vm.uid.clone())
}

async fn lease_rows(app: &TestApp, lease_id: &str) -> i64 {
    app.conn().await.query_one("SELECT count(*) FROM leases WHERE lease_id = $1", &[&lease_id]).await.unwrap().get(0)
}

async fn expires_at_in_db(app: &TestApp, lease_id: &str) -> DateTime<chrono::Utc> {
    app.conn().await.query_one("SELECT expires_at FROM leases WHERE lease_id = $1", &[&lease_id]).await.unwrap().get(0)
}

/// The flintlock record is gone, or on its way out.
#[track_caller]
fn assert_deleted_in_sim(app: &TestApp, uid: &str) {
    if let Some(vm) = app.sim.vm(uid) {
        let state = vm.status.as_ref().map(|s| s.state).unwrap_or_default();
        assert_eq!(state, MicroVmState::Deleting as i32, "flintlock VM {uid} still exists and is not DELETING");
    }
}

#[track_caller]
fn assert_alive_in_sim(app: &TestApp, uid: &str) {
    let vm = app.sim.vm(uid).unwrap_or_else(|| panic!("flintlock VM {uid} is gone"));
    let state = vm.status.as_ref().map(|s| s.state).unwrap_or_default();
    assert_ne!(state, MicroVmState::Deleting as i32, "flintlock VM {uid} is DELETING");
}

fn lease_ids(leases: &[LeaseRecord]) -> Vec<String> {
    leases.iter().map(|l| l.lease_id.clone()).collect()
}

// ---------------------------------------------------------------------------------------
// GET /v1/leases/{id}
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn get_lease_returns_the_lease_record_of_the_claim() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let lease_id = claim.lease.lease_id.clone();

    let r = app.get(CLIENT_A, &format!("/v1/leases/{lease_id}")).await;
    let b = r.assert_ok(200);
    let keys: HashSet<&str> = b.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        HashSet::from(["lease_id", "vm_uid", "pool", "claimed_at", "last_heartbeat_at", "expires_at", "request_id"]),
        "exactly the LeaseRecord fields: {b}"
    );
    let l: LeaseRecord = r.json();
    assert_eq!(l.lease_id, lease_id);
    assert_eq!(l.vm_uid, vm.uid.unwrap());
    assert_eq!(l.pool, pool("ci"));
    assert_eq!(l.request_id.as_deref(), Some("r-1"));
    assert_eq!(l, claim.lease, "the stored lease is what the claim returned");
    assert_eq!(l.claimed_at, l.last_heartbeat_at);
    assert_eq!((l.expires_at - l.claimed_at).num_seconds(), 120);
    // An admin token reads every lease (another client's answers 404: see
    // `lease_routes_answer_another_principals_lease_exactly_as_an_unknown_one`).
    assert_eq!(app.get_lease(ADMIN, &lease_id).await, l);
}

#[tokio::test]
async fn get_lease_of_a_claim_without_request_id_has_null_request_id() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let lease_id = app.claimed(CLIENT_A, "ci", None).await.lease.lease_id;
    let b = app.get(CLIENT_A, &format!("/v1/leases/{lease_id}")).await.assert_ok(200).clone();
    assert!(b.as_object().unwrap().contains_key("request_id"));
    assert_eq!(b["request_id"], Value::Null);
}

#[tokio::test]
async fn unknown_and_malformed_lease_ids_are_not_found_on_every_lease_route() {
    let app = TestApp::spawn().await;
    let unknown = "0b7c3c4e-8a3f-4a55-9d36-5f2f6c1e9a10".to_owned();
    let too_long = "a".repeat(65);
    for id in [unknown.as_str(), "not_a_lease", "bad.id", too_long.as_str(), "%20"] {
        app.get(CLIENT_A, &format!("/v1/leases/{id}")).await.assert_error(404, "NOT_FOUND");
        app.heartbeat(CLIENT_A, id).await.assert_error(404, "NOT_FOUND");
        app.release(CLIENT_A, id).await.assert_error(404, "NOT_FOUND");
    }
}

#[tokio::test]
async fn lease_routes_need_a_valid_token() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let lease_id = app.claimed(CLIENT_A, "ci", None).await.lease.lease_id;
    for (method, path) in [
        (axum::http::Method::GET, format!("/v1/leases/{lease_id}")),
        (axum::http::Method::POST, format!("/v1/leases/{lease_id}/heartbeat")),
        (axum::http::Method::DELETE, format!("/v1/leases/{lease_id}")),
        (axum::http::Method::GET, "/v1/leases".to_owned()),
    ] {
        app.request(method.clone(), &path, None, None, &[]).await.assert_error(401, "UNAUTHENTICATED");
        app.request(method, &path, Some("wrong"), None, &[]).await.assert_error(401, "UNAUTHENTICATED");
    }
    assert_eq!(lease_rows(&app, &lease_id).await, 1, "nothing happened to the lease");
}

// ---------------------------------------------------------------------------------------
// Owners: a lease id is not a capability
// ---------------------------------------------------------------------------------------

/// What a lease route answers for `lease_id`, with that id replaced by `ID` in the body: an
/// answer about one lease compared with the answer about another.
async fn answer_about(
    app: &TestApp,
    method: axum::http::Method,
    path: &str,
    token: &str,
    lease_id: &str,
) -> (u16, String) {
    let r = app.request(method, &path.replace("ID", lease_id), Some(token), None, &[]).await;
    // Each answer names its own request's correlation id; the rest must match.
    let mut body = r.body.clone();
    if let Some(e) = body["error"].as_object_mut() {
        e.remove("request_id");
    }
    (r.status.as_u16(), body.to_string().replace(lease_id, "ID"))
}

/// Issue 14 item 3: GET, heartbeat and release of another principal's lease answer 404
/// exactly as an unknown id does (status and body, so a client cannot even tell the lease
/// exists), for a lease of another client and for one an admin claimed, and touch nothing:
/// the lease keeps its deadline, the VM stays LEASED in the database and in flintlock, no
/// event or metric moves. Lease ids appear in request and access logs: they must not be a
/// capability on their own.
#[tokio::test]
async fn lease_routes_answer_another_principals_lease_exactly_as_an_unknown_one() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let of_a = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let of_admin = app.claimed(ADMIN, "ci", Some("r-1")).await;
    let unknown = "0b7c3c4e-8a3f-4a55-9d36-5f2f6c1e9a10";
    let events = app.scalar_i64("SELECT count(*) FROM events").await;

    for (owner, not_owner) in [(&of_a, CLIENT_B), (&of_admin, CLIENT_A), (&of_admin, CLIENT_B)] {
        let id = owner.lease.lease_id.as_str();
        let expires = expires_at_in_db(&app, id).await;
        for (method, path) in [
            (axum::http::Method::GET, "/v1/leases/ID"),
            (axum::http::Method::POST, "/v1/leases/ID/heartbeat"),
            (axum::http::Method::DELETE, "/v1/leases/ID"),
        ] {
            let theirs = answer_about(&app, method.clone(), path, not_owner, id).await;
            let nobodys = answer_about(&app, method.clone(), path, not_owner, unknown).await;
            assert_eq!(theirs.0, 404, "{method} {path} of another principal's lease: {}", theirs.1);
            assert_eq!(theirs, nobodys, "{method} {path}: another principal's lease answers as an unknown one");
        }
        assert_eq!(expires_at_in_db(&app, id).await, expires, "the heartbeat did not extend it");
        assert_eq!(app.phase_of(&owner.vm.id).await.as_deref(), Some("LEASED"), "the release did not start");
        assert_alive_in_sim(&app, &owner.vm.uid);
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 2);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM events").await, events, "no event");
    assert_eq!(app.metric(RELEASES_API), 0.0);

    // The owner still reaches its lease, through every route.
    assert_eq!(app.get_lease(CLIENT_A, &of_a.lease.lease_id).await.lease_id, of_a.lease.lease_id);
    app.heartbeated(CLIENT_A, &of_a.lease.lease_id).await;
    app.release(CLIENT_A, &of_a.lease.lease_id).await.assert_ok(204);
    assert_eq!(app.phase_of(&of_a.vm.id).await, None);
    assert_deleted_in_sim(&app, &of_a.vm.uid);
}

/// Issue 14 item 3: an admin token reaches every lease: GET, heartbeat and release of a
/// client's lease work as for the client itself.
#[tokio::test]
async fn an_admin_token_reaches_every_principals_lease() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let of_a = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let of_b = app.claimed(CLIENT_B, "ci", Some("r-1")).await;

    for claim in [&of_a, &of_b] {
        let id = &claim.lease.lease_id;
        assert_eq!(app.get_lease(ADMIN, id).await, claim.lease);
        let extended = app.heartbeated(ADMIN, id).await;
        assert_eq!(&extended.lease_id, id);
        assert!(extended.last_heartbeat_at >= claim.lease.last_heartbeat_at);
        assert_eq!(expires_at_in_db(&app, id).await, extended.expires_at);
        app.release(ADMIN, id).await.assert_ok(204);
        assert_eq!(lease_rows(&app, id).await, 0);
        assert_eq!(app.phase_of(&claim.vm.id).await, None);
        assert_deleted_in_sim(&app, &claim.vm.uid);
    }
    assert_eq!(app.metric(RELEASES_API), 2.0);
    // The owner sees what an unknown id gets now.
    app.get(CLIENT_A, &format!("/v1/leases/{}", of_a.lease.lease_id)).await.assert_error(404, "NOT_FOUND");
}

// ---------------------------------------------------------------------------------------
// POST /v1/leases/{id}/heartbeat
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn heartbeat_extends_the_lease_by_the_pools_current_expiry() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let lease_id = claim.lease.lease_id.clone();
    tokio::time::sleep(Duration::from_millis(30)).await;

    let before = chrono::Utc::now();
    // The helper checks the body is exactly {"lease": LeaseRecord}.
    let l = app.heartbeated(CLIENT_A, &lease_id).await;
    let after = chrono::Utc::now();
    assert_eq!(l.lease_id, lease_id);
    assert_eq!(l.claimed_at, claim.lease.claimed_at, "a heartbeat does not move claimed_at");
    assert_eq!(l.request_id.as_deref(), Some("r-1"));
    assert_eq!(l.vm_uid, claim.lease.vm_uid);
    let hb = l.last_heartbeat_at;
    assert!(hb > claim.lease.last_heartbeat_at, "last_heartbeat_at moved: {l:?}");
    assert!(hb >= before - chrono::Duration::seconds(2) && hb <= after + chrono::Duration::seconds(2), "{hb}");
    assert_eq!((l.expires_at - hb).num_seconds(), 120, "expires_at = now + 120: {l:?}");
    assert_eq!(expires_at_in_db(&app, &lease_id).await, l.expires_at);
    // GET shows the heartbeat.
    assert_eq!(app.get_lease(CLIENT_A, &lease_id).await, l);

    // UpdatePool changes the expiry: the next heartbeat uses the new value.
    let mut spec = pool_spec("ci", 1);
    spec["heartbeat_expiry_seconds"] = json!(600);
    assert_eq!(app.updated_pool("ci", spec).await.spec.heartbeat_expiry_seconds, 600);
    // The update alone does not touch the lease.
    assert_eq!(expires_at_in_db(&app, &lease_id).await, l.expires_at);

    let l2 = app.heartbeated(CLIENT_A, &lease_id).await;
    let hb2 = l2.last_heartbeat_at;
    assert!(hb2 > hb);
    assert_eq!((l2.expires_at - hb2).num_seconds(), 600, "the pool's current expiry: {l2:?}");
    assert_eq!(expires_at_in_db(&app, &lease_id).await, l2.expires_at);

    // Shorter again: a heartbeat may move expires_at backwards.
    let mut spec = pool_spec("ci", 1);
    spec["heartbeat_interval_seconds"] = json!(5);
    spec["heartbeat_expiry_seconds"] = json!(10);
    app.put(ADMIN, "/v1/pools/default/ci", spec).await.assert_ok(200);
    let l3 = app.heartbeated(CLIENT_A, &lease_id).await;
    assert_eq!((l3.expires_at - l3.last_heartbeat_at).num_seconds(), 10);
    assert!(l3.expires_at < l2.expires_at);
}

#[tokio::test]
async fn heartbeat_writes_no_event_and_keeps_the_vm_leased() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let events = app.scalar_i64("SELECT count(*) FROM events").await;
    app.heartbeat(CLIENT_A, &claim.lease.lease_id).await.assert_ok(200);
    app.heartbeat(CLIENT_A, &claim.lease.lease_id).await.assert_ok(200);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM events").await, events);
    assert_eq!(app.phase_of(&claim.vm.id).await.as_deref(), Some("LEASED"));
}

#[tokio::test]
async fn heartbeat_of_a_lease_whose_pool_was_force_deleted_is_not_found() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let lease_id = app.claimed(CLIENT_A, "ci", None).await.lease.lease_id;
    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);

    app.heartbeat(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
    app.get(CLIENT_A, &format!("/v1/leases/{lease_id}")).await.assert_error(404, "NOT_FOUND");
    app.release(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

/// Deliberately stricter than the reference (which revives an expired, unswept lease): the
/// reconciler is about to delete the VM, so the holder must claim a new one.
#[tokio::test]
async fn heartbeat_of_an_expired_lease_is_not_found_and_does_not_revive_it() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let lease_id = claim.lease.lease_id.clone();
    // The holder stopped heartbeating: 121 s on, the lease (120 s) has expired.
    app.advance_clock(Duration::from_secs(121));
    let expired_at = expires_at_in_db(&app, &lease_id).await;

    app.heartbeat(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
    assert_eq!(expires_at_in_db(&app, &lease_id).await, expired_at, "expires_at untouched");
    assert!(expired_at < app.state.clock.now(), "still expired");
    let hb: DateTime<chrono::Utc> = app
        .conn()
        .await
        .query_one("SELECT last_heartbeat_at FROM leases WHERE lease_id = $1", &[&lease_id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(hb, claim.lease.last_heartbeat_at, "last_heartbeat_at untouched");
    // A second try is no different.
    app.heartbeat(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
    assert_eq!(expires_at_in_db(&app, &lease_id).await, expired_at);
}

#[tokio::test]
async fn heartbeat_of_a_released_lease_is_not_found() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let lease_id = app.claimed(CLIENT_A, "ci", None).await.lease.lease_id;
    app.release(CLIENT_A, &lease_id).await.assert_ok(204);
    app.heartbeat(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

// ---------------------------------------------------------------------------------------
// DELETE /v1/leases/{id}
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn release_deletes_the_vm_in_flintlock_and_removes_vm_and_lease_rows() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    let vms = app.seed_available("ci", 2).await;
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let (lease_id, vm_id, uid) = ids_of(&claim);
    let other = vms.iter().find(|v| v.id != vm_id).unwrap();
    assert_alive_in_sim(&app, &uid);

    let r = app.release(CLIENT_A, &lease_id).await;
    r.assert_ok(204);
    assert_eq!(r.body, Value::Null, "204 has no body");

    assert_deleted_in_sim(&app, &uid);
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_DELETE), 1);
    assert_eq!(app.phase_of(&vm_id).await, None, "VM row removed");
    assert_eq!(lease_rows(&app, &lease_id).await, 0, "lease row removed");
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
    let ev = app
        .conn()
        .await
        .query_one(
            "SELECT pool_namespace, pool_name, vm_id, lease_id FROM events WHERE type = 'VM_DELETED_ON_RELEASE'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(ev.get::<_, String>(0), "default");
    assert_eq!(ev.get::<_, String>(1), "ci");
    assert_eq!(ev.get::<_, Option<String>>(2).as_deref(), Some(vm_id.as_str()));
    assert_eq!(ev.get::<_, Option<String>>(3).as_deref(), Some(lease_id.as_str()));
    assert_eq!(app.metric(RELEASES_API), 1.0);
    // The other VM is untouched.
    assert_eq!(app.phase_of(&other.id).await.as_deref(), Some("AVAILABLE"));
    assert_alive_in_sim(&app, other.uid.as_deref().unwrap());

    // The record vanishes from flintlock shortly after.
    for _ in 0..100 {
        if app.sim.vm(&uid).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(app.sim.vm(&uid).is_none(), "flintlock VM removed after its delete delay");

    // A second release of the same lease: NOT_FOUND, nothing recorded twice.
    app.release(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
    app.get(CLIENT_A, &format!("/v1/leases/{lease_id}")).await.assert_error(404, "NOT_FOUND");
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
    assert_eq!(app.metric(RELEASES_API), 1.0);
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_DELETE), 1);
}

#[tokio::test]
async fn release_with_flintlock_failing_is_unavailable_and_keeps_the_lease_until_a_retry_succeeds() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let (lease_id, vm_id, uid) = ids_of(&claim);

    app.sim.fail_deletes(1);
    let r = app.release(CLIENT_A, &lease_id).await;
    r.assert_error(503, "UNAVAILABLE");
    assert!(r.headers.get("retry-after").is_some(), "503 must carry Retry-After");
    assert_eq!(app.phase_of(&vm_id).await.as_deref(), Some("DELETING"));
    assert_eq!(lease_rows(&app, &lease_id).await, 1, "lease kept until the delete is confirmed");
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 0);
    assert_eq!(app.metric(RELEASES_API), 0.0);
    assert_alive_in_sim(&app, &uid);
    // The lease is still readable while its VM is DELETING.
    app.get(CLIENT_A, &format!("/v1/leases/{lease_id}")).await.assert_ok(200);

    // The client retries: now the delete goes through.
    app.release(CLIENT_A, &lease_id).await.assert_ok(204);
    assert_eq!(app.phase_of(&vm_id).await, None);
    assert_eq!(lease_rows(&app, &lease_id).await, 0);
    assert_deleted_in_sim(&app, &uid);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
    assert_eq!(app.metric(RELEASES_API), 1.0);
    app.release(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn release_of_a_vm_flintlock_already_lost_succeeds() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let (lease_id, vm_id, uid) = ids_of(&claim);
    // Someone deleted the microVM behind poolmgr's back.
    let host = store::host_get(&**app.conn().await, SIM_HOST).await.unwrap().unwrap().0;
    app.state.flintlock.delete(&host.endpoint(), &uid).await.expect("delete in the simulator");
    for _ in 0..100 {
        if app.sim.vm(&uid).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(app.sim.vm(&uid).is_none(), "the simulator lost the VM");

    app.release(CLIENT_A, &lease_id).await.assert_ok(204);
    assert_eq!(app.phase_of(&vm_id).await, None);
    assert_eq!(lease_rows(&app, &lease_id).await, 0);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
    assert_eq!(app.metric(RELEASES_API), 1.0);
}

#[tokio::test]
async fn release_with_flintlock_unreachable_is_unavailable() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let (lease_id, vm_id, uid) = ids_of(&claim);

    app.sim.set_unavailable(true);
    let r = app.release(CLIENT_A, &lease_id).await;
    r.assert_error(503, "UNAVAILABLE");
    assert!(r.headers.get("retry-after").is_some(), "503 must carry Retry-After");
    assert_eq!(app.phase_of(&vm_id).await.as_deref(), Some("DELETING"));
    assert_eq!(lease_rows(&app, &lease_id).await, 1);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 0);

    app.sim.set_unavailable(false);
    app.release(CLIENT_A, &lease_id).await.assert_ok(204);
    assert_eq!(app.phase_of(&vm_id).await, None);
    assert_eq!(lease_rows(&app, &lease_id).await, 0);
    assert_deleted_in_sim(&app, &uid);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
}

// ---------------------------------------------------------------------------------------
// GET /v1/leases
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn list_leases_is_ordered_by_lease_id_and_filters_by_pool() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.create_pool("other", 2).await;
    app.seed_available("ci", 3).await;
    app.seed_available("other", 2).await;
    let mut ci = Vec::new();
    for _ in 0..3 {
        ci.push(app.claimed(CLIENT_A, "ci", None).await);
    }
    let mut other = Vec::new();
    for _ in 0..2 {
        other.push(app.claimed(CLIENT_A, "other", None).await);
    }

    let (leases, next) = app.list_leases(ADMIN, "").await;
    assert_eq!(next, "");
    let ids = lease_ids(&leases);
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(ids, sorted, "ordered by lease_id");
    let mut expected: Vec<String> = ci.iter().chain(&other).map(|c| c.lease.lease_id.clone()).collect();
    expected.sort();
    assert_eq!(ids, expected);
    // Each entry is the stored LeaseRecord.
    for c in ci.iter().chain(&other) {
        let entry = leases.iter().find(|l| l.lease_id == c.lease.lease_id).unwrap();
        assert_eq!(entry, &c.lease);
    }

    let (leases, next) = app.list_leases(ADMIN, "namespace=default&pool=ci").await;
    let mut expected: Vec<String> = ci.iter().map(|c| c.lease.lease_id.clone()).collect();
    expected.sort();
    assert_eq!(lease_ids(&leases), expected);
    assert_eq!(next, "");

    // An unknown pool has no leases.
    // The typed read checks the body is exactly {"leases": [], "next_page_token": ""}.
    assert_eq!(app.list_leases(ADMIN, "namespace=default&pool=nope").await, (vec![], String::new()));
    // Empty values are the same as absent.
    assert_eq!(app.list_leases(ADMIN, "namespace=&pool=").await.0.len(), 5);
}

#[tokio::test]
async fn list_leases_pool_filter_needs_both_namespace_and_pool() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    app.claimed(CLIENT_A, "ci", None).await;
    for q in ["namespace=default", "pool=ci", "namespace=default&pool=", "namespace=&pool=ci"] {
        app.get(ADMIN, &format!("/v1/leases?{q}")).await.assert_error(400, "INVALID_ARGUMENT");
        app.get(CLIENT_A, &format!("/v1/leases?{q}")).await.assert_error(400, "INVALID_ARGUMENT");
    }
}

#[tokio::test]
async fn list_leases_paginates_every_lease_exactly_once() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 5).await;
    app.seed_available("ci", 5).await;
    let mut expected = Vec::new();
    for _ in 0..5 {
        expected.push(app.claimed(CLIENT_A, "ci", None).await.lease.lease_id);
    }
    expected.sort();

    let mut seen = Vec::new();
    let mut sizes = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let (leases, next) = app.list_leases(ADMIN, &format!("page_size=2&page_token={token}")).await;
        let page = lease_ids(&leases);
        sizes.push(page.len());
        seen.extend(page);
        token = next;
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(sizes, vec![2, 2, 1]);
    assert_eq!(seen, expected, "all 5, each once, in lease_id order");

    // A page that ends exactly at the last lease says there is no more.
    let (leases, next) = app.list_leases(ADMIN, "page_size=5").await;
    assert_eq!(lease_ids(&leases), expected);
    assert_eq!(next, "");
    // The pool filter paginates too.
    let (leases, token) = app.list_leases(ADMIN, "namespace=default&pool=ci&page_size=3").await;
    assert_eq!(lease_ids(&leases), expected[..3]);
    assert!(!token.is_empty());
    let (leases, next) =
        app.list_leases(ADMIN, &format!("namespace=default&pool=ci&page_size=3&page_token={token}")).await;
    assert_eq!(lease_ids(&leases), expected[3..]);
    assert_eq!(next, "");
}

#[tokio::test]
async fn list_leases_rejects_bad_page_size_and_page_token() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    app.claimed(CLIENT_A, "ci", None).await;
    for q in ["page_size=0", "page_size=1001", "page_size=-1", "page_size=abc", "page_token=!!!not-a-token!!!"] {
        app.get(ADMIN, &format!("/v1/leases?{q}")).await.assert_error(400, "INVALID_ARGUMENT");
    }
    // The bounds themselves are fine.
    for q in ["page_size=1", "page_size=1000"] {
        assert_eq!(app.list_leases(ADMIN, q).await.0.len(), 1);
    }
}

#[tokio::test]
async fn a_client_lists_only_its_own_leases_and_admin_lists_all() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 4).await;
    app.seed_available("ci", 4).await;
    let mut a: Vec<String> = Vec::new();
    for _ in 0..2 {
        a.push(app.claimed(CLIENT_A, "ci", None).await.lease.lease_id);
    }
    let b = vec![app.claimed(CLIENT_B, "ci", None).await.lease.lease_id];
    let admin = app.claimed(ADMIN, "ci", None).await.lease.lease_id;
    a.sort();

    assert_eq!(lease_ids(&app.list_leases(CLIENT_A, "").await.0), a);
    assert_eq!(lease_ids(&app.list_leases(CLIENT_B, "").await.0), b);
    assert_eq!(lease_ids(&app.list_leases(CLIENT_A, "namespace=default&pool=ci").await.0), a);
    let mut all: Vec<String> = a.iter().chain(&b).cloned().chain([admin]).collect();
    all.sort();
    assert_eq!(lease_ids(&app.list_leases(ADMIN, "").await.0), all);

    // Paging a client's list never leaks another principal's lease.
    let (first, token) = app.list_leases(CLIENT_A, "page_size=1").await;
    let (second, next) = app.list_leases(CLIENT_A, &format!("page_size=1&page_token={token}")).await;
    let mut paged = lease_ids(&first);
    paged.extend(lease_ids(&second));
    assert_eq!(paged, a);
    assert_eq!(next, "");
}

// ---------------------------------------------------------------------------------------
// Races
// ---------------------------------------------------------------------------------------

/// 16 releases of one lease at once: the VM is deleted once, the release recorded once, and no
/// caller sees a server error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_releases_of_one_lease_delete_the_vm_once() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 2).await;
    let vms = app.seed_available("ci", 2).await;
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let (lease_id, vm_id, uid) = ids_of(&claim);

    let barrier = Arc::new(Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (app, barrier, lease_id) = (app.clone(), barrier.clone(), lease_id.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = app.release(CLIENT_A, &lease_id).await;
                (r.status.as_u16(), r.body)
            })
        })
        .collect();
    let (mut no_content, mut not_found) = (0, 0);
    for t in tasks {
        let (status, body) = t.await.unwrap();
        match status {
            204 => no_content += 1,
            404 => {
                assert_eq!(body["error"]["status"], json!("NOT_FOUND"), "{body}");
                not_found += 1;
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert!(no_content >= 1, "at least one release succeeded ({no_content} × 204, {not_found} × 404)");
    assert_eq!(no_content + not_found, 16);

    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1, "the release is recorded once");
    assert_eq!(app.metric(RELEASES_API), 1.0, "the release is counted once");
    assert_eq!(app.phase_of(&vm_id).await, None);
    assert_eq!(lease_rows(&app, &lease_id).await, 0);
    assert_deleted_in_sim(&app, &uid);
    // Only the leased VM was touched.
    let other = vms.iter().find(|v| v.id != vm_id).unwrap();
    assert_eq!(app.phase_of(&other.id).await.as_deref(), Some("AVAILABLE"));
    assert_alive_in_sim(&app, other.uid.as_deref().unwrap());
    // The request_id is free again.
    assert!(!app.claimed(CLIENT_A, "ci", Some("r-1")).await.replayed);
}

/// 16 heartbeats race one release: never a server error, and the release wins in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_racing_a_release_never_fail_and_the_lease_ends() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let (lease_id, vm_id, uid) = ids_of(&claim);

    let barrier = Arc::new(Barrier::new(17));
    let release = {
        let (app, barrier, lease_id) = (app.clone(), barrier.clone(), lease_id.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let r = app.release(CLIENT_A, &lease_id).await;
            (r.status.as_u16(), r.body)
        })
    };
    let heartbeats: Vec<_> = (0..16)
        .map(|_| {
            let (app, barrier, lease_id) = (app.clone(), barrier.clone(), lease_id.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.heartbeat(CLIENT_A, &lease_id).await
            })
        })
        .collect();
    let (status, body) = release.await.unwrap();
    assert_eq!(status, 204, "{body}");
    for t in heartbeats {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            200 => assert_eq!(r.json::<HeartbeatResponse>().lease.lease_id, lease_id, "{}", r.body),
            404 => assert_eq!(r.body["error"]["status"], json!("NOT_FOUND"), "{}", r.body),
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    assert_eq!(app.phase_of(&vm_id).await, None, "VM row gone");
    assert_eq!(lease_rows(&app, &lease_id).await, 0, "lease gone");
    assert_deleted_in_sim(&app, &uid);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
    assert_eq!(app.metric(RELEASES_API), 1.0);
    app.heartbeat(CLIENT_A, &lease_id).await.assert_error(404, "NOT_FOUND");
}

/// Issue 25 item 2: a pool's `max_lease_seconds` bounds a lease's life. Heartbeats extend
/// it up to `claimed_at` + the bound and no further; past it the lease is expired like any
/// other; a bound below `heartbeat_expiry_seconds` shortens the claim's first deadline too.
/// On both claim paths (the one statement and the two-phase claim).
#[tokio::test]
async fn heartbeats_never_extend_a_lease_past_max_lease_seconds() {
    for verify in ["off", "on"] {
        let app = TestApp::spawn_with(|env| env.push(("POOLMGR_CLAIM_VERIFY".into(), verify.into()))).await;
        let mut spec = pool_spec("ci", 2);
        spec["max_lease_seconds"] = json!(200);
        let created = app.post(ADMIN, "/v1/pools", spec.clone()).await;
        assert_eq!(created.assert_ok(201)["spec"]["max_lease_seconds"], json!(200), "verify {verify}");
        app.seed_available("ci", 2).await;
        let claim = app.claimed(CLIENT_A, "ci", None).await;
        let id = claim.lease.lease_id.clone();
        let claimed_at = claim.lease.claimed_at;
        let bound = claimed_at + chrono::Duration::seconds(200);
        assert_eq!(claim.lease.expires_at, claimed_at + chrono::Duration::seconds(120), "verify {verify}");

        // 100 s on, a heartbeat would give now + 120 = claimed_at + 220: it gives the bound.
        app.advance_clock(Duration::from_secs(100));
        assert_eq!(app.heartbeated(CLIENT_A, &id).await.expires_at, bound, "verify {verify}");
        app.advance_clock(Duration::from_secs(50));
        assert_eq!(app.heartbeated(CLIENT_A, &id).await.expires_at, bound, "verify {verify}");
        assert_eq!(expires_at_in_db(&app, &id).await, bound);
        // Past the bound the lease has expired: no heartbeat revives it, the pass ends it.
        app.advance_clock(Duration::from_secs(51));
        app.heartbeat(CLIENT_A, &id).await.assert_error(404, "NOT_FOUND");
        assert_eq!(app.pass().await.expired, 1, "verify {verify}");

        // A bound below heartbeat_expiry_seconds shortens the first deadline.
        app.state.clock.reset();
        spec["max_lease_seconds"] = json!(60);
        app.put(ADMIN, "/v1/pools/default/ci", spec.clone()).await.assert_ok(200);
        let short = app.claimed(CLIENT_B, "ci", None).await;
        assert_eq!(short.lease.expires_at, short.lease.claimed_at + chrono::Duration::seconds(60), "verify {verify}");
        // Removing the bound: heartbeats extend by heartbeat_expiry_seconds again.
        spec.as_object_mut().unwrap().remove("max_lease_seconds");
        let updated = app.put(ADMIN, "/v1/pools/default/ci", spec.clone()).await;
        assert!(updated.assert_ok(200)["spec"].get("max_lease_seconds").is_none(), "{}", updated.body);
        let hb = app.heartbeated(CLIENT_B, &short.lease.lease_id).await;
        assert!(hb.expires_at > short.lease.claimed_at + chrono::Duration::seconds(60), "verify {verify}");
    }
}

#[tokio::test]
async fn max_lease_seconds_out_of_range_is_refused_and_changes_nothing() {
    let app = TestApp::spawn().await;
    for bad in [json!(0), json!(-5), json!(31_536_001)] {
        let mut spec = pool_spec("ci", 1);
        spec["max_lease_seconds"] = bad.clone();
        let r = app.post(ADMIN, "/v1/pools", spec).await;
        r.assert_error(400, "INVALID_ARGUMENT");
        assert!(r.body["error"]["message"].as_str().unwrap().contains("max_lease_seconds"), "{bad}: {}", r.body);
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM pools").await, 0);
}

/// Issue 25 item 4: the lease reads that call no flintlock — get, list, replay lookup,
/// heartbeat, and the claim itself — never load the host's credentials from the database;
/// the release, which deletes the VM through flintlock, does.
#[tokio::test]
async fn lease_reads_never_load_host_credentials_and_the_release_does() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_CLAIM_VERIFY".into(), "off".into()))).await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    app.conn()
        .await
        .execute(
            "UPDATE hosts SET basic_auth_token = 'secret-token-xyz', key_pem = 'KEY' WHERE name = $1",
            &[&SIM_HOST],
        )
        .await
        .unwrap();
    let no_credentials = |what: &str, host: Option<&store::HostRow>| {
        let h = host.unwrap_or_else(|| panic!("{what}: the lease's host"));
        assert_eq!(h.name, SIM_HOST, "{what}");
        assert_eq!((&h.basic_auth_token, &h.key_pem, &h.cert_pem, &h.ca_pem), (&None, &None, &None, &None), "{what}");
    };
    // The two-phase claim's second transaction answers with the host too.
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let id = claim.lease.lease_id.as_str();
    let conn = app.conn().await;
    no_credentials("get", store::lease_get(&**conn, id, None).await.unwrap().unwrap().host.as_ref());
    let listed = store::lease_list(&**conn, None, None, "", 10).await.unwrap();
    no_credentials("list", listed[0].host.as_ref());
    let replay = store::lease_get_by_request_id(&**conn, "client-a", "r-1").await.unwrap().unwrap();
    no_credentials("replay lookup", replay.host.as_ref());
    let hb = store::lease_heartbeat(&**conn, id, None, None).await.unwrap().unwrap();
    no_credentials("heartbeat", hb.host.as_ref());
    let found = store::claim_get_by_request_id(&**conn, "client-a", "r-1").await.unwrap();
    no_credentials("duplicate's lookup", found.existing.unwrap().host.as_ref());
    // The release calls flintlock with them.
    let released = store::lease_begin_release(&**conn, id, None).await.unwrap().unwrap();
    assert_eq!(released.host.unwrap().basic_auth_token.as_deref(), Some("secret-token-xyz"));
}
