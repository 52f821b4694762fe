//! Hosts (`/v1/hosts…`) and VMs (`/v1/vms…`): the admin surface over flintlock hosts and VM
//! rows. Secrets are write-only, removal is refused while anything still uses the host, and a
//! pool create racing a host removal never leaves a pool naming a missing host.

use std::sync::Arc;

use axum::http::Method;
use poolmgr_core::api::{self, HostTlsView};
use poolmgr_core::domain::{HostExec, Phase};
use poolmgr_tests::*;
use serde_json::{Value, json};
use tokio::sync::Barrier;

const CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBcaCERT\n-----END CERTIFICATE-----\n";
const CERT_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBclientCERT\n-----END CERTIFICATE-----\n";
/// The private key carries a marker that must never come back out of the API.
const KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----\nKEYMATERIALxyzzy\n-----END PRIVATE KEY-----\n";
const KEY_MARKER: &str = "KEYMATERIALxyzzy";
const TOKEN: &str = "s3cret";

fn plain_host(name: &str, address: &str) -> Value {
    json!({"name": name, "address": address, "tls": {"insecure": true}})
}

fn tls_host(name: &str, address: &str) -> Value {
    json!({
        "name": name,
        "address": address,
        "tls": {"insecure": false, "ca_pem": CA_PEM, "cert_pem": CERT_PEM, "key_pem": KEY_PEM},
        "basic_auth_token": TOKEN
    })
}

/// A pool spec on `hosts`.
fn spec_on(name: &str, hosts: &[&str]) -> Value {
    let mut s = pool_spec(name, 1);
    s["flintlock_hosts"] = json!(hosts);
    s
}

/// Row counts of every table, to prove a refused request changed nothing.
async fn counts(app: &TestApp) -> [i64; 5] {
    let mut out = [0; 5];
    for (i, t) in ["pools", "hosts", "leases", "vms", "events"].iter().enumerate() {
        out[i] = app.scalar_i64(&format!("SELECT count(*) FROM {t}")).await;
    }
    out
}

/// The full stored row of a host, secrets included, as JSON text.
async fn host_row(app: &TestApp, name: &str) -> Option<Value> {
    app.conn()
        .await
        .query_opt("SELECT to_jsonb(h) FROM hosts h WHERE name = $1", &[&name])
        .await
        .unwrap()
        .map(|r| r.get(0))
}

#[track_caller]
fn assert_no_secrets(body: &Value) {
    let text = body.to_string();
    assert!(!text.contains(TOKEN), "basic_auth_token leaked: {text}");
    assert!(!text.contains(KEY_MARKER), "key_pem leaked: {text}");
}

/// The `tls` of a host without TLS.
fn plaintext() -> HostTlsView {
    HostTlsView { insecure: true, ca_pem: None, cert_pem: None, key_pem: None }
}

// ---------------------------------------------------------------------------------------
// Create, get, list
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn create_returns_201_with_the_full_host_shape() {
    let app = TestApp::spawn().await;
    let r = app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await;
    assert_eq!(
        r.assert_ok(201),
        &json!({
            "name": "host-a",
            "address": "10.0.0.5:9090",
            "tls": {"insecure": true, "ca_pem": null, "cert_pem": null, "key_pem": null},
            "basic_auth_token": null,
            "cordoned": false,
            "cordoned_reason": null,
            "cordoned_at": null,
            "vm_count": 0,
            "exec": "auto",
            "flintlock_version": null,
            "exec_unavailable_reason": null
        })
    );
    assert_eq!(app.get_host("host-a").await, r.json::<api::Host>());
}

/// Issue 14 item 17: `exec` (`auto` by default, `enabled`, `disabled`) is written with the
/// host, stored on its row, returned in every view, and set back to `auto` by a PUT without
/// it (a PUT replaces the spec); an unknown value is refused and changes nothing.
#[tokio::test]
async fn a_hosts_exec_declaration_is_stored_returned_and_replaced_by_put() {
    let app = TestApp::spawn().await;
    let mut body = plain_host("host-a", "10.0.0.5:9090");
    body["exec"] = json!("enabled");
    let h = app.created_host(body.clone()).await;
    assert_eq!(h.exec, HostExec::Enabled);
    assert_eq!(host_row(&app, "host-a").await.unwrap()["exec"], json!("enabled"));
    assert_eq!(app.get_host("host-a").await.exec, HostExec::Enabled);
    assert!(app.list_hosts().await.iter().any(|h| h.name == "host-a" && h.exec == HostExec::Enabled));

    body["exec"] = json!("disabled");
    assert_eq!(app.updated_host("host-a", body.clone()).await.exec, HostExec::Disabled);
    assert_eq!(app.updated_host("host-a", plain_host("host-a", "10.0.0.5:9090")).await.exec, HostExec::Auto);

    let before = (host_row(&app, "host-a").await, counts(&app).await);
    for bad in [json!("on"), json!("ENABLED"), json!(true), json!(null), json!({"mode": "auto"})] {
        body["exec"] = bad.clone();
        app.put(ADMIN, "/v1/hosts/host-a", body.clone()).await.assert_error(400, "INVALID_ARGUMENT");
        let mut new = body.clone();
        new["name"] = json!("host-b");
        app.post(ADMIN, "/v1/hosts", new).await.assert_error(400, "INVALID_ARGUMENT");
    }
    assert_eq!((host_row(&app, "host-a").await, counts(&app).await), before);
}

#[tokio::test]
async fn create_with_insecure_tls_is_a_plaintext_host() {
    let app = TestApp::spawn().await;
    let b =
        app.created_host(json!({"name": "host-a", "address": "flint.example:9090", "tls": {"insecure": true}})).await;
    assert_eq!(b.tls, plaintext());
}

