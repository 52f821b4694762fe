//! The function binaries as AWS Lambda runs them (issue 12 section 1): each test starts a real
//! binary (`target/<profile>/claims`, `…/reconcile`) under `lambda_emu`'s Runtime API, with its
//! secrets behind an emulated Parameters and Secrets extension that, like AWS's, refuses every
//! call until the runtime asked for its first event. The database is the suite's PostgreSQL,
//! reached through the secret's credentials and the `POOLMGR_DATABASE_*` overrides as the SAM
//! template sets them; reconcile drives the in-process flintlock-sim over gRPC.
//!
//! `scripts/test.sh` builds the binaries before the tests (`cargo test` does not build other
//! packages' binaries); `POOLMGR_FUNCTION_BIN_DIR` points elsewhere.

use std::path::PathBuf;
use std::time::Duration;

use lambda_emu::{Bytes, Emulator, ExtensionCalls, Function, Outcome, http_event};
use poolmgr_core::store;
use poolmgr_tests::{ADMIN, CLIENT_A, CLIENT_B, TestApp};
use serde_json::{Value, json};

pub(crate) const DB_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/db-AbCdEf";
pub(crate) const TOKENS_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/tokens-XyZ123";
/// Generous: debug binaries on a busy 2-core machine.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// A function binary next to this test binary (`target/debug/deps/api-…` → `target/debug/`).
pub(crate) fn function_bin(name: &str) -> PathBuf {
    let dir = match std::env::var_os("POOLMGR_FUNCTION_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().expect("the test binary's path");
            exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/").to_path_buf()
        }
    };
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: build the function binaries first (`cargo build --bin claims --bin reconcile`; \
         scripts/test.sh does), or point POOLMGR_FUNCTION_BIN_DIR at them",
        bin.display()
    );
    bin
}

/// The database secret as RDS writes it (its host is the instance, which the functions must
/// not use), and the function environment of the SAM template: both secret ARNs and the
/// overrides that point the connection at the proxy (here: the suite's PostgreSQL).
fn lambda_setup(app: &TestApp) -> (String, Vec<(String, String)>) {
    let cfg: tokio_postgres::Config = app.db.app_url.parse().expect("the test database URL");
    let host = match &cfg.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("the test database must be reached over TCP, not {other:?}"),
    };
    let password = cfg.get_password().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default();
    let secret = json!({
        "engine": "postgres",
        "username": cfg.get_user().expect("a user in the test database URL"),
        "password": password,
        "host": "poolmgr-db.abcdefghijkl.eu-west-1.rds.amazonaws.com",
        "port": 5432,
        "dbname": "postgres",
    });
    let env = [
        ("POOLMGR_DATABASE_SECRET_ARN", DB_ARN.to_owned()),
        ("POOLMGR_TOKENS_SECRET_ARN", TOKENS_ARN.to_owned()),
        ("POOLMGR_DATABASE_HOST", host),
        ("POOLMGR_DATABASE_PORT", cfg.get_ports()[0].to_string()),
        ("POOLMGR_DATABASE_NAME", cfg.get_dbname().expect("a database name").to_owned()),
        ("RUST_LOG", "info".to_owned()),
    ];
    (secret.to_string(), env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

pub(crate) fn tokens_secret() -> String {
    json!({"admin_tokens": format!("admin:{ADMIN}"), "client_tokens": [format!("client-a:{CLIENT_A}"), format!("client-b:{CLIENT_B}")]})
        .to_string()
}

/// One invocation's outcome; panics (with the function's log) if it never answered.
pub(crate) async fn invoke(f: &mut Function, payload: impl Into<Bytes>) -> Outcome {
    match f.invoke(payload, ANSWER_WITHIN).await {
        Ok(answer) => answer.outcome,
        Err(e) => panic!("{e}"),
    }
}

/// An API Gateway response: status, headers, and the body as JSON.
pub(crate) fn http_answer(outcome: &Outcome) -> (u64, Value, Value) {
    let resp = outcome.json();
    let status = resp["statusCode"].as_u64().unwrap_or_else(|| panic!("not an API Gateway response: {resp}"));
    let body = serde_json::from_str(resp["body"].as_str().unwrap_or("null")).unwrap_or(Value::Null);
    (status, resp["headers"].clone(), body)
}

pub(crate) fn claim_event(request_id: &str) -> Vec<u8> {
    let body = json!({"pool": {"namespace": "default", "name": "ci"}, "request_id": request_id}).to_string();
    let auth = format!("Bearer {CLIENT_A}");
    http_event("POST", "/v1/claims", &[("authorization", &auth)], Some(&body)).to_string().into_bytes()
}

/// Pool default/ci with `vms` AVAILABLE VMs, and the claims function's emulated environment
/// with the database secret in its extension (the tokens secret is the test's to add).
pub(crate) async fn claims_setup(vms: usize) -> (TestApp, Emulator, Vec<(String, String)>) {
    let app = TestApp::spawn().await;
    app.create_pool("ci", vms as i32).await;
    app.seed_available("ci", vms).await;
    let emu = Emulator::start("claims").await.unwrap();
    let (db_secret, env) = lambda_setup(&app);
    emu.extension.put_secret(DB_ARN, &db_secret);
    (app, emu, env)
}

#[tokio::test]
async fn an_http_function_reads_its_secrets_in_the_invoke_phase_and_keeps_its_state() {
    let (app, emu, env) = claims_setup(2).await;
    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    let mut claims = emu.spawn(&function_bin("claims"), &env).unwrap();

    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["replayed"], json!(false), "{body}");
    let lease_id = body["lease"]["lease_id"].as_str().expect("a lease").to_owned();
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    // Both secrets read once, and only once the runtime had asked for its event.
    let read = ExtensionCalls { refused_in_init: 0, served: 2, not_found: 0, unauthorized: 0 };
    assert_eq!(emu.extension.calls(), read);

    // The next invocation reuses the instance's state: no secret is read again.
    let (status, headers, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["replayed"], json!(true), "{body}");
    assert_eq!(body["lease"]["lease_id"], json!(lease_id));
    assert_eq!(headers["idempotent-replayed"], json!("true"), "{headers}");
    assert_eq!(emu.extension.calls(), read);
    assert!(emu.runtime.init_errors().is_empty(), "{:?}", emu.runtime.init_errors());
    assert!(claims.is_running(), "the function must keep serving:\n{}", claims.stderr());
}

