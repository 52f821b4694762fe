//! ClaimVM (`POST /v1/claims`): every numbered semantic of the contract, and the races.

use std::sync::Arc;

use poolmgr_core::api::ClaimResponse;
use poolmgr_core::domain::Phase;
use poolmgr_core::store;
use poolmgr_tests::*;
use serde_json::json;
use tokio::sync::Barrier;
use tokio_postgres::types::Type;

#[tokio::test]
async fn claim_returns_lease_vm_and_host_from_stored_data() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let calls_before = app.sim.calls(flintlock_sim::METHOD_GET) + app.sim.calls(flintlock_sim::METHOD_LIST);

    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    let b: ClaimResponse = r.assert_ok_response(200).json();
    assert!(!b.replayed);
    assert!(r.headers.get("idempotent-replayed").is_none());
    assert_eq!(b.vm.id, vm.id);
    assert_eq!(b.vm.uid, vm.uid.clone().unwrap());
    assert_eq!(b.vm.flintlock_host.name, SIM_HOST);
    assert_eq!(b.vm.flintlock_host.address, app.sim_server.addr.to_string());
    assert_eq!(b.vm.network_interfaces["eth1"]["index"], json!(7));
    assert_eq!(b.lease.request_id.as_deref(), Some("r-1"));
    assert_eq!(b.lease.pool, pool("ci"));
    assert_eq!(b.lease.vm_uid, vm.uid.unwrap());
    let lease_id = &b.lease.lease_id;
    assert!(lease_id.len() >= 32, "lease ids must be unguessable: {lease_id}");

    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("LEASED"));
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"false\"}"),
        1.0
    );
    // One flintlock call on the claim path: the check that the VM exists (issue 23 finding
    // 1); everything the answer carries was stored at provisioning.
    let calls_after = app.sim.calls(flintlock_sim::METHOD_GET) + app.sim.calls(flintlock_sim::METHOD_LIST);
    assert_eq!(calls_before + 1, calls_after);
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_LIST), 0);
    // Expiry = claim time + the pool's heartbeat_expiry_seconds (120).
    assert_eq!((b.lease.expires_at - b.lease.claimed_at).num_seconds(), 120);
    // A replay asks nobody: the VM was checked when its lease was written.
    let again: ClaimResponse = app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_ok_response(200).json();
    assert!(again.replayed);
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_GET), calls_after);
}

/// `POOLMGR_CLAIM_VERIFY=off`: the design's one-statement claim, which calls no flintlock at
/// all, answers exactly as the checked one does.
#[tokio::test]
async fn an_unverified_claim_calls_no_flintlock_and_answers_the_same() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_CLAIM_VERIFY".into(), "off".into()))).await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let calls_before = app.sim.calls(flintlock_sim::METHOD_GET) + app.sim.calls(flintlock_sim::METHOD_LIST);
    let b: ClaimResponse = app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_ok_response(200).json();
    assert_eq!(b.vm.id, vm.id);
    assert_eq!(b.lease.request_id.as_deref(), Some("r-1"));
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("LEASED"));
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
    let calls_after = app.sim.calls(flintlock_sim::METHOD_GET) + app.sim.calls(flintlock_sim::METHOD_LIST);
    assert_eq!(calls_before, calls_after, "no flintlock call on the unverified claim path");
}

#[tokio::test]
async fn request_id_of_255_bytes_is_accepted() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let rid = "x".repeat(255);
    let b = app.claimed(CLIENT_A, "ci", Some(&rid)).await;
    assert_eq!(b.lease.request_id, Some(rid));
}

#[tokio::test]
async fn request_id_of_256_bytes_is_invalid_argument_and_claims_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    app.claim(CLIENT_A, "ci", Some(&"x".repeat(256))).await.assert_error(400, "INVALID_ARGUMENT");
    // Multi-byte characters count in bytes: 128 × 'é' is 256 bytes.
    app.claim(CLIENT_A, "ci", Some(&"é".repeat(128))).await.assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

#[tokio::test]
async fn over_long_request_id_is_checked_before_the_pool_lookup() {
    let app = TestApp::spawn().await;
    app.claim(CLIENT_A, "no-such-pool", Some(&"x".repeat(256))).await.assert_error(400, "INVALID_ARGUMENT");
}