#[tokio::test]
async fn secrets_are_stored_but_never_returned_by_any_route() {
    let app = TestApp::spawn().await;
    // Each body is searched for the secrets as text, then read typed (which also checks the
    // write-only fields are on the wire, as null).
    let created = app.post(ADMIN, "/v1/hosts", tls_host("host-a", "10.0.0.5:9090")).await;
    assert_no_secrets(created.assert_ok(201));
    let b: api::Host = created.json();
    assert_eq!(b.basic_auth_token, None);
    assert!(!b.tls.insecure);
    assert_eq!(b.tls.key_pem, None);
    // The public parts stay visible.
    assert_eq!(b.tls.ca_pem.as_deref(), Some(CA_PEM));
    assert_eq!(b.tls.cert_pem.as_deref(), Some(CERT_PEM));

    // Stored sealed (issue 25 item 4), so flintlock calls can use them and a dump cannot.
    assert_no_secrets(&host_row(&app, "host-a").await.unwrap());
    let stored = app.host_secrets("host-a").await;
    assert_eq!((stored.basic_auth_token.as_deref(), stored.key_pem.as_deref()), (Some(TOKEN), Some(KEY_PEM)));

    assert_no_secrets(app.get(ADMIN, "/v1/hosts/host-a").await.assert_ok(200));
    let list = app.get(ADMIN, "/v1/hosts").await;
    assert_no_secrets(list.assert_ok(200));
    assert_eq!(list.json::<api::HostList>().hosts.len(), 2);
    let updated = app.put(ADMIN, "/v1/hosts/host-a", tls_host("host-a", "10.0.0.6:9090")).await;
    assert_no_secrets(updated.assert_ok(200));
    let u: api::Host = updated.json();
    assert_eq!(u.basic_auth_token, None);
    assert_eq!(u.tls.key_pem, None);
    let cordoned = app.post(ADMIN, "/v1/hosts/host-a/cordon", json!({"reason": "r"})).await;
    assert_no_secrets(cordoned.assert_ok(200));
    assert_no_secrets(app.post(ADMIN, "/v1/hosts/host-a/uncordon", json!({})).await.assert_ok(200));
    // A refused duplicate does not echo them either.
    let dup = app.post(ADMIN, "/v1/hosts", tls_host("host-a", "10.0.0.5:9090")).await;
    dup.assert_error(409, "ALREADY_EXISTS");
    assert_no_secrets(&dup.body);
}

#[tokio::test]
async fn create_of_an_existing_host_is_already_exists_and_changes_nothing() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
    let before = host_row(&app, "host-a").await;
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.9.9.9:1")).await.assert_error(409, "ALREADY_EXISTS");
    assert_eq!(host_row(&app, "host-a").await, before);
    // The harness's own host too.
    let sim_before = host_row(&app, SIM_HOST).await;
    app.post(ADMIN, "/v1/hosts", plain_host(SIM_HOST, "10.9.9.9:1")).await.assert_error(409, "ALREADY_EXISTS");
    assert_eq!(host_row(&app, SIM_HOST).await, sim_before);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts").await, 2);
}

#[tokio::test]
async fn invalid_host_specs_are_invalid_argument_and_register_nothing() {
    let app = TestApp::spawn().await;
    let before = counts(&app).await;
    let tls_ok = json!({"insecure": false, "ca_pem": CA_PEM});
    let cases: Vec<(&str, Value)> = vec![
        ("uppercase name", json!({"name": "Host-A", "address": "h:1"})),
        ("underscore in name", json!({"name": "a_b", "address": "h:1"})),
        ("name starting with '-'", json!({"name": "-a", "address": "h:1"})),
        ("name ending with '-'", json!({"name": "a-", "address": "h:1"})),
        ("empty name", json!({"name": "", "address": "h:1"})),
        ("64-character name", json!({"name": "a".repeat(64), "address": "h:1"})),
        ("missing name", json!({"address": "h:1"})),
        ("missing address", json!({"name": "host-a"})),
        ("null address", json!({"name": "host-a", "address": null})),
        ("address without port", json!({"name": "host-a", "address": "10.0.0.5"})),
        ("address with scheme", json!({"name": "host-a", "address": "http://x:1"})),
        ("address with path", json!({"name": "host-a", "address": "x:1/api"})),
        ("port 0", json!({"name": "host-a", "address": "x:0"})),
        ("port 65536", json!({"name": "host-a", "address": "x:65536"})),
        ("non-numeric port", json!({"name": "host-a", "address": "x:http"})),
        ("empty host part", json!({"name": "host-a", "address": ":9090"})),
        ("empty address", json!({"name": "host-a", "address": ""})),
        (
            "cert_pem without key_pem",
            json!({"name": "host-a", "address": "x:1", "tls": {"insecure": false, "ca_pem": CA_PEM, "cert_pem": CERT_PEM}}),
        ),
        (
            "key_pem without cert_pem",
            json!({"name": "host-a", "address": "x:1", "tls": {"insecure": false, "ca_pem": CA_PEM, "key_pem": KEY_PEM}}),
        ),
        ("insecure=false without ca_pem", json!({"name": "host-a", "address": "x:1", "tls": {"insecure": false}})),
        (
            "PEM fields with insecure=true",
            json!({"name": "host-a", "address": "x:1", "tls": {"insecure": true, "ca_pem": CA_PEM}}),
        ),
        (
            "ca_pem that is not PEM",
            json!({"name": "host-a", "address": "x:1", "tls": {"insecure": false, "ca_pem": "/etc/ca.pem"}}),
        ),
        ("unknown top-level field", json!({"name": "host-a", "address": "x:1", "skip_validation": true})),
        ("unknown tls field", json!({"name": "host-a", "address": "x:1", "tls": {"insecure": false, "ca_file": "/x"}})),
        ("unknown tls field next to a valid tls", {
            let mut t = tls_ok.clone();
            t["cert_file"] = json!("/x");
            json!({"name": "host-a", "address": "x:1", "tls": t})
        }),
        ("empty basic_auth_token", json!({"name": "host-a", "address": "x:1", "basic_auth_token": ""})),
        ("wrong type for address", json!({"name": "host-a", "address": 9090})),
        ("wrong type for tls", json!({"name": "host-a", "address": "x:1", "tls": "insecure"})),
        ("cordoned is not writable", json!({"name": "host-a", "address": "x:1", "cordoned": true})),
    ];
    for (what, body) in cases {
        let r = app.post(ADMIN, "/v1/hosts", body.clone()).await;
        assert_eq!(r.status.as_u16(), 400, "{what}: {body} → {}", r.body);
        r.assert_error(400, "INVALID_ARGUMENT");
        assert_no_secrets(&r.body);
    }
    assert_eq!(counts(&app).await, before);
    // The valid variant of the TLS body is accepted: the cases above fail for their reason.
    app.post(ADMIN, "/v1/hosts", json!({"name": "host-a", "address": "x:1", "tls": tls_ok})).await.assert_ok(201);
}

