//! Hosts' secrets encrypted at rest (issue 25 item 4, `poolmgr_core::credentials`): what the
//! database holds reveals neither a host's TLS key nor its token, the functions still reach
//! the host with them, a deployment without a key refuses new secrets, rows stored in
//! plaintext before are sealed by a pass, and a key rotation re-wraps every row without
//! losing a host write that races it.

use std::sync::Arc;
use std::time::Duration;

use flintlock_sim::{Sim, SimConfig, SimServer};
use poolmgr_core::credentials::{Keyring, Secrets};
use poolmgr_tests::*;
use serde_json::{Value, json};
use tokio::sync::Barrier;

const TOKEN: &str = "flintlock-basic-auth-xyzzy";
const NEXT_KEY: &str = "the-rotated-credentials-key-0123456789";

/// A flintlock-sim that refuses calls without `Authorization: Basic base64(token)`.
async fn authed_sim(token: &str) -> (Sim, SimServer) {
    let sim = Sim::new(SimConfig {
        boot_delay: Duration::from_millis(30),
        delete_delay: Duration::from_millis(10),
        basic_auth_token: Some(token.into()),
    });
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.expect("start flintlock-sim");
    (sim, server)
}

fn host_body(name: &str, address: &str, token: &str) -> Value {
    json!({"name": name, "address": address, "tls": {"insecure": true}, "basic_auth_token": token})
}

/// Everything the database holds about hosts and their audit events, as text: what a dump
/// or a snapshot would show.
async fn dump(app: &TestApp) -> String {
    let conn = app.conn().await;
    let rows = conn
        .query(
            "SELECT coalesce(string_agg(to_jsonb(h)::text, ' '), '') FROM hosts h
             UNION ALL SELECT coalesce(string_agg(to_jsonb(e)::text, ' '), '') FROM events e",
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join(" ")
}

async fn key_id(app: &TestApp, host: &str) -> Option<String> {
    app.conn().await.query_one("SELECT credentials_key_id FROM hosts WHERE name = $1", &[&host]).await.unwrap().get(0)
}

/// The token column as stored (a ciphertext once sealed).
async fn stored_token(app: &TestApp, host: &str) -> String {
    let row = app.conn().await.query_one("SELECT basic_auth_token FROM hosts WHERE name = $1", &[&host]).await;
    row.unwrap().get(0)
}

/// A pool of `size` on `host`, filled: every call to the host (create, get, list) went
/// through the client's channel, built from the row's sealed token.
async fn fill_on(app: &TestApp, pool: &str, host: &str, size: i32) {
    let mut spec = pool_spec(pool, size);
    spec["flintlock_hosts"] = json!([host]);
    app.created_pool(spec).await;
    app.settle(200, "pool filled on the authed host", || async {
        app.count_phase(pool, "AVAILABLE").await == i64::from(size)
    })
    .await;
}

#[tokio::test]
async fn host_secrets_are_sealed_at_rest_and_the_host_is_still_reached_with_them() {
    let app = TestApp::spawn().await;
    let (_sim, server) = authed_sim(TOKEN).await;
    app.post(ADMIN, "/v1/hosts", host_body("authed", &server.addr.to_string(), TOKEN)).await.assert_ok(201);
    let pem = |what: &str| format!("-----BEGIN {what}-----\nMIIB{what}xyzzy\n-----END {what}-----\n");
    let mtls = json!({"ca_pem": pem("CERTIFICATE"), "cert_pem": pem("CERTIFICATE"), "key_pem": pem("PRIVATE KEY")});
    app.post(ADMIN, "/v1/hosts", json!({"name": "mtls", "address": "10.0.0.6:9090", "tls": mtls})).await.assert_ok(201);

    let dumped = dump(&app).await;
    assert!(!dumped.contains(TOKEN), "the token is in the database: {dumped}");
    assert!(!dumped.contains("MIIBPRIVATE KEYxyzzy"), "the key is in the database");
    assert!(dumped.contains("MIIBCERTIFICATExyzzy"), "the public certificates stay readable");
    let current = app.state.config.credentials.current_id().map(str::to_owned);
    assert_eq!(key_id(&app, "authed").await, current);
    assert_eq!(key_id(&app, "mtls").await, current);
    // A host without secrets has nothing sealed.
    assert_eq!(key_id(&app, SIM_HOST).await, None);
    assert_eq!(app.host_secrets("mtls").await.key_pem, Some(pem("PRIVATE KEY")));

    fill_on(&app, "ci", "authed", 2).await;
    // The claim's check (a GetMicroVM) and the release's delete reach it too.
    let claimed = app.claimed(CLIENT_A, "ci", None).await;
    app.release(CLIENT_A, &claimed.lease.lease_id).await.assert_ok(204);
}

#[tokio::test]
async fn without_a_key_a_host_with_secrets_is_refused_and_nothing_changes() {
    let app = TestApp::spawn().await;
    let (_sim, server) = authed_sim(TOKEN).await;
    let address = server.addr.to_string();
    app.post(ADMIN, "/v1/hosts", host_body("sealed", &address, TOKEN)).await.assert_ok(201);
    let app = app.redeployed(|env| env.push(("POOLMGR_CREDENTIALS_KEY".into(), String::new())));
    let before = dump(&app).await;

    let r = app.post(ADMIN, "/v1/hosts", host_body("new", "127.0.0.1:9", TOKEN)).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    assert_eq!(r.body["error"]["reason"], json!("CREDENTIALS_KEY_MISSING"), "{}", r.body);
    let m = r.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("POOLMGR_CREDENTIALS_KEY") && !m.contains(TOKEN), "{m}");
    // A row sealed under a key this deployment lacks cannot be kept by a PUT without tls.
    let r = app.put(ADMIN, "/v1/hosts/sealed", json!({"address": address})).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    assert_eq!(r.body["error"]["reason"], json!("CREDENTIALS_UNREADABLE"), "{}", r.body);
    assert_eq!(dump(&app).await, before, "a refused write changes nothing");

    // A host without secrets needs no key.
    app.post(ADMIN, "/v1/hosts", json!({"name": "plain", "address": "10.0.0.9:9090", "tls": {"insecure": true}}))
        .await
        .assert_ok(201);
}