#[tokio::test]
async fn unknown_pool_is_not_found() {
    let app = TestApp::spawn().await;
    app.claim(CLIENT_A, "nope", None).await.assert_error(404, "NOT_FOUND");
    app.claim(CLIENT_A, "nope", Some("r-1")).await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn empty_pool_is_resource_exhausted_with_retry_after() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    r.assert_error(429, "RESOURCE_EXHAUSTED");
    assert!(r.headers.get("retry-after").is_some(), "429 must carry Retry-After");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

/// The claim statement answers with its VM's host but never with the host's credentials
/// (V14): not on a claim, not on a replay. The HTTP answer still names the host and its
/// address.
#[tokio::test]
async fn the_claim_statement_answers_without_the_hosts_credentials() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let conn = app.conn().await;
    conn.batch_execute(&format!(
        "UPDATE hosts SET ca_pem = 'CA PEM', cert_pem = 'CERT PEM', key_pem = 'KEY PEM', basic_auth_token = 'TOKEN' WHERE name = '{SIM_HOST}'"
    ))
    .await
    .unwrap();
    let claim = |lease_id: &'static str| {
        let conn = &conn;
        async move {
            conn.query_one(
                "SELECT host, existing_host FROM lease_claim('default', 'ci', $1, 'r-1', 'client-a')",
                &[&lease_id],
            )
            .await
            .unwrap()
        }
    };
    let fresh = claim("11111111-1111-4111-8111-111111111111").await;
    let replayed = claim("22222222-2222-4222-8222-222222222222").await;
    let hosts: [serde_json::Value; 2] = [fresh.get("host"), replayed.get("existing_host")];
    drop(conn);
    for host in hosts {
        assert_eq!(host["name"], json!(SIM_HOST), "{host}");
        assert_eq!(host["address"], json!(app.sim_server.addr.to_string()), "{host}");
        for key in ["ca_pem", "cert_pem", "key_pem", "basic_auth_token"] {
            assert!(host.get(key).is_none(), "the claim's host carries {key}: {host}");
        }
    }
    let b = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert_eq!(b.vm.flintlock_host.address, app.sim_server.addr.to_string());
}

/// Lease ids and the `x-request-id` of a request that sent none are random version-4 UUIDs
/// (drawn from the thread's CSPRNG, not the OS per id: `domain::random_uuid`), never the same
/// twice; a caller's `x-request-id` comes back as sent.
#[tokio::test]
async fn lease_ids_and_generated_request_ids_are_distinct_random_uuids() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 40).await;
    app.seed_available("ci", 40).await;
    let v4 = regex::Regex::new("^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$").unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..40 {
        let r = app.claim(CLIENT_A, "ci", None).await;
        let request_id = r.headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let b: ClaimResponse = r.assert_ok_response(200).json();
        for id in [b.lease.lease_id, request_id] {
            assert!(v4.is_match(&id), "not a random (version 4) UUID: {id:?}");
            assert!(seen.insert(id.clone()), "{id} was handed out twice");
        }
    }
    let r = app.request(axum::http::Method::GET, "/healthz", None, None, &[("x-request-id", "trace-me-42")]).await;
    assert_eq!(r.headers.get("x-request-id").and_then(|v| v.to_str().ok()), Some("trace-me-42"));
}

#[tokio::test]
async fn replay_returns_the_identical_response_and_leaves_expiry_unchanged() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let first = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;

    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    let second: ClaimResponse = r.assert_ok_response(200).json();
    assert_eq!(r.headers.get("idempotent-replayed").and_then(|v| v.to_str().ok()), Some("true"));
    assert!(second.replayed);
    assert_eq!(second.lease, first.lease, "a replay is not a heartbeat: lease unchanged");
    assert_eq!(second.vm, first.vm);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await, 1);
    assert_eq!(app.count_events("VM_CLAIMED").await, 1, "a replay writes no event");
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"true\"}"),
        1.0
    );
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"false\"}"),
        1.0
    );
}