#[tokio::test]
async fn get_unknown_host_is_not_found() {
    let app = TestApp::spawn().await;
    app.get(ADMIN, "/v1/hosts/nope").await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn list_is_ordered_by_name() {
    let app = TestApp::spawn().await;
    // One address per host: an address is registered once.
    for (i, name) in ["zeta", "alpha", "mid", "alpha-2"].into_iter().enumerate() {
        app.post(ADMIN, "/v1/hosts", plain_host(name, &format!("10.0.0.{i}:9090"))).await.assert_ok(201);
    }
    let hosts = app.list_hosts().await;
    let names: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["alpha", "alpha-2", "mid", SIM_HOST, "zeta"]);
    assert_eq!(hosts[0], app.get_host("alpha").await, "list items are Host objects");
}

// ---------------------------------------------------------------------------------------
// Update
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn put_replaces_address_and_tls_and_keeps_the_cordon() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts", tls_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
    let cordoned_at = app.cordoned("host-a", Some(json!({"reason": "disk swap"}))).await.cordoned_at;

    // Name omitted from the body: the path names the host. `tls` omitted: kept (issue 25 item
    // 7; it used to mean plaintext, a silent downgrade).
    let kept = app.get_host("host-a").await.tls;
    let b = app.updated_host("host-a", json!({"address": "10.0.0.6:9091"})).await;
    assert_eq!(b.name, "host-a");
    assert_eq!(b.address, "10.0.0.6:9091");
    assert_eq!(b.tls, kept);
    let b = app.updated_host("host-a", json!({"address": "10.0.0.6:9091", "tls": {"insecure": true}})).await;
    assert_eq!(b.tls, plaintext());
    assert!(b.cordoned);
    assert_eq!(b.cordoned_reason.as_deref(), Some("disk swap"));
    assert_eq!(b.cordoned_at, cordoned_at);
    assert_eq!(b.vm_count, 0);
    assert_eq!(app.get_host("host-a").await, b);

    // Name in the body and matching: fine.
    let b = app.updated_host("host-a", plain_host("host-a", "10.0.0.7:9092")).await;
    assert_eq!(b.address, "10.0.0.7:9092");
    assert!(b.cordoned);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts").await, 2);
}

#[tokio::test]
async fn put_with_a_different_name_in_the_body_is_invalid_argument() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
    let before = host_row(&app, "host-a").await;
    let before_counts = counts(&app).await;
    app.put(ADMIN, "/v1/hosts/host-a", plain_host("host-b", "10.0.0.6:9090"))
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(host_row(&app, "host-a").await, before);
    assert!(host_row(&app, "host-b").await.is_none(), "hosts are never renamed or created by PUT");
    assert_eq!(counts(&app).await, before_counts);
}

#[tokio::test]
async fn put_with_an_invalid_spec_is_invalid_argument_and_changes_nothing() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
    let before = host_row(&app, "host-a").await;
    for body in [
        json!({"address": "10.0.0.6"}),
        json!({"address": "http://x:1"}),
        json!({"address": "x:0"}),
        json!({}),
        json!({"address": "x:1", "tls": {"insecure": false}}),
        json!({"address": "x:1", "unknown": 1}),
    ] {
        app.put(ADMIN, "/v1/hosts/host-a", body).await.assert_error(400, "INVALID_ARGUMENT");
    }
    assert_eq!(host_row(&app, "host-a").await, before);
}

#[tokio::test]
async fn put_of_an_unknown_host_is_not_found_and_creates_nothing() {
    let app = TestApp::spawn().await;
    app.put(ADMIN, "/v1/hosts/nope", plain_host("nope", "10.0.0.5:9090")).await.assert_error(404, "NOT_FOUND");
    app.put(ADMIN, "/v1/hosts/nope", json!({"address": "10.0.0.5:9090"})).await.assert_error(404, "NOT_FOUND");
    assert!(host_row(&app, "nope").await.is_none());
}

// ---------------------------------------------------------------------------------------
// Cordon
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn cordon_sets_reason_and_time_and_is_idempotent() {
    let app = TestApp::spawn().await;
    let t0 = chrono::Utc::now() - chrono::Duration::seconds(1);
    let b = app.cordoned(SIM_HOST, Some(json!({"reason": "kernel upgrade"}))).await;
    assert_eq!(b.name, SIM_HOST);
    assert!(b.cordoned);
    assert_eq!(b.cordoned_reason.as_deref(), Some("kernel upgrade"));
    let first_at = b.cordoned_at.unwrap_or_else(|| panic!("no cordoned_at: {b:?}"));
    assert!(first_at >= t0, "cordoned_at is now: {first_at}");
    assert_eq!(app.get_host(SIM_HOST).await, b);

    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    // Again, with a new reason: still cordoned, the reason is replaced.
    let again = app.cordoned(SIM_HOST, Some(json!({"reason": "disk swap"}))).await;
    assert!(again.cordoned);
    assert_eq!(again.cordoned_reason.as_deref(), Some("disk swap"));
    assert!(again.cordoned_at.unwrap_or_else(|| panic!("no cordoned_at: {again:?}")) >= first_at);
    // Everything else is untouched.
    assert_eq!(again.address, b.address);
    assert_eq!(again.tls, b.tls);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts WHERE cordoned").await, 1);
}