#[tokio::test]
async fn plaintext_rows_are_sealed_by_a_pass_and_a_rotation_rewraps_them_under_the_new_key() {
    let app = TestApp::spawn().await;
    let (_sim, server) = authed_sim(TOKEN).await;
    // A row as stored before encryption existed (V24 left it as it was).
    app.conn()
        .await
        .execute(
            "INSERT INTO hosts (name, address, tls_insecure, basic_auth_token) VALUES ('authed', $1, true, $2)",
            &[&server.addr.to_string(), &TOKEN],
        )
        .await
        .unwrap();
    let first_id = app.state.config.credentials.current_id().map(str::to_owned);
    // Not during the upgrade's grace (functions of the version before may still run).
    assert_eq!(app.pass().await.credentials_resealed, 0);
    assert_eq!(key_id(&app, "authed").await, None);
    app.conn().await.execute("UPDATE deployment SET seal_host_credentials_from = now()", &[]).await.unwrap();
    let report = app.pass().await;
    assert_eq!(report.credentials_resealed, 1, "{report:?}");
    assert_eq!(key_id(&app, "authed").await, first_id);
    assert!(!dump(&app).await.contains(TOKEN));
    let sealed_token = stored_token(&app, "authed").await;

    // Rotation: the new key current, the old one kept to decrypt.
    let app = app.redeployed(|env| {
        env.push(("POOLMGR_CREDENTIALS_KEY".into(), NEXT_KEY.into()));
        env.push(("POOLMGR_CREDENTIALS_OLD_KEYS".into(), CREDENTIALS_KEY.into()));
    });
    let next_id = app.state.config.credentials.current_id().map(str::to_owned);
    assert_ne!(next_id, first_id);
    assert_eq!(app.pass().await.credentials_resealed, 1);
    assert_eq!(key_id(&app, "authed").await, next_id);
    let token_now = stored_token(&app, "authed").await;
    assert_eq!(token_now, sealed_token, "envelope: only the data key is re-wrapped");
    assert_eq!(app.pass().await.credentials_resealed, 0, "nothing left to re-wrap");

    // The old key dropped: the host is reached with the new one alone.
    let app = app.redeployed(|env| env.push(("POOLMGR_CREDENTIALS_KEY".into(), NEXT_KEY.into())));
    fill_on(&app, "ci", "authed", 2).await;

    // A function left on the old key alone cannot open the row: it says which key it lacks,
    // and the host is not taken for an unreachable one.
    let app = app.redeployed(|_| {});
    let report = app.pass().await;
    let said = report.errors.join("\n");
    assert!(said.contains(next_id.as_deref().unwrap()) && said.contains("POOLMGR_CREDENTIALS_OLD_KEYS"), "{said}");
    assert!(!said.contains(NEXT_KEY) && !said.contains(CREDENTIALS_KEY) && !said.contains(TOKEN), "{said}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts WHERE unreachable_since IS NOT NULL").await, 0);
    assert_eq!(key_id(&app, "authed").await, next_id, "a row it cannot open is left as it is");
}