#[tokio::test]
async fn idempotency_key_header_is_an_alias_for_request_id() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let body = json!({"pool": {"namespace": "default", "name": "ci"}});
    let first: ClaimResponse = app
        .request(
            axum::http::Method::POST,
            "/v1/claims",
            Some(CLIENT_A),
            Some(body.clone()),
            &[("Idempotency-Key", "k-1")],
        )
        .await
        .assert_ok_response(200)
        .json();
    assert_eq!(first.lease.request_id.as_deref(), Some("k-1"));
    // The body field and the header are the same key.
    let second = app.claimed(CLIENT_A, "ci", Some("k-1")).await;
    assert!(second.replayed);
    assert_eq!(second.lease.lease_id, first.lease.lease_id);
    // Both given and equal: fine. Both given and different: refused, nothing claimed.
    let mut with_both = body.clone();
    with_both["request_id"] = json!("k-1");
    app.request(
        axum::http::Method::POST,
        "/v1/claims",
        Some(CLIENT_A),
        Some(with_both.clone()),
        &[("Idempotency-Key", "k-1")],
    )
    .await
    .assert_ok(200);
    app.request(axum::http::Method::POST, "/v1/claims", Some(CLIENT_A), Some(with_both), &[("Idempotency-Key", "k-2")])
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
}

#[tokio::test]
async fn replay_on_another_pool_is_invalid_argument_and_that_pool_keeps_its_vm() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.create_pool("other", 1).await;
    app.seed_available("ci", 1).await;
    let other_vm = app.seed_vm("other", Phase::Available).await;
    app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_ok(200);

    let r = app.claim(CLIENT_A, "other", Some("r-1")).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("default/ci") && msg.contains("default/other"), "names both pools: {msg}");
    assert_eq!(app.phase_of(&other_vm.id).await.as_deref(), Some("AVAILABLE"));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
}

#[tokio::test]
async fn request_ids_are_scoped_by_principal() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let a = app.claimed(CLIENT_A, "ci", Some("same")).await;
    let b = app.claimed(CLIENT_B, "ci", Some("same")).await;
    assert!(!b.replayed);
    assert_ne!(a.lease.lease_id, b.lease.lease_id);
    assert_ne!(a.vm.id, b.vm.id);
}

#[tokio::test]
async fn request_id_is_reusable_after_release() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let first = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    app.release(CLIENT_A, &first.lease.lease_id).await.assert_ok(204);

    let b = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(!b.replayed, "a fresh claim after the lease ended");
    assert_ne!(b.lease.lease_id, first.lease.lease_id);
    assert_ne!(b.vm.id, first.vm.id);
}

#[tokio::test]
async fn empty_request_id_claims_a_new_vm_each_time() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.seed_available("ci", 3).await;
    let mut vms = std::collections::HashSet::new();
    for rid in [Some(""), Some(""), None] {
        let b = app.claimed(CLIENT_A, "ci", rid).await;
        assert!(!b.replayed);
        assert_eq!(b.lease.request_id, None);
        vms.insert(b.vm.id);
    }
    assert_eq!(vms.len(), 3);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases WHERE request_id IS NULL").await, 3);
}

#[tokio::test]
async fn replay_with_the_vm_deleting_is_aborted() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let first = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    // A release whose flintlock delete failed leaves the VM DELETING and the lease in place.
    app.sim.fail_deletes(1);
    app.release(CLIENT_A, &first.lease.lease_id).await.assert_reason(503, "UNAVAILABLE", "CLEANUP_PENDING");
    assert_eq!(app.phase_of(&first.vm.id).await.as_deref(), Some("DELETING"));

    app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_reason(409, "ABORTED", "LEASE_ENDING");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await, 1, "nothing claimed");
}

#[tokio::test]
async fn replay_with_the_vm_row_gone_is_aborted() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let first = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    let vm_id = first.vm.id.as_str();
    app.conn().await.execute("DELETE FROM vms WHERE id = $1", &[&vm_id]).await.unwrap();

    app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_reason(409, "ABORTED", "LEASE_ENDING");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await, 1, "nothing claimed");
}

#[tokio::test]
async fn claim_needs_a_token_and_accepts_client_and_admin_roles() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let body = json!({"pool": {"namespace": "default", "name": "ci"}});
    app.request(axum::http::Method::POST, "/v1/claims", None, Some(body.clone()), &[])
        .await
        .assert_error(401, "UNAUTHENTICATED");
    app.request(axum::http::Method::POST, "/v1/claims", Some("wrong"), Some(body), &[])
        .await
        .assert_error(401, "UNAUTHENTICATED");
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    app.claim(ADMIN, "ci", None).await.assert_ok(200);
}