#[tokio::test]
async fn cordon_with_an_empty_body_cordons_without_a_reason() {
    let app = TestApp::spawn().await;
    let b = app.cordoned(SIM_HOST, None).await;
    assert!(b.cordoned);
    // No reason given: none recorded (the contract does not say null or "", both mean none).
    assert!(matches!(b.cordoned_reason.as_deref(), None | Some("")), "{b:?}");
    assert!(b.cordoned_at.is_some(), "{b:?}");
    // `{}` is the same thing.
    let b = app.cordoned(SIM_HOST, Some(json!({}))).await;
    assert!(b.cordoned);
    assert!(matches!(b.cordoned_reason.as_deref(), None | Some("")), "{b:?}");
}

#[tokio::test]
async fn cordon_with_a_bad_body_is_invalid_argument_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let before = host_row(&app, SIM_HOST).await;
    app.post(ADMIN, "/v1/hosts/sim/cordon", json!({"why": "x"})).await.assert_error(400, "INVALID_ARGUMENT");
    app.post(ADMIN, "/v1/hosts/sim/cordon", json!({"reason": 5})).await.assert_error(400, "INVALID_ARGUMENT");
    app.post(ADMIN, "/v1/hosts/sim/cordon", json!("maintenance")).await.assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(host_row(&app, SIM_HOST).await, before);
}

#[tokio::test]
async fn uncordon_clears_reason_and_time() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts/sim/cordon", json!({"reason": "kernel upgrade"})).await.assert_ok(200);
    let b = app.uncordoned(SIM_HOST).await;
    assert!(!b.cordoned);
    assert_eq!(b.cordoned_reason, None);
    assert_eq!(b.cordoned_at, None);
    assert_eq!(app.get_host(SIM_HOST).await, b);
    // Idempotent.
    assert_eq!(app.uncordoned(SIM_HOST).await, b);
    let row = host_row(&app, SIM_HOST).await.unwrap();
    assert_eq!((row["cordoned"].clone(), row["cordoned_reason"].clone()), (json!(false), Value::Null));
}

#[tokio::test]
async fn cordon_and_uncordon_of_an_unknown_host_are_not_found() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts/nope/cordon", json!({"reason": "x"})).await.assert_error(404, "NOT_FOUND");
    app.request(Method::POST, "/v1/hosts/nope/uncordon", Some(ADMIN), None, &[]).await.assert_error(404, "NOT_FOUND");
    assert!(host_row(&app, "nope").await.is_none());
}

// ---------------------------------------------------------------------------------------
// Delete
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn delete_of_an_unused_host_is_204_and_it_is_gone() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts", tls_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
    let r = app.delete(ADMIN, "/v1/hosts/host-a").await;
    assert_eq!(r.status.as_u16(), 204, "{}", r.body);
    assert_eq!(r.body, Value::Null, "204 has no body");
    app.get(ADMIN, "/v1/hosts/host-a").await.assert_error(404, "NOT_FOUND");
    app.delete(ADMIN, "/v1/hosts/host-a").await.assert_error(404, "NOT_FOUND");
    // The name is free again.
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
}

#[tokio::test]
async fn delete_of_an_unknown_host_is_not_found() {
    let app = TestApp::spawn().await;
    let before = counts(&app).await;
    app.delete(ADMIN, "/v1/hosts/nope").await.assert_error(404, "NOT_FOUND");
    assert_eq!(counts(&app).await, before);
}

#[tokio::test]
async fn delete_is_refused_while_a_pool_names_the_host() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);
    app.post(ADMIN, "/v1/pools", spec_on("web", &[SIM_HOST, "host-a"])).await.assert_ok(201);
    let host_before = host_row(&app, "host-a").await;
    let before = counts(&app).await;

    let r = app.delete(ADMIN, "/v1/hosts/host-a").await;
    r.assert_error(400, "FAILED_PRECONDITION");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("web"), "the message names the pool: {msg}");
    assert_eq!(host_row(&app, "host-a").await, host_before);
    assert_eq!(counts(&app).await, before);
    // Cordoning does not make it removable: only dropping it from the pool does.
    app.post(ADMIN, "/v1/hosts/host-a/cordon", json!({"reason": "retire"})).await.assert_ok(200);
    app.delete(ADMIN, "/v1/hosts/host-a").await.assert_error(400, "FAILED_PRECONDITION");
    app.put(ADMIN, "/v1/pools/default/web", spec_on("web", &[SIM_HOST])).await.assert_ok(200);
    assert_eq!(app.delete(ADMIN, "/v1/hosts/host-a").await.status.as_u16(), 204);
    assert!(host_row(&app, "host-a").await.is_none());
}

#[tokio::test]
async fn delete_is_refused_while_vm_rows_are_on_the_host() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    // Drop the host from the pool: only the VM row still uses it.
    app.put(ADMIN, "/v1/pools/default/ci", spec_on("ci", &[])).await.assert_ok(200);
    let host_before = host_row(&app, SIM_HOST).await;
    let before = counts(&app).await;

    let r = app.delete(ADMIN, "/v1/hosts/sim").await;
    r.assert_error(400, "FAILED_PRECONDITION");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("1 VM"), "the message gives the VM count: {msg}");
    assert_eq!(host_row(&app, SIM_HOST).await, host_before);
    assert_eq!(counts(&app).await, before);
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"));

    // Once the row is gone the host can go.
    app.conn().await.execute("DELETE FROM vms WHERE id = $1", &[&vm.id]).await.unwrap();
    assert_eq!(app.delete(ADMIN, "/v1/hosts/sim").await.status.as_u16(), 204);
}

#[tokio::test]
async fn delete_counts_vms_in_every_phase() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.put(ADMIN, "/v1/pools/default/ci", spec_on("ci", &[])).await.assert_ok(200);
    for phase in [Phase::Deleting, Phase::Failed] {
        let vm = app.seed_vm("ci", phase).await;
        app.delete(ADMIN, "/v1/hosts/sim").await.assert_error(400, "FAILED_PRECONDITION");
        app.conn().await.execute("DELETE FROM vms WHERE id = $1", &[&vm.id]).await.unwrap();
    }
    assert!(host_row(&app, SIM_HOST).await.is_some());
}

