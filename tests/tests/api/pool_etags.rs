//! Pool ETags and conditional updates (issue 26 item 9): a pool answer carries an `ETag`
//! made of its spec version, and `PUT /v1/pools/{namespace}/{name}` with `If-Match` changes
//! the pool only while its spec is the one that ETag names — so two operators never overwrite
//! each other silently. Without `If-Match` a PUT is what it always was.

use std::sync::Arc;

use axum::http::Method;

use poolmgr_core::api;
use poolmgr_tests::*;
use serde_json::{Value, json};
use tokio::sync::Barrier;

const POOL_PATH: &str = "/v1/pools/default/ci";

/// The response's `ETag`, which every pool answer carries: a strong tag (quoted, no `W/`).
#[track_caller]
fn etag(r: &TestResponse) -> String {
    let e = r.headers.get("etag").unwrap_or_else(|| panic!("no ETag: {} {}", r.status, r.body));
    let e = e.to_str().unwrap().to_owned();
    assert!(e.len() > 2 && e.starts_with('"') && e.ends_with('"') && !e.contains("W/"), "{e}");
    e
}

async fn put_if(app: &TestApp, spec: Value, if_match: &str) -> TestResponse {
    app.request(Method::PUT, POOL_PATH, Some(ADMIN), Some(spec), &[("if-match", if_match)]).await
}

async fn current(app: &TestApp) -> (api::Pool, String) {
    let r = app.get(ADMIN, POOL_PATH).await;
    let p = r.assert_ok_response(200).json::<api::Pool>();
    (p, etag(&r))
}

#[tokio::test]
async fn pool_answers_carry_an_etag_that_changes_with_the_spec_and_not_with_the_status() {
    let app = TestApp::spawn().await;
    let r = app.post(ADMIN, "/v1/pools", pool_spec("ci", 2)).await;
    r.assert_ok(201);
    let created = etag(&r);
    let (_, read) = current(&app).await;
    assert_eq!(read, created, "GET answers the ETag the create did");
    // Status is not spec: VMs coming up change no ETag.
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    assert_eq!(current(&app).await.1, created);

    // An unconditional PUT (no If-Match) behaves as it always did, and answers the new ETag.
    let r = app.put(ADMIN, POOL_PATH, pool_spec("ci", 3)).await;
    assert_eq!(r.assert_ok_response(200).json::<api::Pool>().spec.size, 3);
    let after_put = etag(&r);
    assert_ne!(after_put, created);
    assert_eq!(current(&app).await.1, after_put);
    // Every PUT is a change of the spec: even one that writes the same spec again.
    let r = app.put(ADMIN, POOL_PATH, pool_spec("ci", 3)).await;
    r.assert_ok(200);
    assert_ne!(etag(&r), after_put);
    // Lists carry no ETag (it is a pool's, not a page's).
    assert!(app.get(ADMIN, "/v1/pools").await.headers.get("etag").is_none());
}

#[tokio::test]
async fn update_with_the_etag_it_read_succeeds_and_a_stale_one_is_412_and_changes_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let (_, read) = current(&app).await;

    let r = put_if(&app, pool_spec("ci", 2), &read).await;
    assert_eq!(r.assert_ok_response(200).json::<api::Pool>().spec.size, 2);
    let now = etag(&r);
    let events = app.count_events("POOL_UPDATED").await;

    // The same ETag again: someone (this test) changed the pool since it was read.
    let r = put_if(&app, pool_spec("ci", 5), &read).await;
    r.assert_reason(412, "FAILED_PRECONDITION", "ETAG_MISMATCH");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("default/ci") && msg.contains("GET it again"), "{msg}");
    let (p, e) = current(&app).await;
    assert_eq!((p.spec.size, e.as_str()), (2, now.as_str()), "the refused PUT changed nothing");
    assert_eq!(app.count_events("POOL_UPDATED").await, events, "and recorded nothing");
    // A weak tag never matches (If-Match compares strongly), nor does a tag this server never
    // made.
    put_if(&app, pool_spec("ci", 5), &format!("W/{now}")).await.assert_reason(
        412,
        "FAILED_PRECONDITION",
        "ETAG_MISMATCH",
    );
    put_if(&app, pool_spec("ci", 5), "\"abc\"").await.assert_reason(412, "FAILED_PRECONDITION", "ETAG_MISMATCH");
    assert_eq!(current(&app).await.0.spec.size, 2);

    // One of a list matching is enough; `*` asks only that the pool exists.
    let r = put_if(&app, pool_spec("ci", 3), &format!("{read}, {now}")).await;
    r.assert_ok(200);
    let r = put_if(&app, pool_spec("ci", 4), "*").await;
    assert_eq!(r.assert_ok_response(200).json::<api::Pool>().spec.size, 4);
    assert_eq!(current(&app).await.1, etag(&r));
}