#[tokio::test]
async fn an_http_function_answers_503_while_its_secret_cannot_be_read_and_reads_it_on_the_next_invocation() {
    let (app, emu, mut env) = claims_setup(1).await;
    env.push(("POOLMGR_SECRETS_WAIT_MS".into(), "0".into()));
    // The tokens secret does not exist yet (a role that may not read it answers alike).
    let mut claims = emu.spawn(&function_bin("claims"), &env).unwrap();

    let (status, headers, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], json!(503), "{body}");
    assert_eq!(body["error"]["status"], json!("UNAVAILABLE"), "{body}");
    let message = body["error"]["message"].as_str().expect("a message");
    assert!(message.contains("retry"), "says what to do: {message}");
    assert!(!message.contains("arn:"), "no internals in the answer: {message}");
    assert_eq!(headers["retry-after"], json!("1"), "{headers}");
    assert_eq!(headers["content-type"], json!("application/json"), "{headers}");
    assert_eq!(emu.extension.calls().not_found, 1);
    assert!(claims.is_running(), "a failed read must not end the instance:\n{}", claims.stderr());
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);

    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["replayed"], json!(false), "{body}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(emu.extension.calls().refused_in_init, 0);
    assert!(emu.runtime.init_errors().is_empty(), "{:?}", emu.runtime.init_errors());
}