#[tokio::test]
async fn vm_count_reflects_the_vm_rows_on_the_host() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.create_pool("web", 3).await;
    assert_eq!(app.get_host(SIM_HOST).await.vm_count, 0);
    app.seed_vm("ci", Phase::Available).await;
    app.seed_vm("ci", Phase::Deleting).await;
    app.seed_vm("web", Phase::Quarantined).await;
    app.post(ADMIN, "/v1/hosts", plain_host("host-a", "10.0.0.5:9090")).await.assert_ok(201);

    assert_eq!(app.get_host(SIM_HOST).await.vm_count, 3);
    let counts: Vec<(String, i64)> = app.list_hosts().await.into_iter().map(|h| (h.name, h.vm_count)).collect();
    assert_eq!(counts, [("host-a".to_owned(), 0), (SIM_HOST.to_owned(), 3)]);
    assert_eq!(app.cordoned(SIM_HOST, Some(json!({"reason": "x"}))).await.vm_count, 3);
    let updated = app.updated_host(SIM_HOST, json!({"address": app.sim_server.addr.to_string()})).await;
    assert_eq!(updated.vm_count, 3);
}

/// A pool create naming host X and a removal of X, released together, never both succeed:
/// either the pool exists and names a live host, or the host is gone and the create failed.
#[tokio::test]
async fn pool_create_racing_host_delete_never_both_succeed() {
    let app = Arc::new(TestApp::spawn().await);
    let (mut pool_won, mut delete_won) = (0, 0);
    for round in 0..10 {
        let host = format!("race-{round}");
        // One address per host (an address is registered once); the hosts of earlier rounds
        // may still be there.
        app.post(ADMIN, "/v1/hosts", plain_host(&host, &format!("10.0.0.5:{}", 9000 + round))).await.assert_ok(201);
        let barrier = Arc::new(Barrier::new(2));
        let create = {
            let (app, barrier, host) = (app.clone(), barrier.clone(), host.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.post(ADMIN, "/v1/pools", spec_on(&host, &[&host])).await
            })
        };
        let delete = {
            let (app, barrier, host) = (app.clone(), barrier.clone(), host.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.delete(ADMIN, &format!("/v1/hosts/{host}")).await
            })
        };
        let (c, d) = (create.await.unwrap(), delete.await.unwrap());
        let pool_exists = app.scalar_i64(&format!("SELECT count(*) FROM pools WHERE name = '{host}'")).await == 1;
        let host_exists = host_row(&app, &host).await.is_some();
        match (c.status.as_u16(), d.status.as_u16()) {
            (201, 400) => {
                d.assert_error(400, "FAILED_PRECONDITION");
                assert!(pool_exists && host_exists, "round {round}: pool created, so the host must remain");
                pool_won += 1;
            }
            (400, 204) => {
                c.assert_error(400, "FAILED_PRECONDITION");
                assert!(!pool_exists && !host_exists, "round {round}: host removed, so no pool may name it");
                delete_won += 1;
            }
            (cs, ds) => panic!(
                "round {round}: pool create {cs} {} / host delete {ds} {} (pool exists: {pool_exists}, host exists: {host_exists})",
                c.body, d.body
            ),
        }
    }
    assert_eq!(pool_won + delete_won, 10);
    // No pool anywhere names a missing host.
    assert_eq!(
        app.scalar_i64(
            "SELECT count(*) FROM pools p, unnest(p.flintlock_hosts) AS h WHERE h NOT IN (SELECT name FROM hosts)"
        )
        .await,
        0
    );
}

// ---------------------------------------------------------------------------------------
// Roles
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn client_tokens_are_refused_on_every_host_and_vm_route() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let host_before = host_row(&app, SIM_HOST).await;
    let before = counts(&app).await;
    let routes: Vec<(Method, String, Option<Value>)> = vec![
        (Method::POST, "/v1/hosts".into(), Some(plain_host("host-a", "10.0.0.5:9090"))),
        (Method::GET, "/v1/hosts".into(), None),
        (Method::GET, "/v1/hosts/sim".into(), None),
        (Method::PUT, "/v1/hosts/sim".into(), Some(json!({"address": "10.0.0.5:9090"}))),
        (Method::DELETE, "/v1/hosts/sim".into(), None),
        (Method::POST, "/v1/hosts/sim/cordon".into(), Some(json!({"reason": "x"}))),
        (Method::POST, "/v1/hosts/sim/uncordon".into(), None),
        (Method::GET, "/v1/vms".into(), None),
        (Method::GET, format!("/v1/vms/{}", vm.id), None),
        (Method::DELETE, format!("/v1/vms/{}", vm.id), None),
    ];
    for token in [CLIENT_A, CLIENT_B] {
        for (method, path, body) in &routes {
            let r = app.request(method.clone(), path, Some(token), body.clone(), &[]).await;
            assert_eq!(r.status.as_u16(), 403, "{method} {path}: {}", r.body);
            r.assert_error(403, "PERMISSION_DENIED");
        }
    }
    assert_eq!(host_row(&app, SIM_HOST).await, host_before);
    assert_eq!(counts(&app).await, before);
}

// ---------------------------------------------------------------------------------------
// VMs
// ---------------------------------------------------------------------------------------