#[tokio::test]
async fn an_if_match_tag_spelling_the_version_differently_is_412_only_the_exact_etag_matches() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let (_, e) = current(&app).await;
    let version = e.trim_matches('"');
    // Strong comparison is byte-for-byte on the opaque tag: "042" and "+42" are not "42".
    for other in [format!("\"0{version}\""), format!("\"+{version}\""), format!("\"00{version}\"")] {
        put_if(&app, pool_spec("ci", 2), &other).await.assert_reason(412, "FAILED_PRECONDITION", "ETAG_MISMATCH");
    }
    let (p, now) = current(&app).await;
    assert_eq!((p.spec.size, now.as_str()), (1, e.as_str()), "the refused PUTs changed nothing");
    let r = put_if(&app, pool_spec("ci", 2), &e).await;
    assert_eq!(r.assert_ok_response(200).json::<api::Pool>().spec.size, 2);
}

#[tokio::test]
async fn a_malformed_if_match_is_invalid_argument_and_changes_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let (before, e) = current(&app).await;
    let bare = e.trim_matches('"').to_owned();
    for bad in [bare.as_str(), "", "\"1", "\"1\" \"2\"", "*, \"1\"", "W/1"] {
        let r = put_if(&app, pool_spec("ci", 9), bad).await;
        r.assert_error(400, "INVALID_ARGUMENT");
        assert!(r.body["error"]["message"].as_str().unwrap().contains("If-Match"), "{bad:?}: {}", r.body);
    }
    assert_eq!(current(&app).await, (before, e));
}

#[tokio::test]
async fn what_is_refused_anyway_is_refused_for_that_reason_before_the_etag_is_compared() {
    let app = TestApp::spawn().await;
    // An unknown pool is 404, with or without an ETag.
    put_if(&app, pool_spec("ci", 1), "\"1\"").await.assert_error(404, "NOT_FOUND");
    put_if(&app, pool_spec("ci", 1), "*").await.assert_error(404, "NOT_FOUND");
    // A bad spec is 400 whatever the ETag.
    app.create_pool("ci", 1).await;
    let (_, e) = current(&app).await;
    put_if(&app, pool_spec("ci", -1), "\"0\"").await.assert_error(400, "INVALID_ARGUMENT");
    put_if(&app, pool_spec("other", 1), &e).await.assert_error(400, "INVALID_ARGUMENT");
    // A client token is refused before anything is read.
    let headers = [("if-match", e.as_str())];
    let r = app.request(Method::PUT, POOL_PATH, Some(CLIENT_A), Some(pool_spec("ci", 2)), &headers).await;
    r.assert_error(403, "PERMISSION_DENIED");
    assert_eq!(current(&app).await.0.spec.size, 1);
}

#[tokio::test]
async fn a_pool_deleted_and_created_again_does_not_match_its_namesakes_etag() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let (_, old) = current(&app).await;
    app.delete(ADMIN, POOL_PATH).await.assert_ok(204);
    let r = app.post(ADMIN, "/v1/pools", pool_spec("ci", 1)).await;
    r.assert_ok(201);
    assert_ne!(etag(&r), old);
    put_if(&app, pool_spec("ci", 7), &old).await.assert_reason(412, "FAILED_PRECONDITION", "ETAG_MISMATCH");
    assert_eq!(current(&app).await.0.spec.size, 1);
}