#[tokio::test]
async fn the_reconcile_function_reads_its_secrets_in_the_invoke_phase_and_accepts_every_payload() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    let emu = Emulator::start("reconcile").await.unwrap();
    let (db_secret, mut env) = lambda_setup(&app);
    env.push(("POOLMGR_SECRETS_WAIT_MS".into(), "0".into()));
    env.push(("POOLMGR_DB_POOL_SIZE".into(), "4".into()));
    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    let mut reconcile = emu.spawn(&function_bin("reconcile"), &env).unwrap();
    let scheduled = include_str!("../../../functions/reconcile/events/scheduled.json");

    // No database secret yet: an error result a retry can fix, and the instance lives on.
    match invoke(&mut reconcile, scheduled).await {
        Outcome::Error { error_type, body } => {
            assert_eq!(error_type, "Retryable", "{body}");
            let message = body["errorMessage"].as_str().unwrap_or_default();
            assert!(message.contains(DB_ARN) && message.contains("retry"), "{body}");
        }
        other => panic!("expected an error, got {other:?}"),
    }
    // A secret that is not a database secret: no retry helps until an operator fixes it.
    emu.extension.put_secret(DB_ARN, "not a database secret");
    match invoke(&mut reconcile, "{}").await {
        Outcome::Error { error_type, body } => assert_eq!(error_type, "NotRetryable", "{body}"),
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 0);

    emu.extension.put_secret(DB_ARN, &db_secret);
    let report = invoke(&mut reconcile, scheduled).await.json();
    assert_eq!(
        (report["total"]["pools"].clone(), report["total"]["created"].clone()),
        (json!(1), json!(2)),
        "{report}"
    );
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 2);
    let read = emu.extension.calls();

    // `aws lambda invoke` with `{}`, and `cargo lambda invoke` without data (null, or nothing
    // at all): each runs one pass on the state already built.
    for payload in ["{}", "null", ""] {
        // Work for this pass whatever the simulator's boot did meanwhile (the VMs may be
        // AVAILABLE already, and a settled pool is not stepped): the spec written anew.
        app.conn().await.execute("UPDATE pools SET updated_at = now()", &[]).await.unwrap();
        let report = invoke(&mut reconcile, payload).await.json();
        assert_eq!(report["total"]["pools"], json!(1), "payload {payload:?}: {report}");
        assert!(report["duration_ms"].is_u64(), "payload {payload:?}: {report}");
    }
    assert_eq!(emu.extension.calls(), read, "the state is kept: no secret read again");
    assert_eq!(read.refused_in_init, 0);
    assert!(emu.runtime.init_errors().is_empty(), "{:?}", emu.runtime.init_errors());
    assert!(reconcile.is_running(), "{}", reconcile.stderr());
}

/// A stand-in for Lambda's Invoke API: every invoke (function name, headers, payload) is sent
/// on the channel and answered 202.
async fn lambda_invoke_api()
-> (std::net::SocketAddr, tokio::sync::mpsc::UnboundedReceiver<(String, axum::http::HeaderMap, Bytes)>) {
    use axum::extract::Path as UrlPath;
    use axum::http::{HeaderMap, StatusCode};
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(String, HeaderMap, Bytes)>();
    let api = axum::Router::new().route(
        "/2015-03-31/functions/{name}/invocations",
        axum::routing::post(move |UrlPath(name): UrlPath<String>, headers: HeaderMap, body: Bytes| {
            let _ = tx.send((name, headers, body));
            async { StatusCode::ACCEPTED }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, api).await });
    (addr, rx)
}

/// Issue 22 item 1 on the deployed shape: the claims function, as Lambda runs it, wakes the
/// reconcile function with an asynchronous Invoke (`X-Amz-Invocation-Type: Event`) signed
/// with its role's credentials, before it answers (a frozen environment would never send
/// it); the signature is checked here against SigV4 recomputed from what arrived. A second
/// claim within the debounce sends no second invoke.
#[tokio::test]
async fn a_claim_on_lambda_wakes_the_reconcile_function_with_a_signed_asynchronous_invoke() {
    use poolmgr_core::wake::{Credentials, Request, authorization, sha256_hex};

    let (_app, emu, mut env) = claims_setup(2).await;
    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    let (addr, mut rx) = lambda_invoke_api().await;
    // The session token stays the emulator's: the secrets extension checks it.
    let creds = Credentials {
        access_key_id: "ASIATESTWAKE".into(),
        secret_access_key: "wake/secret".into(),
        session_token: None,
    };
    env.extend([
        ("POOLMGR_WAKE_LAMBDA_FUNCTION".to_owned(), "poolmgr-reconcile".to_owned()),
        ("POOLMGR_LAMBDA_ENDPOINT".to_owned(), format!("http://{addr}")),
        ("POOLMGR_WAKE_DEBOUNCE_MS".to_owned(), "60000".to_owned()),
        ("AWS_ACCESS_KEY_ID".to_owned(), creds.access_key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_owned(), creds.secret_access_key.clone()),
    ]);
    let mut claims = emu.spawn(&function_bin("claims"), &env).unwrap();
    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 200, "{body}");
    // Sent before the answer: already here.
    let (name, headers, payload) =
        rx.try_recv().unwrap_or_else(|_| panic!("no invoke before the answer:\n{}", claims.stderr()));
    assert_eq!(name, "poolmgr-reconcile");
    let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    assert_eq!(h("x-amz-invocation-type"), "Event");
    assert!(h("x-amz-security-token").starts_with("emulated-session-"), "{headers:?}");
    let at = chrono::NaiveDateTime::parse_from_str(&h("x-amz-date"), "%Y%m%dT%H%M%SZ").expect("x-amz-date").and_utc();
    let signed = [
        ("host", h("host")),
        ("x-amz-date", h("x-amz-date")),
        ("x-amz-invocation-type", h("x-amz-invocation-type")),
        ("x-amz-security-token", h("x-amz-security-token")),
    ];
    let req = Request {
        method: "POST",
        canonical_uri: "/2015-03-31/functions/poolmgr-reconcile/invocations",
        query: "",
        headers: &signed,
    };
    assert_eq!(
        h("authorization"),
        authorization(&creds, lambda_emu::REGION, "lambda", &req, &sha256_hex(&payload), at)
    );
    let event: Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(event["source"], json!("poolmgr.wake"), "{event}");

    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-2")).await);
    assert_eq!(status, 200, "{body}");
    assert!(rx.try_recv().is_err(), "a second invoke within the debounce");
}