/// 64 claimers released at once on 20 AVAILABLE VMs: exactly 20 leases on 20 distinct VMs.
/// A claim starts its scan at a random claim slot and wraps around (V5): a VM in the lowest or
/// the highest slot is found whatever slot the scan starts at. Twelve claims per slot make a
/// start on either side of the VM all but certain (a start at 0 has odds 1/64 per claim).
#[tokio::test]
async fn a_claim_finds_the_only_vm_whatever_its_claim_slot() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_available("ci", 1).await.remove(0);
    for slot in [0i16, 63] {
        app.conn().await.execute("UPDATE vms SET claim_slot = $1 WHERE id = $2", &[&slot, &vm.id]).await.unwrap();
        for i in 0..12 {
            let r = app.claim(CLIENT_A, "ci", None).await;
            assert_eq!(r.status, 200, "slot {slot}, claim {i}: {}", r.body);
            assert_eq!(r.json::<ClaimResponse>().vm.id, vm.id);
            // Back to AVAILABLE for the next claim, the way the reconciler never would but a
            // test may: drop the lease and the claim's event.
            app.conn()
                .await
                .batch_execute(&format!(
                    "DELETE FROM leases; UPDATE vms SET phase = 'AVAILABLE', lease_id = NULL WHERE id = '{}'",
                    vm.id
                ))
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_never_hand_out_a_vm_twice() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 20).await;
    app.seed_available("ci", 20).await;
    let barrier = Arc::new(Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.claim(CLIENT_A, "ci", None).await
            })
        })
        .collect();
    let mut vms = std::collections::HashSet::new();
    let (mut ok, mut exhausted) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            200 => {
                ok += 1;
                assert!(vms.insert(r.json::<ClaimResponse>().vm.id), "VM handed out twice");
            }
            429 => exhausted += 1,
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    assert_eq!((ok, exhausted), (20, 44));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 20);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'LEASED'").await, 20);
    assert_eq!(app.scalar_i64("SELECT count(DISTINCT vm_id) FROM leases").await, 20);
}

/// Backends of this test's database waiting for a lock (a row lock, or a concurrent insert of
/// the same unique key).
pub(crate) async fn lock_waiters(app: &TestApp) -> i64 {
    app.scalar_i64(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
}

/// `n` claimers of `CLIENT_A` with request_id `rid`, released at once by a barrier.
fn duplicates(app: &Arc<TestApp>, n: usize, rid: &'static str) -> Vec<tokio::task::JoinHandle<TestResponse>> {
    let barrier = Arc::new(Barrier::new(n));
    (0..n)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.claim(CLIENT_A, "ci", Some(rid)).await
            })
        })
        .collect()
}

/// 32 claimers with one request_id released at once on a pool with `vms` AVAILABLE VMs: the
/// contract's semantics 5, whatever the interleaving. Exactly one lease; every caller gets it
/// (200, never 429 — not even with a single VM, which the losers' snapshots see locked by the
/// winner); exactly one answer is the fresh claim, the other 31 are replays with
/// `Idempotent-Replayed`; the VMs the losers picked are AVAILABLE again.
async fn thirty_two_duplicates_get_one_lease(vms: usize) {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", vms as i32).await;
    app.seed_available("ci", vms).await;
    let mut lease_ids = std::collections::HashSet::new();
    let mut fresh = 0;
    for t in duplicates(&app, 32, "the-one") {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "a duplicate never answers anything but the lease: {}", r.body);
        let b: ClaimResponse = r.json();
        let header = r.headers.get("idempotent-replayed").and_then(|v| v.to_str().ok());
        assert_eq!(header, b.replayed.then_some("true"), "Idempotent-Replayed exactly on replays");
        lease_ids.insert(b.lease.lease_id);
        if !b.replayed {
            fresh += 1;
        }
    }
    assert_eq!(lease_ids.len(), 1, "every response carries the same lease");
    assert_eq!(fresh, 1, "exactly one response is the fresh claim");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(app.count_phase("ci", "LEASED").await, 1);
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, vms as i64 - 1, "every other VM still AVAILABLE");
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"true\"}"),
        31.0
    );
    assert_eq!(
        app.metric("poolmgr_vm_claim_failures_total{pool_name=\"ci\",pool_namespace=\"default\",reason=\"exhausted\"}"),
        0.0
    );
}