/// Passes re-wrapping a host's secrets race PUTs that change them: every PUT's token lands
/// with its own address (a re-wrap never writes back what it read before a PUT), and the row
/// ends under the current key. The compare-and-set itself is forced below: a re-wrap computed
/// from a row a PUT has since replaced writes nothing.
#[tokio::test]
async fn rewraps_racing_host_writes_never_bring_back_an_old_secret() {
    let app = TestApp::spawn().await;
    // Ports are never dialled: the host is only written and re-wrapped.
    app.post(ADMIN, "/v1/hosts", host_body("raced", "127.0.0.1:1000", "token-0")).await.assert_ok(201);
    let app = Arc::new(app.redeployed(|env| {
        env.push(("POOLMGR_CREDENTIALS_KEY".into(), NEXT_KEY.into()));
        env.push(("POOLMGR_CREDENTIALS_OLD_KEYS".into(), CREDENTIALS_KEY.into()));
    }));
    // A stale re-wrap, forced: read, then a PUT, then the re-wrap's write.
    let (stale, _) = poolmgr_core::store::host_get(&**app.conn().await, "raced").await.unwrap().unwrap();
    let stale = stale.stored_credentials();
    let old_keyring = Keyring::new(Some(CREDENTIALS_KEY), &[]);
    let rewrapped = app.state.config.credentials.reseal("raced", &stale).unwrap().expect("under the old key");
    app.put(ADMIN, "/v1/hosts/raced", host_body("raced", "127.0.0.1:1001", "token-1")).await.assert_ok(200);
    let wrote =
        poolmgr_core::store::host_reseal_credentials(&**app.conn().await, "raced", &stale, &rewrapped).await.unwrap();
    assert!(!wrote, "a re-wrap of a replaced row writes nothing");
    assert_eq!(app.host_secrets("raced").await.basic_auth_token.as_deref(), Some("token-1"));

    // Put the row back under the old key, then race 6 passes against 6 PUTs.
    let sealed_old = old_keyring.seal("raced", &Secrets { key_pem: None, basic_auth_token: Some("token-1".into()) });
    let sealed_old = sealed_old.unwrap();
    let current = poolmgr_core::store::host_get(&**app.conn().await, "raced").await.unwrap().unwrap().0;
    assert!(
        poolmgr_core::store::host_reseal_credentials(
            &**app.conn().await,
            "raced",
            &current.stored_credentials(),
            &sealed_old
        )
        .await
        .unwrap()
    );
    let barrier = Arc::new(Barrier::new(12));
    let mut tasks = vec![];
    for i in 0..6 {
        let (a, b) = (app.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            b.wait().await;
            a.pass().await;
        }));
        let (app, barrier) = (app.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let body = host_body("raced", &format!("127.0.0.1:{}", 2000 + i), &format!("token-{}", 2000 + i));
            app.put(ADMIN, "/v1/hosts/raced", body).await.assert_ok(200);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    app.pass().await;
    let (row, _) = poolmgr_core::store::host_get(&**app.conn().await, "raced").await.unwrap().unwrap();
    let port = row.address.rsplit_once(':').unwrap().1;
    assert_eq!(app.host_secrets("raced").await.basic_auth_token, Some(format!("token-{port}")), "the last PUT's token");
    assert_eq!(row.credentials_key_id.as_deref(), app.state.config.credentials.current_id());
}