/// The ids of `GET /v1/vms?{query}`, sorted.
async fn vm_ids(app: &TestApp, query: &str) -> Vec<String> {
    sorted(app.list_vms(query).await.into_iter().map(|v| v.id).collect())
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

#[tokio::test]
async fn vm_list_returns_vm_records() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    // The typed read checks the body is exactly {"vms": []}.
    assert_eq!(app.list_vms("").await, []);

    let vm = app.seed_vm("ci", Phase::Available).await;
    let r = app.get(ADMIN, "/v1/vms").await;
    let wire = r.assert_ok(200)["vms"].as_array().unwrap();
    assert_eq!(wire.len(), 1);
    let mut keys: Vec<&str> = wire[0].as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "created_at",
            "flintlock_host",
            "id",
            "lease_id",
            "network_interfaces",
            "phase",
            "pool",
            "revision",
            "uid",
            "updated_at"
        ]
    );
    // The typed read also parses created_at and updated_at as RFC 3339.
    let list = r.json::<api::VmList>().vms;
    let rec = &list[0];
    assert_eq!(rec.id, vm.id);
    assert_eq!(rec.uid.as_deref(), Some(vm.uid.as_deref().unwrap()));
    assert_eq!(rec.pool, pool("ci"));
    assert_eq!(rec.flintlock_host, SIM_HOST);
    assert_eq!(rec.phase, Phase::Available);
    assert_eq!(rec.lease_id, None);
    assert_eq!(rec.network_interfaces["eth1"]["index"], json!(7));

    // A claimed VM carries its lease id.
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let rec = app.get_vm(&vm.id).await;
    assert_eq!(rec.phase, Phase::Leased);
    assert_eq!(rec.lease_id, Some(claim.lease.lease_id));
}

#[tokio::test]
async fn vm_list_filters_by_namespace_pool_and_phase() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.create_pool("web", 3).await;
    let mut other_ns = pool_spec("ci", 1);
    other_ns["namespace"] = json!("team-b");
    app.post(ADMIN, "/v1/pools", other_ns).await.assert_ok(201);

    let ci_a = app.seed_vm("ci", Phase::Available).await;
    let ci_q = app.seed_vm("ci", Phase::Quarantined).await;
    let web_a = app.seed_vm("web", Phase::Available).await;
    // A VM of team-b/ci: seed_vm writes default/, so move the row.
    let tb = app.seed_vm("ci", Phase::Available).await;
    app.conn().await.execute("UPDATE vms SET pool_namespace = 'team-b' WHERE id = $1", &[&tb.id]).await.unwrap();

    let all = sorted(vec![ci_a.id.clone(), ci_q.id.clone(), web_a.id.clone(), tb.id.clone()]);
    assert_eq!(vm_ids(&app, "").await, all);
    assert_eq!(
        vm_ids(&app, "namespace=default").await,
        sorted(vec![ci_a.id.clone(), ci_q.id.clone(), web_a.id.clone()])
    );
    assert_eq!(vm_ids(&app, "namespace=team-b").await, vec![tb.id.clone()]);
    assert_eq!(vm_ids(&app, "namespace=default&pool=ci").await, sorted(vec![ci_a.id.clone(), ci_q.id.clone()]));
    assert_eq!(vm_ids(&app, "namespace=default&pool=ci&phase=QUARANTINED").await, vec![ci_q.id.clone()]);
    assert_eq!(vm_ids(&app, "phase=AVAILABLE").await, sorted(vec![ci_a.id.clone(), web_a.id.clone(), tb.id.clone()]));
    assert_eq!(vm_ids(&app, "phase=LEASED").await, Vec::<String>::new());
    assert_eq!(vm_ids(&app, "namespace=nope").await, Vec::<String>::new());
    // Empty values mean "no filter".
    assert_eq!(vm_ids(&app, "namespace=&pool=&phase=").await, all);
}

#[tokio::test]
async fn vm_list_with_an_unknown_phase_or_parameter_is_invalid_argument() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_vm("ci", Phase::Available).await;
    for q in ["phase=RUNNING", "phase=available", "phase=1", "status=AVAILABLE"] {
        let r = app.get(ADMIN, &format!("/v1/vms?{q}")).await;
        assert_eq!(r.status.as_u16(), 400, "{q}: {}", r.body);
        r.assert_error(400, "INVALID_ARGUMENT");
    }
}

#[tokio::test]
async fn vm_get_returns_the_record_or_not_found() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Provisioning).await;
    let rec = app.get_vm(&vm.id).await;
    assert_eq!(rec.id, vm.id);
    assert_eq!(rec.phase, Phase::Provisioning);
    assert_eq!(rec.pool, pool("ci"));
    assert_eq!(app.list_vms("").await[0], rec, "GET one and the list give the same record");
    app.get(ADMIN, "/v1/vms/ci-nope").await.assert_error(404, "NOT_FOUND");
}

// ---------------------------------------------------------------------------------------
// Discarding a VM (DELETE /v1/vms/{id})
// ---------------------------------------------------------------------------------------

/// The VM_DISCARDED events: (vm id, payload).
async fn discarded_events(app: &TestApp) -> Vec<(String, Value)> {
    app.conn()
        .await
        .query("SELECT vm_id, payload FROM events WHERE type = 'VM_DISCARDED' ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Whether the simulator still has `uid` as a live (not DELETING) microVM.
fn sim_has_live(app: &TestApp, uid: &str) -> bool {
    use flintlock_proto::types::micro_vm_status::MicroVmState;
    app.sim.vm(uid).is_some_and(|m| m.status.is_some_and(|s| s.state != MicroVmState::Deleting as i32))
}

/// Issue 14 item 5: an operator discards a VM (a QUARANTINED one, or any other not leased):
/// 204, the microVM is deleted in flintlock, the row is gone, VM_DISCARDED names the phase it
/// left and who discarded it; a second DELETE and an unknown id are 404.
#[tokio::test]
async fn deleting_a_vm_deletes_its_microvm_and_removes_its_row() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    let quarantined = app.seed_vm("ci", Phase::Quarantined).await;
    let available = app.seed_vm("ci", Phase::Available).await;
    for vm in [&quarantined, &available] {
        let r = app.delete(ADMIN, &format!("/v1/vms/{}", vm.id)).await;
        assert_eq!(r.assert_ok(204), &Value::Null);
        assert_eq!(app.phase_of(&vm.id).await, None, "row removed");
        assert!(!sim_has_live(&app, vm.uid.as_deref().unwrap()), "microVM deleted in flintlock");
        app.get(ADMIN, &format!("/v1/vms/{}", vm.id)).await.assert_error(404, "NOT_FOUND");
        app.delete(ADMIN, &format!("/v1/vms/{}", vm.id)).await.assert_error(404, "NOT_FOUND");
    }
    let events = discarded_events(&app).await;
    assert_eq!(
        events,
        [
            (quarantined.id.clone(), json!({"phase": "QUARANTINED", "by": "admin"})),
            (available.id.clone(), json!({"phase": "AVAILABLE", "by": "admin"})),
        ]
    );
    let before = counts(&app).await;
    app.delete(ADMIN, "/v1/vms/ci-nope").await.assert_error(404, "NOT_FOUND");
    assert_eq!(counts(&app).await, before);
    assert_eq!(app.get_pool("ci").await.status.counts, Default::default());
}

/// Issue 14 item 5: a LEASED VM is refused with FAILED_PRECONDITION (release its lease
/// instead) and nothing changes: the lease, the VM and its microVM stay.
#[tokio::test]
async fn deleting_a_leased_vm_is_failed_precondition_and_changes_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let claim = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert_eq!(claim.vm.id, vm.id);
    let before = counts(&app).await;
    let r = app.delete(ADMIN, &format!("/v1/vms/{}", vm.id)).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("release its lease"), "{}", r.body);
    assert_eq!(counts(&app).await, before);
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("LEASED"));
    assert!(sim_has_live(&app, vm.uid.as_deref().unwrap()));
    assert_eq!(app.get_lease(CLIENT_A, &claim.lease.lease_id).await, claim.lease);
    app.heartbeated(CLIENT_A, &claim.lease.lease_id).await;
}

