//! Issue 25 item 2: client scopes and live-lease quotas (`/v1/principals/{name}`), changed
//! without a redeploy, enforced on claims and demand hints, under concurrency.

use std::sync::Arc;

use poolmgr_tests::*;
use serde_json::{Value, json};
use tokio::sync::Barrier;

/// Both claim paths: the one-statement claim (`POOLMGR_CLAIM_VERIFY=off`) and the two-phase
/// one (the default, which checks the VM with its host first).
async fn apps() -> Vec<(&'static str, TestApp)> {
    vec![
        ("one statement", TestApp::spawn_with(|env| env.push(("POOLMGR_CLAIM_VERIFY".into(), "off".into()))).await),
        ("two-phase", TestApp::spawn().await),
    ]
}

async fn create_pool_in(app: &TestApp, namespace: &str, name: &str, size: i32) {
    let mut spec = pool_spec(name, size);
    spec["namespace"] = json!(namespace);
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
}

async fn claim_in(app: &TestApp, token: &str, namespace: &str, name: &str, rid: Option<&str>) -> TestResponse {
    let mut body = json!({"pool": {"namespace": namespace, "name": name}});
    if let Some(r) = rid {
        body["request_id"] = json!(r);
    }
    app.post(token, "/v1/claims", body).await
}

/// An error answer without its per-request correlation id, to compare two answers.
fn without_request_id(r: &TestResponse, replace: &str) -> (u16, String) {
    let mut body = r.body.clone();
    if let Some(e) = body["error"].as_object_mut() {
        e.remove("request_id");
    }
    (r.status.as_u16(), body.to_string().replace(replace, "POOL"))
}

#[tokio::test]
async fn a_scoped_client_claims_only_from_its_pools_and_others_look_unknown() {
    let app = TestApp::spawn().await;
    create_pool_in(&app, "team-a", "ci", 2).await;
    create_pool_in(&app, "team-b", "ci", 2).await;
    app.create_pool("ci", 2).await;
    // seed_available seeds default/ pools only: mark team pools' VMs through the pass.
    app.seed_available("ci", 2).await;
    app.pass().await;
    app.pass().await;

    let set = app.put(ADMIN, "/v1/principals/client-a", json!({"pools": ["team-a/*"]})).await;
    let body = set.assert_ok(201).clone();
    assert_eq!(body["pools"], json!(["team-a/*"]));
    assert_eq!(body["max_live_leases"], Value::Null);
    assert_eq!(body["updated_by"], json!("admin"));

    // Out of scope: exactly what an unknown pool answers, for a pool that exists.
    let theirs = claim_in(&app, CLIENT_A, "team-b", "ci", None).await;
    let nobodys = claim_in(&app, CLIENT_A, "team-b", "nope", None).await;
    theirs.assert_reason(404, "NOT_FOUND", "NOT_FOUND");
    assert_eq!(without_request_id(&theirs, "team-b/ci"), without_request_id(&nobodys, "team-b/nope"));
    let default = app.claim(CLIENT_A, "ci", None).await;
    default.assert_error(404, "NOT_FOUND");
    // A demand hint too.
    let hint = json!({"claims": 5, "within_seconds": 60});
    let theirs = app.post(CLIENT_A, "/v1/pools/team-b/ci/expect", hint.clone()).await;
    let nobodys = app.post(CLIENT_A, "/v1/pools/team-b/nope/expect", hint.clone()).await;
    theirs.assert_error(404, "NOT_FOUND");
    assert_eq!(without_request_id(&theirs, "team-b/ci"), without_request_id(&nobodys, "team-b/nope"));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0, "nothing claimed out of scope");
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM pools WHERE expected_until IS NOT NULL").await,
        0,
        "no hint recorded out of scope"
    );

    // In scope: served.
    wait_until_available(&app, "team-a", "ci").await;
    claim_in(&app, CLIENT_A, "team-a", "ci", None).await.assert_ok(200);
    app.post(CLIENT_A, "/v1/pools/team-a/ci/expect", hint).await.assert_ok(202);
    // Another client and the admin are not limited.
    app.claim(CLIENT_B, "ci", None).await.assert_ok(200);
    app.claim(ADMIN, "ci", None).await.assert_ok(200);

    // A single pool pattern; then the limits removed: every pool again.
    app.put(ADMIN, "/v1/principals/client-a", json!({"pools": ["team-b/ci"]})).await.assert_ok(200);
    wait_until_available(&app, "team-b", "ci").await;
    claim_in(&app, CLIENT_A, "team-a", "ci", None).await.assert_error(404, "NOT_FOUND");
    claim_in(&app, CLIENT_A, "team-b", "ci", None).await.assert_ok(200);
    app.delete(ADMIN, "/v1/principals/client-a").await.assert_ok(204);
    app.delete(ADMIN, "/v1/principals/client-a").await.assert_error(404, "NOT_FOUND");
    wait_until_available(&app, "team-a", "ci").await;
    claim_in(&app, CLIENT_A, "team-a", "ci", None).await.assert_ok(200);
}