/// Issue 14 item 1: 32 claimers with one request_id on a pool with a single AVAILABLE VM:
/// every caller gets the winner's lease, none answers 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_with_one_request_id_on_one_vm_all_get_the_one_lease() {
    thirty_two_duplicates_get_one_lease(1).await;
}

/// Issue 14 item 1: the same with ten VMs (the losers pick VMs of their own and give them back).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_with_one_request_id_create_one_lease() {
    thirty_two_duplicates_get_one_lease(10).await;
}

/// Issue 14 item 1, the moment forced: a claim of request_id r-1 is committing (here the
/// test's own open transaction: its lease is written, its VM — the pool's only one — locked
/// and LEASED) when 12 duplicates arrive. Their snapshots cannot see that lease and SKIP
/// LOCKED skips the VM, which used to answer 429. They must wait for it and replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_of_a_claim_still_committing_wait_for_its_lease_instead_of_answering_429() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 1).await;
    let vm = app.seed_available("ci", 1).await.remove(0);
    let mut winner = app.db.client().await;
    let tx = winner.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at,
                             request_id, principal)
         VALUES ('the-winners-lease', $1, 'default', 'ci', now(), now(), now() + interval '120 seconds', 'r-1', 'client-a')",
        &[&vm.id],
    )
    .await
    .unwrap();
    tx.execute("UPDATE vms SET phase = 'LEASED', lease_id = 'the-winners-lease' WHERE id = $1", &[&vm.id])
        .await
        .unwrap();

    let tasks = duplicates(&app, 12, "r-1");
    // Every duplicate is blocked behind the winner (or, before the fix, already answered).
    for _ in 0..400 {
        if lock_waiters(&app).await == 12 || tasks.iter().all(|t| t.is_finished()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    tx.commit().await.unwrap();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let b: ClaimResponse = r.json();
        assert!(b.replayed);
        assert_eq!(b.lease.lease_id, "the-winners-lease");
        assert_eq!(b.vm.id, vm.id);
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"true\"}"),
        12.0
    );
}

/// Issue 14 item 2: a lease past its `expires_at` that the sweep has not removed yet is never
/// replayed as live. The retry with its request_id expires it — as the sweep would: lease
/// gone, VM DELETING, VM_DELETED_DUE_TO_EXPIRY — and claims a fresh VM.
#[tokio::test]
async fn a_retry_of_an_expired_lease_expires_it_and_claims_a_fresh_vm() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    let first = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    // Past expires_at (120 s), before any reconcile pass.
    app.advance_clock(std::time::Duration::from_secs(121));

    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    let second: ClaimResponse = r.assert_ok_response(200).json();
    assert!(!second.replayed, "never a replay of the dead lease: {second:?}");
    assert!(r.headers.get("idempotent-replayed").is_none());
    assert_ne!(second.lease.lease_id, first.lease.lease_id);
    assert_ne!(second.vm.id, first.vm.id);
    assert_eq!(second.lease.request_id.as_deref(), Some("r-1"));
    assert_eq!(app.phase_of(&first.vm.id).await.as_deref(), Some("DELETING"));
    assert_eq!(app.count_events("VM_DELETED_DUE_TO_EXPIRY").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_releases_total{pool_name=\"ci\",pool_namespace=\"default\",reason=\"expiry\"}"),
        1.0
    );
    app.get(CLIENT_A, &format!("/v1/leases/{}", first.lease.lease_id)).await.assert_error(404, "NOT_FOUND");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"true\"}"),
        0.0
    );
    // The new lease replays as usual (leases are written by the database's clock: back to it).
    app.reset_clock();
    let third = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(third.replayed);
    assert_eq!(third.lease, second.lease);
    // The sweep finds nothing left to expire.
    assert_eq!(app.pass().await.expired, 0);
}