#[tokio::test]
async fn a_rollout_undo_changes_the_spec_and_so_the_etag() {
    let app = TestApp::spawn().await;
    let mut spec = pool_spec("ci", 1);
    spec["rollout"] = json!({"max_surge": 1});
    app.post(ADMIN, "/v1/pools", spec.clone()).await.assert_ok(201);
    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!("ghcr.io/x/runner:2");
    let r = app.put(ADMIN, POOL_PATH, spec.clone()).await;
    r.assert_ok(200);
    let before_undo = etag(&r);
    let r = app.post(ADMIN, &format!("{POOL_PATH}/rollout/undo"), json!({})).await;
    assert_eq!(r.assert_ok_response(200).json::<api::Pool>().revision, 1);
    let (_, after) = current(&app).await;
    assert_ne!(after, before_undo, "the undo put the old template back");
    // Whoever read the pool before the undo would overwrite it: refused.
    spec["size"] = json!(3);
    put_if(&app, spec.clone(), &before_undo).await.assert_reason(412, "FAILED_PRECONDITION", "ETAG_MISMATCH");
    // Pausing a rollout is status, not spec.
    app.post(ADMIN, &format!("{POOL_PATH}/rollout/pause"), json!(null)).await.assert_ok(200);
    assert_eq!(current(&app).await.1, after);
    put_if(&app, spec, &after).await.assert_ok(200);
}

/// The race: many admins read the same ETag and PUT at once. Exactly one wins; every other
/// gets 412 and changes nothing. Several rounds, released by a barrier.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_updates_from_one_etag_exactly_one_wins_and_the_rest_get_412() {
    const N: usize = 16;
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 1).await;
    for round in 0..4 {
        let (_, read) = current(&app).await;
        let events = app.count_events("POOL_UPDATED").await;
        let barrier = Arc::new(Barrier::new(N));
        let tasks: Vec<_> = (0..N)
            .map(|i| {
                let (app, barrier, read) = (app.clone(), barrier.clone(), read.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    // Each writer its own size, so the winner shows in the spec.
                    let size = i32::try_from(10 + i).unwrap();
                    (size, put_if(&app, pool_spec("ci", size), &read).await)
                })
            })
            .collect();
        let mut won = Vec::new();
        let mut refused = 0;
        for t in tasks {
            let (size, r) = t.await.unwrap();
            match r.status.as_u16() {
                200 => won.push((size, etag(&r))),
                412 => {
                    r.assert_reason(412, "FAILED_PRECONDITION", "ETAG_MISMATCH");
                    refused += 1;
                }
                other => panic!("round {round}: PUT answered {other}: {}", r.body),
            }
        }
        assert_eq!(won.len(), 1, "round {round}: exactly one winner: {won:?}");
        assert_eq!(refused, N - 1, "round {round}");
        let (p, now) = current(&app).await;
        assert_eq!((p.spec.size, now), won.pop().unwrap(), "round {round}: the pool is the winner's");
        assert_eq!(app.count_events("POOL_UPDATED").await, events + 1, "round {round}: one update recorded");
    }
}

/// The OpenAPI document states it: `If-Match` on the PUT, 412 among its answers, the `ETag`
/// header on the pool answers.
#[tokio::test]
async fn the_openapi_document_states_etags_and_if_match() {
    let app = TestApp::spawn().await;
    let doc = app.request(Method::GET, "/openapi.json", None, None, &[]).await;
    let item = &doc.assert_ok(200)["paths"]["/v1/pools/{namespace}/{name}"];
    let params = item["put"]["parameters"].as_array().unwrap();
    let if_match = params.iter().find(|p| p["name"] == json!("If-Match")).unwrap_or_else(|| panic!("{params:?}"));
    assert_eq!(if_match["in"], json!("header"));
    assert_ne!(if_match["required"], json!(true));
    assert!(item["put"]["responses"]["412"]["description"].as_str().unwrap().contains("ETAG_MISMATCH"));
    for (op, code) in [("get", "200"), ("put", "200")] {
        assert!(item[op]["responses"][code]["headers"]["ETag"].is_object(), "{op}: {}", item[op]);
    }
    let create = &doc.body["paths"]["/v1/pools"]["post"]["responses"]["201"];
    assert!(create["headers"]["ETag"].is_object(), "{create}");
}
