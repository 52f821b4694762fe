//! Issue 25 item 5: a process logging at trace writes no secret. Real processes with
//! `RUST_LOG=trace` (`poolmgr-local`, and the claims function under the emulated Lambda
//! Runtime API) are sent a bearer token and a host's `basic_auth_token`, and every line they
//! wrote is searched for them: tokio-postgres logs statement parameters at debug, the Lambda
//! runtime the raw event (its Authorization header) at trace, unless `telemetry` holds them
//! back.

use std::time::{Duration, Instant};

use base64::Engine as _;
use poolmgr_tests::local::LocalServer;
use poolmgr_tests::{ADMIN, CLIENT_A, SIM_HOST, pool_spec};
use serde_json::{Value, json};

use crate::lambda_lifecycle::{
    TOKENS_ARN, claim_event, claims_setup, function_bin, http_answer, invoke, tokens_secret,
};

/// The host's flintlock secret: a marker no log line may carry, raw or as it goes on the
/// wire (`authorization: Basic base64(token)`).
const HOST_SECRET: &str = "host-secret-Zq81xWv3";

/// Dependencies that log secrets below info, and must not whatever `RUST_LOG` says.
const QUIET_BELOW_INFO: &[&str] = &["tokio_postgres", "lambda_runtime", "lambda_http"];

/// Waits (at most 20 s) until `log()` holds the line that ends the `path` request
/// (tower-http's, at debug): every line the request wrote was read before it.
async fn wait_for_request_end(path: &str, log: impl Fn() -> Option<String>) -> String {
    let path = format!(r#""path":"{path}""#);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = log().expect("the whole log (nothing dropped)");
        if text.lines().any(|l| l.contains("finished processing request") && l.contains(&path)) {
            return text;
        }
        assert!(Instant::now() < deadline, "the end of {path} was never logged:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[track_caller]
fn assert_no_secret(log: &str, secrets: &[&str]) {
    for secret in secrets {
        if let Some(line) = log.lines().find(|l| l.contains(secret)) {
            panic!("a log line carries the secret {secret:?}:\n{line}");
        }
    }
    // The run logged below info: the absence above means something.
    assert!(log.contains(r#""level":"DEBUG""#), "no debug line at all: is RUST_LOG=trace in effect?\n{log}");
    // And what logs secrets below info (tokio-postgres's statement parameters, the raw
    // event) did not, even where no secret passed this time.
    for line in log.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        let (target, level) = (v["target"].as_str().unwrap_or(""), v["level"].as_str().unwrap_or(""));
        assert!(
            !(matches!(level, "DEBUG" | "TRACE") && QUIET_BELOW_INFO.iter().any(|p| target.starts_with(p))),
            "a pinned target logged below info:\n{line}"
        );
    }
}

#[tokio::test]
async fn poolmgr_local_at_trace_logs_neither_bearer_tokens_nor_host_secrets() {
    let s = LocalServer::start_with(&[("RUST_LOG", "trace")]).await;
    let http = reqwest::Client::new();
    let call = |method: reqwest::Method, token: &'static str, path: &str, body: Option<Value>| {
        let mut b = http.request(method, format!("{}{path}", s.endpoint)).bearer_auth(token);
        if let Some(v) = body {
            b = b.json(&v);
        }
        async move {
            let r = b.send().await.expect("an HTTP answer");
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };
    // A host with a secret (the INSERT carries it as a parameter), and a pool on it, so the
    // reconciler sends the secret to flintlock on every call.
    let host = json!({
        "name": SIM_HOST,
        "address": s.sim_server.addr.to_string(),
        "tls": {"insecure": true},
        "basic_auth_token": HOST_SECRET
    });
    let (status, body) = call(reqwest::Method::POST, ADMIN, "/v1/hosts", Some(host)).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = call(reqwest::Method::POST, ADMIN, "/v1/pools", Some(pool_spec("ci", 1))).await;
    assert_eq!(status, 201, "{body}");
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let (_, body) = call(reqwest::Method::GET, ADMIN, "/v1/pools/default/ci", None).await;
        let pool: Value = serde_json::from_str(&body).unwrap();
        if pool["status"]["available"] == json!(1) {
            break;
        }
        assert!(Instant::now() < deadline, "the pool never filled: {pool}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let claim = json!({"pool": {"namespace": "default", "name": "ci"}, "request_id": "job-1"});
    let (status, body) = call(reqwest::Method::POST, CLIENT_A, "/v1/claims", Some(claim)).await;
    assert_eq!(status, 200, "{body}");

    let log = wait_for_request_end("/v1/claims", || s.full_log()).await;
    let on_the_wire = base64::engine::general_purpose::STANDARD.encode(HOST_SECRET);
    assert_no_secret(&log, &[ADMIN, CLIENT_A, HOST_SECRET, &on_the_wire]);
}

#[tokio::test]
async fn the_claims_function_at_trace_logs_no_bearer_token() {
    let (_app, emu, mut env) = claims_setup(1).await;
    emu.extension.put_secret(TOKENS_ARN, &tokens_secret());
    env.retain(|(k, _)| k != "RUST_LOG");
    env.push(("RUST_LOG".into(), "trace".into()));
    let mut claims = emu.spawn(&function_bin("claims"), &env).unwrap();

    let (status, _, body) = http_answer(&invoke(&mut claims, claim_event("job-1")).await);
    assert_eq!(status, 200, "{body}");
    let log = wait_for_request_end("/v1/claims", || claims.full_stderr()).await;
    assert_no_secret(&log, &[CLIENT_A, ADMIN]);
}