/// Issue 25 item 10: the reconcile function's concurrency is reserved (1), so an invoke while
/// a loop runs would be throttled, retried by Lambda for minutes and end in the dead-letter
/// queue. A claim that finds the loop lease held asks its holder to go on (one statement) and
/// invokes nothing; once no loop runs, the next claim invokes.
#[tokio::test]
async fn a_claim_on_lambda_asks_a_running_loop_to_go_on_instead_of_invoking_another() {
    let (app, emu, mut env) = claims_setup(2).await;
    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    let (addr, mut rx) = lambda_invoke_api().await;
    env.extend([
        ("POOLMGR_WAKE_LAMBDA_FUNCTION".to_owned(), "poolmgr-reconcile".to_owned()),
        ("POOLMGR_LAMBDA_ENDPOINT".to_owned(), format!("http://{addr}")),
        ("POOLMGR_WAKE_DEBOUNCE_MS".to_owned(), "0".to_owned()),
        ("AWS_ACCESS_KEY_ID".to_owned(), "ASIATESTWAKE".to_owned()),
        ("AWS_SECRET_ACCESS_KEY".to_owned(), "wake/secret".to_owned()),
    ]);
    // Force the moment: a loop elsewhere holds the lease.
    let holder = "loop-elsewhere";
    assert!(store::loop_take(&app.state.db.get().await.unwrap(), holder, 60.0).await.unwrap());
    let mut claims = emu.spawn(&function_bin("claims"), &env).unwrap();
    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 200, "{body}");
    assert!(rx.try_recv().is_err(), "an invoke went out while a loop runs:\n{}", claims.stderr());
    let lease = store::loop_renew(&app.state.db.get().await.unwrap(), holder, 60.0).await.unwrap().expect("held");
    assert!(lease.asked, "the claim asked the running loop to go on: {lease:?}");

    // The loop ends: the next claim's wake is an invoke.
    assert!(store::loop_release(&app.state.db.get().await.unwrap(), holder, true, None).await.unwrap());
    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-2")).await);
    assert_eq!(status, 200, "{body}");
    let (name, _, _) = rx.try_recv().unwrap_or_else(|_| panic!("no invoke without a loop:\n{}", claims.stderr()));
    assert_eq!(name, "poolmgr-reconcile");
}

/// The reconcile function as deployed: one scheduled invocation keeps passing until the VMs it
/// created are AVAILABLE, instead of leaving them to the next schedule a minute later. (The
/// emulator's timeout is 60 s, the template's 300 s: a shorter pass deadline and hook timeout
/// leave the loop the same room for passes before the invocation's deadline.)
#[tokio::test]
async fn one_scheduled_invocation_of_the_reconcile_function_fills_the_pool() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    let emu = Emulator::start("reconcile").await.unwrap();
    let (db_secret, mut env) = lambda_setup(&app);
    emu.extension.put_secret(DB_ARN, &db_secret);
    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    env.push(("POOLMGR_RECONCILE_LINGER_MS".into(), "200".into()));
    env.push(("POOLMGR_RECONCILE_LOOP_INTERVAL_MS".into(), "50".into()));
    env.push(("POOLMGR_RECONCILE_DEADLINE_SECONDS".into(), "10".into()));
    env.push(("POOLMGR_HOOK_TIMEOUT_SECONDS".into(), "5".into()));
    let mut reconcile = emu.spawn(&function_bin("reconcile"), &env).unwrap();
    let scheduled = include_str!("../../../functions/reconcile/events/scheduled.json");
    let report = invoke(&mut reconcile, scheduled).await.json();
    assert_eq!(report["total"]["created"], json!(2), "{report}");
    assert_eq!(report["total"]["available"], json!(2), "{report}");
    assert!(report["passes"].as_u64().unwrap() >= 2, "{report}");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2);
}
