//! The harness's typed reads are as strict as the untyped ones they replaced: a body that is
//! not exactly what its `api` type serializes to (an extra field, a `null` left out, another
//! timestamp format) fails the test. No database, no Router: bodies are built by hand.

use axum::http::{HeaderMap, StatusCode};
use chrono::{TimeZone, Utc};
use poolmgr_core::api::{ClaimResponse, ClaimedVm, HostInfo, LeaseRecord};
use poolmgr_tests::*;
use serde_json::{Value, json};

fn claim_body() -> Value {
    let at = Utc.with_ymd_and_hms(2025, 1, 2, 3, 4, 5).unwrap();
    serde_json::to_value(ClaimResponse {
        lease: LeaseRecord {
            lease_id: "l-1".into(),
            vm_uid: "u-1".into(),
            pool: pool("ci"),
            claimed_at: at,
            last_heartbeat_at: at,
            expires_at: at + chrono::Duration::seconds(120),
            request_id: None,
        },
        vm: ClaimedVm {
            id: "ci-1".into(),
            uid: "u-1".into(),
            flintlock_host: HostInfo { name: SIM_HOST.into(), address: "127.0.0.1:1".into() },
            network_interfaces: json!({}),
        },
        replayed: false,
    })
    .unwrap()
}

fn response(body: Value) -> TestResponse {
    TestResponse { status: StatusCode::OK, headers: HeaderMap::new(), body }
}

#[test]
fn a_body_that_is_exactly_the_type_reads_back_typed() {
    let body = claim_body();
    assert_eq!(body["lease"]["claimed_at"], json!("2025-01-02T03:04:05.000000Z"));
    let claim: ClaimResponse = response(body).json();
    assert_eq!((claim.lease.lease_id.as_str(), claim.lease.request_id.as_deref()), ("l-1", None));
    let lease: LeaseRecord = response(claim_body()).json_at("/lease");
    assert_eq!(lease, claim.lease);
}

#[test]
#[should_panic(expected = "is not exactly a")]
fn an_extra_field_fails_the_typed_read() {
    let mut body = claim_body();
    body["lease"]["colour"] = json!("blue");
    response(body).json::<ClaimResponse>();
}

#[test]
#[should_panic(expected = "is not exactly a")]
fn a_null_left_out_fails_the_typed_read() {
    let mut body = claim_body();
    body["lease"].as_object_mut().unwrap().remove("request_id");
    response(body).json_at::<LeaseRecord>("/lease");
}

#[test]
#[should_panic(expected = "is not exactly a")]
fn another_timestamp_format_fails_the_typed_read() {
    let mut body = claim_body();
    body["lease"]["expires_at"] = json!("2025-01-02T03:06:05+00:00");
    response(body).json::<ClaimResponse>();
}

#[test]
#[should_panic(expected = "is not a")]
fn a_wrong_type_fails_the_typed_read() {
    let mut body = claim_body();
    body["replayed"] = json!("false");
    response(body).json::<ClaimResponse>();
}

/// Issue 26 item 12: plain `cargo test` (no `POOLMGR_TEST_DATABASE_URL`) must neither pass nor
/// bury the cause under hundreds of panics: the first database test says to run
/// scripts/test.sh and ends the run with status 2. This runs this very test binary, one
/// database test selected, with the variable removed.
#[test]
fn plain_cargo_test_without_a_database_says_to_run_scripts_test_sh_and_fails() {
    let exe = std::env::current_exe().expect("this test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", "claims::claim_returns_lease_vm_and_host_from_stored_data", "--test-threads", "1"])
        .env_remove("POOLMGR_TEST_DATABASE_URL")
        .output()
        .expect("run the test binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("running 1 test"), "the test selected exists: {stdout}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("POOLMGR_TEST_DATABASE_URL is not set") && stderr.contains("scripts/test.sh"), "{stderr}");
    assert_eq!(stderr.matches("is not set").count(), 1, "said once: {stderr}");
}