/// Issue 14 item 5: when flintlock cannot delete the microVM the discard answers 503 and the
/// VM stays DELETING (so nothing claims it and the reconciler finishes it); a retry of the
/// same DELETE finishes it once flintlock recovers.
#[tokio::test]
async fn a_vm_delete_that_flintlock_refuses_is_503_and_stays_deleting_until_a_retry() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    let vm = app.seed_vm("ci", Phase::Quarantined).await;
    app.sim.fail_deletes(u32::MAX);
    let r = app.delete(ADMIN, &format!("/v1/vms/{}", vm.id)).await;
    r.assert_error(503, "UNAVAILABLE");
    assert!(r.headers.get("retry-after").is_some(), "{:?}", r.headers);
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("DELETING"));
    assert!(sim_has_live(&app, vm.uid.as_deref().unwrap()));
    app.sim.reset_faults();
    app.delete(ADMIN, &format!("/v1/vms/{}", vm.id)).await.assert_ok(204);
    assert_eq!(app.phase_of(&vm.id).await, None);
    assert!(!sim_has_live(&app, vm.uid.as_deref().unwrap()));
    assert_eq!(discarded_events(&app).await.len(), 1, "marked once");
}

/// Issue 14 item 5: discards racing claims on the same VMs. Released at once, every VM ends
/// either leased (its claim won: the discard is FAILED_PRECONDITION) or deleted (the discard
/// won: that claim found no VM, or — the discard landing while the claim checked its VM with
/// flintlock — answered 409 ABORTED) — never both, never a lease on a deleted VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_deletes_racing_claims_never_delete_a_leased_vm() {
    const N: usize = 8;
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 0).await;
    let vms = app.seed_available("ci", N).await;
    let barrier = Arc::new(Barrier::new(2 * N));
    let mut tasks = vec![];
    for vm in &vms {
        let (app, barrier, id) = (app.clone(), barrier.clone(), vm.id.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            (true, app.delete(ADMIN, &format!("/v1/vms/{id}")).await)
        }));
    }
    for _ in 0..N {
        let (app, barrier) = (app.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            (false, app.claim(CLIENT_A, "ci", None).await)
        }));
    }
    let (mut deleted, mut refused, mut claimed, mut exhausted) = (0, 0, vec![], 0);
    let mut aborted = 0;
    for t in tasks {
        match t.await.unwrap() {
            (true, r) if r.status.as_u16() == 204 => deleted += 1,
            (true, r) => {
                r.assert_error(400, "FAILED_PRECONDITION");
                refused += 1;
            }
            (false, r) if r.status.as_u16() == 200 => claimed.push(r.json::<api::ClaimResponse>().vm.id),
            (false, r) if r.status.as_u16() == 409 => {
                r.assert_error(409, "ABORTED");
                aborted += 1;
            }
            (false, r) => {
                r.assert_error(429, "RESOURCE_EXHAUSTED");
                exhausted += 1;
            }
        }
    }
    assert_eq!(deleted + refused, N);
    assert_eq!(claimed.len() + exhausted + aborted, N);
    assert_eq!(claimed.len(), refused, "a discard is refused exactly for the VMs claims won");
    for vm in &vms {
        let phase = app.phase_of(&vm.id).await;
        if claimed.contains(&vm.id) {
            assert_eq!(phase.as_deref(), Some("LEASED"), "{}", vm.id);
            assert!(sim_has_live(&app, vm.uid.as_deref().unwrap()), "a leased VM's microVM is kept");
        } else {
            assert_eq!(phase, None, "{}", vm.id);
            assert!(!sim_has_live(&app, vm.uid.as_deref().unwrap()));
        }
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, claimed.len() as i64);
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM leases l WHERE NOT EXISTS (SELECT 1 FROM vms v WHERE v.id = l.vm_id)")
            .await,
        0,
        "no lease on a deleted VM"
    );
    assert_eq!(discarded_events(&app).await.len(), deleted);
}

// ---------------------------------------------------------------------------------------
// One record per flintlockd (issue 14 item 9)
// ---------------------------------------------------------------------------------------