/// The pass creates the team pools' VMs; the simulator boots them; a later pass marks them
/// AVAILABLE.
async fn wait_until_available(app: &TestApp, namespace: &str, name: &str) {
    for _ in 0..200 {
        let n = app
            .scalar_i64(&format!(
                "SELECT count(*) FROM vms WHERE pool_namespace = '{namespace}' AND pool_name = '{name}' AND phase = 'AVAILABLE'"
            ))
            .await;
        if n > 0 {
            return;
        }
        app.pass().await;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("no AVAILABLE VM in {namespace}/{name}");
}

#[tokio::test]
async fn a_scope_changed_in_the_database_applies_without_a_restart() {
    // No cache: another instance's change (here, straight in the table) applies at once.
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS".into(), "0".into()))).await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 2).await;
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    app.conn()
        .await
        .batch_execute(
            "INSERT INTO principal_limits (principal, pools, updated_by) VALUES ('client-a', '{other/*}', 'x')",
        )
        .await
        .unwrap();
    app.claim(CLIENT_A, "ci", None).await.assert_error(404, "NOT_FOUND");
    app.conn().await.batch_execute("UPDATE principal_limits SET pools = '{default/ci}'").await.unwrap();
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
}

#[tokio::test]
async fn concurrent_claims_never_exceed_the_quota_on_either_claim_path() {
    for (path, app) in apps().await {
        let app = Arc::new(app);
        app.create_pool("ci", 20).await;
        app.seed_available("ci", 20).await;
        app.put(ADMIN, "/v1/principals/client-a", json!({"max_live_leases": 3})).await.assert_ok(201);

        let barrier = Arc::new(Barrier::new(24));
        let tasks: Vec<_> = (0..24)
            .map(|i| {
                let (app, barrier) = (app.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    // Half with a request_id, half without.
                    let rid = format!("r-{i}");
                    app.claim(CLIENT_A, "ci", (i % 2 == 0).then_some(rid.as_str())).await
                })
            })
            .collect();
        let (mut ok, mut over) = (0, 0);
        for t in tasks {
            let r = t.await.unwrap();
            match r.status.as_u16() {
                200 => ok += 1,
                429 => {
                    r.assert_reason(429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED");
                    let m = r.body["error"]["message"].as_str().unwrap();
                    assert!(m.contains("quota") && m.contains("client-a"), "{path}: {m}");
                    assert!(r.headers.contains_key("retry-after"), "{path}");
                    over += 1;
                }
                other => panic!("{path}: unexpected {other}: {}", r.body),
            }
        }
        assert_eq!((ok, over), (3, 21), "{path}");
        assert_eq!(app.scalar_i64("SELECT count(*) FROM leases WHERE principal = 'client-a'").await, 3, "{path}");
        assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await, 17, "{path}");
        // Quota refusals are not the pool's demand.
        assert_eq!(app.scalar_i64("SELECT count(*) FROM pool_refused_claims").await, 0, "{path}");
        // Another principal is not limited by client-a's quota.
        app.claim(CLIENT_B, "ci", None).await.assert_ok(200);

        // The GET shows what the quota counts.
        let got = app.get(VIEWER, "/v1/principals/client-a").await;
        assert_eq!(got.assert_ok(200)["live_leases"], json!(3), "{path}");
        let list = app.get(VIEWER, "/v1/principals").await;
        assert_eq!(list.assert_ok(200)["principals"][0]["principal"], json!("client-a"), "{path}");
    }
}