/// A function that lacks the key a host's row names (a rotation half deployed, a lost key)
/// must not hurt the host's VMs: its passes skip the host (no call, no hook failure, no
/// quarantine, never judged unreachable) and say which key is missing; a claim whose
/// pre-lease hook cannot reach the host gives the VM back and answers 503.
#[tokio::test]
async fn a_function_without_the_rows_key_skips_the_host_and_fails_no_vm() {
    let app = TestApp::spawn().await;
    let (_sim, server) = authed_sim(TOKEN).await;
    app.post(ADMIN, "/v1/hosts", host_body("authed", &server.addr.to_string(), TOKEN)).await.assert_ok(201);
    let mut spec = pool_spec("ci", 2);
    spec["flintlock_hosts"] = json!(["authed"]);
    spec["create_commands"] = json!(["warm-up"]);
    spec["pre_lease_commands"] = json!(["reset-state"]);
    spec["hook_failure_policy"] = json!("QUARANTINE");
    app.created_pool(spec).await;
    app.settle(200, "pool filled through its create hooks", || async { app.count_phase("ci", "AVAILABLE").await == 2 })
        .await;
    // One more VM wanted, which the keyless passes must not place or step on the host.
    let mut bigger = pool_spec("ci", 3);
    bigger["flintlock_hosts"] = json!(["authed"]);
    bigger["create_commands"] = json!(["warm-up"]);
    bigger["pre_lease_commands"] = json!(["reset-state"]);
    bigger["hook_failure_policy"] = json!("QUARANTINE");
    app.put(ADMIN, "/v1/pools/default/ci", bigger).await.assert_ok(200);

    let app = app.redeployed(|env| env.push(("POOLMGR_CREDENTIALS_KEY".into(), NEXT_KEY.into())));
    for _ in 0..3 {
        let report = app.pass().await;
        let said = report.errors.join("\n");
        assert!(said.contains("authed") && said.contains("POOLMGR_CREDENTIALS_OLD_KEYS"), "{said}");
    }
    let r = app.claim(CLIENT_A, "ci", Some("no-key")).await;
    r.assert_reason(503, "UNAVAILABLE", "FLINTLOCK_UNAVAILABLE");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2, "the VM is given back");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase IN ('QUARANTINED', 'FAILED')").await, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 2, "nothing placed on a host it cannot open");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts WHERE unreachable_since IS NOT NULL").await, 0);

    // The key back: the claim and the third VM go through.
    let app = app.redeployed(|env| {
        env.push(("POOLMGR_CREDENTIALS_KEY".into(), NEXT_KEY.into()));
        env.push(("POOLMGR_CREDENTIALS_OLD_KEYS".into(), CREDENTIALS_KEY.into()));
    });
    app.claimed(CLIENT_A, "ci", Some("no-key")).await;
    app.settle(200, "the third VM", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
}