/// Issue 14 item 9: two host records for one flintlockd would each see the other's VMs as
/// VMs "on another host" and delete them as orphans. An address is registered once
/// (compared without case: `Flint.Example:9090` is `flint.example:9090`): a second host at
/// it, by POST or by a PUT that moves a host there, answers 409 ALREADY_EXISTS naming the
/// host that has it, and changes nothing. A PUT that keeps a host's own address is fine.
#[tokio::test]
async fn a_second_host_record_for_the_same_address_is_already_exists() {
    let app = TestApp::spawn().await;
    let sim_address = app.get_host(SIM_HOST).await.address;
    app.created_host(plain_host("host-a", "flint.example:9090")).await;
    app.created_host(plain_host("host-b", "10.0.0.7:9090")).await;
    let before = counts(&app).await;
    let rows = [host_row(&app, SIM_HOST).await, host_row(&app, "host-a").await, host_row(&app, "host-b").await];

    for (spec, owner) in [
        (plain_host("sim-again", &sim_address), SIM_HOST),
        (tls_host("host-c", "flint.example:9090"), "host-a"),
        (plain_host("host-c", "FLINT.example:9090"), "host-a"),
    ] {
        let r = app.post(ADMIN, "/v1/hosts", spec).await;
        r.assert_error(409, "ALREADY_EXISTS");
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(owner), "the message names host {owner}: {message}");
    }
    for address in [sim_address.as_str(), "Flint.Example:9090"] {
        app.put(ADMIN, "/v1/hosts/host-b", json!({"address": address})).await.assert_error(409, "ALREADY_EXISTS");
    }
    assert_eq!(counts(&app).await, before);
    let after = [host_row(&app, SIM_HOST).await, host_row(&app, "host-a").await, host_row(&app, "host-b").await];
    assert_eq!(after, rows, "nothing changed");

    // Keeping (or re-casing) its own address is not a conflict.
    assert_eq!(
        app.updated_host("host-a", json!({"address": "Flint.example:9090"})).await.address,
        "Flint.example:9090"
    );
    // A freed address can be taken.
    app.updated_host("host-b", json!({"address": "10.0.0.8:9090"})).await;
    app.created_host(plain_host("host-c", "10.0.0.7:9090")).await;
}

/// Issue 25 item 7: flintlock transport never fails open. A create without `tls` is refused
/// (plaintext only as `{"insecure": true}`); a PUT that leaves `tls` out keeps the host's
/// current TLS, its client key included; a basic-auth token over plaintext is refused unless
/// the address is loopback.
#[tokio::test]
async fn host_transport_is_explicit_and_a_put_without_tls_keeps_it() {
    let app = TestApp::spawn().await;
    let r = app.post(ADMIN, "/v1/hosts", json!({"name": "plain", "address": "10.0.0.5:9090"})).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    let m = r.body["error"]["message"].as_str().unwrap();
    assert!(m.contains("tls is required") && m.contains("insecure"), "{m}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts WHERE name = 'plain'").await, 0);

    // mTLS, then a PUT that changes only the exec mode: TLS and key stay.
    let pem = |what: &str| format!("-----BEGIN {what}-----\nMIIB\n-----END {what}-----\n");
    let tls = json!({"ca_pem": pem("CERTIFICATE"), "cert_pem": pem("CERTIFICATE"), "key_pem": pem("PRIVATE KEY")});
    app.post(ADMIN, "/v1/hosts", json!({"name": "mtls", "address": "10.0.0.6:9090", "tls": tls})).await.assert_ok(201);
    let r = app.put(ADMIN, "/v1/hosts/mtls", json!({"address": "10.0.0.6:9090", "exec": "disabled"})).await;
    let body = r.assert_ok(200).clone();
    assert_eq!(body["tls"]["insecure"], json!(false), "{body}");
    assert_eq!(body["exec"], json!("disabled"));
    let conn = app.conn().await;
    let (h, _) = poolmgr_core::store::host_get(&**conn, "mtls").await.unwrap().unwrap();
    let kept = app.host_secrets("mtls").await.key_pem;
    assert_eq!((h.tls_insecure, kept.as_deref()), (false, Some(pem("PRIVATE KEY").as_str())), "key kept");
    // An explicit plaintext PUT does change it (the admin said so).
    app.put(ADMIN, "/v1/hosts/mtls", json!({"address": "10.0.0.6:9090", "tls": {"insecure": true}}))
        .await
        .assert_ok(200);
    let (h, _) = poolmgr_core::store::host_get(&**conn, "mtls").await.unwrap().unwrap();
    assert_eq!((h.tls_insecure, h.key_pem), (true, None));
    // A PUT without tls of an unknown host is NOT_FOUND, as any.
    app.put(ADMIN, "/v1/hosts/ghost", json!({"address": "10.0.0.7:9090"})).await.assert_error(404, "NOT_FOUND");

    // A token over plaintext: refused on a network address, on create and on a PUT that keeps
    // plaintext; accepted on loopback; accepted over TLS.
    let token = json!("flintlock-basic-auth-secret");
    for address in ["10.0.0.8:9090", "flintlock.internal:9090", "[fd00::1]:9090"] {
        let r = app
            .post(
                ADMIN,
                "/v1/hosts",
                json!({"name": "tok", "address": address, "tls": {"insecure": true}, "basic_auth_token": token}),
            )
            .await;
        r.assert_error(400, "INVALID_ARGUMENT");
        let m = r.body["error"]["message"].as_str().unwrap();
        assert!(
            m.contains("basic_auth_token") && m.contains("plaintext") && !m.contains("flintlock-basic-auth-secret"),
            "{m}"
        );
    }
    let r = app.put(ADMIN, "/v1/hosts/mtls", json!({"address": "10.0.0.6:9090", "basic_auth_token": token})).await;
    r.assert_error(400, "INVALID_ARGUMENT");
    for (i, address) in ["127.0.0.1:9090", "localhost:9091", "[::1]:9092"].iter().enumerate() {
        let body = json!({"name": format!("loop-{i}"), "address": address, "tls": {"insecure": true}, "basic_auth_token": token});
        app.post(ADMIN, "/v1/hosts", body).await.assert_ok(201);
    }
    let body = json!({"name": "tok", "address": "10.0.0.9:9090", "tls": {"ca_pem": pem("CERTIFICATE")}, "basic_auth_token": token});
    app.post(ADMIN, "/v1/hosts", body).await.assert_ok(201);
}