#[tokio::test]
async fn at_the_quota_a_replay_still_answers_and_a_release_frees_a_slot() {
    for (path, app) in apps().await {
        app.create_pool("ci", 4).await;
        app.seed_available("ci", 4).await;
        app.put(ADMIN, "/v1/principals/client-a", json!({"max_live_leases": 1})).await.assert_ok(201);
        let first = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
        // A retry of the claim that holds the slot replays its lease.
        let again = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
        assert!(again.replayed, "{path}");
        assert_eq!(again.lease.lease_id, first.lease.lease_id, "{path}");
        app.claim(CLIENT_A, "ci", Some("r-2")).await.assert_reason(429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED");
        app.claim(CLIENT_A, "ci", None).await.assert_reason(429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED");
        app.release(CLIENT_A, &first.lease.lease_id).await.assert_ok(204);
        app.claimed(CLIENT_A, "ci", Some("r-2")).await;
        // A quota of 0 stops the principal; raising it lets it claim again, no restart.
        app.put(ADMIN, "/v1/principals/client-a", json!({"max_live_leases": 0})).await.assert_ok(200);
        app.claim(CLIENT_A, "ci", None).await.assert_reason(429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED");
        app.put(ADMIN, "/v1/principals/client-a", json!({"max_live_leases": 2})).await.assert_ok(200);
        app.claimed(CLIENT_A, "ci", None).await;
    }
}

#[tokio::test]
async fn limits_are_admin_writes_with_validated_bodies() {
    let app = TestApp::spawn().await;
    for token in [CLIENT_A, VIEWER] {
        app.put(token, "/v1/principals/client-a", json!({"max_live_leases": 1}))
            .await
            .assert_error(403, "PERMISSION_DENIED");
        app.delete(token, "/v1/principals/client-a").await.assert_error(403, "PERMISSION_DENIED");
    }
    app.get(CLIENT_A, "/v1/principals").await.assert_error(403, "PERMISSION_DENIED");
    for (body, needle) in [
        (json!({"pools": ["team-a"]}), "pools"),
        (json!({"pools": ["Team/*"]}), "pools"),
        (json!({"pools": ["a/b/c"]}), "pools"),
        (json!({"max_live_leases": -1}), "max_live_leases"),
        (json!({"max_live_leases": "3"}), "invalid type"),
        (json!({"quota": 3}), "quota"),
        (json!([]), ""),
    ] {
        let r = app.put(ADMIN, "/v1/principals/client-a", body.clone()).await;
        r.assert_error(400, "INVALID_ARGUMENT");
        assert!(r.body["error"]["message"].as_str().unwrap().contains(needle), "{body}: {}", r.body);
    }
    let r = app.put(ADMIN, "/v1/principals/bad%20name", json!({})).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    let too_many: Vec<String> = (0..101).map(|i| format!("ns-{i}/*")).collect();
    app.put(ADMIN, "/v1/principals/client-a", json!({"pools": too_many})).await.assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM principal_limits").await, 0, "nothing written");
    app.get(ADMIN, "/v1/principals/client-a").await.assert_error(404, "NOT_FOUND");
}