/// Issue 12 section 4, the plan hazard: a claim's plans are kept per server connection
/// (PL/pgSQL's, or a prepared statement's), and a plan made right after `leases` was emptied
/// and analyzed must not scan the tables once they have grown. Here one server connection
/// makes its plans (ten claims), then `leases` is emptied and analyzed and one more claim
/// re-plans on it, then 5000 leases arrive behind the statistics' back (autovacuum off for
/// the table: nothing analyzes it again). The next claim, sent both ways a claim is sent (the
/// call prepared on the connection, and as text), counts its own sequential scans
/// (`pg_stat_xact_user_tables`): none, on any table; and the lease rows it fetched through
/// an index: none (its request_id is new). V10's replay lookup, joined to vms and hosts, read
/// every lease through leases_vm_id_key here (V12).
#[tokio::test]
async fn a_claim_planned_while_leases_was_empty_never_scans_a_table_once_it_has_grown() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 100).await;
    app.seed_available("ci", 40).await;
    let c = app.db.client().await;
    c.batch_execute("ALTER TABLE leases SET (autovacuum_enabled = false)").await.unwrap();
    let prepared = c.prepare_typed(store::LEASE_CLAIM_SQL, &[Type::TEXT; 5]).await.unwrap();
    for i in 0..10 {
        claim_sent(&c, &prepared, i, i % 2 == 0).await;
    }
    c.batch_execute("DELETE FROM leases").await.unwrap();
    c.batch_execute("VACUUM ANALYZE leases").await.unwrap();
    claim_sent(&c, &prepared, 10, true).await;
    claim_sent(&c, &prepared, 11, false).await;
    c.batch_execute(
        "INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at,
                             request_id, principal)
         SELECT 'bulk-' || g, 'bulk-vm-' || g, 'default', 'ci', now(), now(), now() + interval '1 hour',
                'bulk-' || g, 'someone-else'
         FROM generate_series(1, 5000) g",
    )
    .await
    .unwrap();
    // A backend's table counters may carry its earlier statements' scans until it flushes them
    // (the DELETE above scanned `leases`): the claim's own are the difference, read in one
    // transaction, in which nothing is flushed.
    // Per table: sequential scans, and rows fetched through an index.
    let reads = async |c: &tokio_postgres::Client| -> Vec<(String, i64, i64)> {
        c.query(
            "SELECT relname::text, seq_scan, coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables
             WHERE relname IN ('leases', 'vms', 'pools', 'hosts', 'events') ORDER BY relname",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
    };
    for (i, how_prepared) in [(12, true), (13, false)] {
        let how = if how_prepared { "prepared" } else { "as text" };
        c.batch_execute("BEGIN").await.unwrap();
        let before = reads(&c).await;
        claim_sent(&c, &prepared, i, how_prepared).await;
        let after = reads(&c).await;
        c.batch_execute("COMMIT").await.unwrap();
        assert_eq!(after.len(), 5, "{after:?}");
        let scanned: Vec<_> = before.iter().zip(&after).filter(|(b, a)| a.1 > b.1).map(|(_, a)| a.0.as_str()).collect();
        assert!(scanned.is_empty(), "a claim sent {how} scanned {scanned:?} sequentially");
        let (b, a) = before.iter().zip(&after).find(|(b, _)| b.0 == "leases").expect("leases is counted");
        assert_eq!(a.2 - b.2, 0, "a claim sent {how} with a new request_id fetched {} lease rows", a.2 - b.2);
    }
}

/// Claim number `i` of client-a on pool ci with a request_id of its own, sent as `prepared`
/// or as text (the two ways `store::lease_claim` sends it): the VM it took.
async fn claim_sent(
    c: &tokio_postgres::Client,
    prepared: &tokio_postgres::Statement,
    i: usize,
    how_prepared: bool,
) -> String {
    let (lease_id, rid) = (format!("plan-lease-{i}"), Some(format!("plan-rid-{i}")));
    let row = if how_prepared {
        c.query_one(prepared, &[&"default", &"ci", &lease_id, &rid, &"client-a"]).await
    } else {
        c.query_typed_one(
            store::LEASE_CLAIM_SQL,
            &[
                (&"default", Type::TEXT),
                (&"ci", Type::TEXT),
                (&lease_id, Type::TEXT),
                (&rid, Type::TEXT),
                (&"client-a", Type::TEXT),
            ],
        )
        .await
    };
    row.unwrap().get::<_, Option<String>>("picked").expect("the claim took a VM")
}
