//! The emulated Lambda Invoke API over real HTTP: what it answers, what it queues for the
//! function and what it records of each request.

use std::time::Duration;

use lambda_emu::{ACCOUNT, InvokeApi, InvokeQueue, Outcome, REGION, Signature, Source, sigv4};
use serde_json::{Value, json};

const KEY: &str = "ASIAEMULATEDTEST";
const SECRET: &str = "emulated/secret";

struct Signed<'a> {
    key: &'a str,
    secret: &'a str,
}

/// `POST /2015-03-31/functions/{name}/invocations` with `invocation_type` (if any), signed with
/// `signed` (if any), as the AWS SDKs and poolmgr's waker send it.
async fn invoke(
    api: &InvokeApi,
    name: &str,
    invocation_type: Option<&str>,
    signed: Option<Signed<'_>>,
    body: &str,
) -> (u16, reqwest::header::HeaderMap, String) {
    let encoded = sigv4::uri_encode(name);
    let path = format!("/2015-03-31/functions/{encoded}/invocations");
    let host = api.addr().to_string();
    let mut headers = vec![("host".to_owned(), host.clone()), ("x-amz-date".to_owned(), "20260101T000000Z".to_owned())];
    if let Some(t) = invocation_type {
        headers.push(("x-amz-invocation-type".to_owned(), t.to_owned()));
    }
    headers.push(("x-amz-security-token".to_owned(), "session".to_owned()));
    let mut req = reqwest::Client::new().post(format!("http://{host}{path}")).body(body.to_owned());
    if let Some(s) = signed {
        let r = sigv4::Request { method: "POST", path: &path, query: "", headers: &headers, body: body.as_bytes() };
        req = req.header("authorization", sigv4::sign(&r, s.key, s.secret, REGION, "lambda"));
    }
    for (k, v) in headers.iter().filter(|(k, _)| k != "host") {
        req = req.header(k, v);
    }
    let resp = req.send().await.expect("the Invoke API answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap())
}

fn ours() -> Option<Signed<'static>> {
    Some(Signed { key: KEY, secret: SECRET })
}

async fn api_with_reconcile() -> (InvokeApi, InvokeQueue) {
    let api = InvokeApi::start("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let queue = api.add_function("reconcile");
    api.add_credentials(KEY, SECRET);
    (api, queue)
}

/// What the queue holds right now, without waiting for more.
async fn drain(queue: &mut InvokeQueue) -> Vec<lambda_emu::Queued> {
    let mut out = vec![];
    while let Ok(Some(q)) = tokio::time::timeout(Duration::from_millis(50), queue.recv()).await {
        out.push(q);
    }
    out
}

#[tokio::test]
async fn a_signed_event_invoke_is_accepted_and_queued_for_its_function() {
    let (api, mut queue) = api_with_reconcile().await;
    let (status, _, body) = invoke(&api, "reconcile", Some("Event"), ours(), r#"{"source": "poolmgr.wake"}"#).await;
    assert_eq!(status, 202, "{body}");
    // By ARN (encoded in the path), with the qualifier: the same function.
    let arn = format!("arn:aws:lambda:{REGION}:{ACCOUNT}:function:reconcile:$LATEST");
    assert_eq!(invoke(&api, &arn, Some("Event"), ours(), "{}").await.0, 202);

    let queued = drain(&mut queue).await;
    assert_eq!(queued.len(), 2);
    assert_eq!(&queued[0].payload[..], br#"{"source": "poolmgr.wake"}"#);
    assert_eq!(queued[0].source, Source::Invoke);
    assert!(queued[0].reply.is_none(), "an Event has nobody waiting for its answer");

    let received = api.received();
    assert_eq!(received.len(), 2);
    let r = &received[0];
    assert_eq!(r.function, "reconcile");
    assert_eq!(r.invocation_type.as_deref(), Some("Event"));
    assert!(r.sigv4 && r.security_token);
    assert_eq!(r.signature, Signature::Valid);
    assert_eq!(r.access_key_id.as_deref(), Some(KEY));
    assert_eq!((r.status, r.coalesced), (202, false));
    assert_eq!(received[1].function, arn);
}

#[tokio::test]
async fn unknown_functions_are_404_resource_not_found() {
    let (api, mut queue) = api_with_reconcile().await;
    for name in ["claims", "arn:aws:lambda:eu-west-1:999999999999:function:reconcile"] {
        let (status, headers, body) = invoke(&api, name, Some("Event"), ours(), "{}").await;
        assert_eq!(status, 404, "{name}: {body}");
        assert_eq!(headers["x-amzn-errortype"], "ResourceNotFoundException");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["__type"], "ResourceNotFoundException");
        assert!(body["message"].as_str().unwrap().contains("Function not found"), "{body}");
    }
    assert!(drain(&mut queue).await.is_empty());
    assert_eq!(api.received().iter().map(|r| r.status).collect::<Vec<_>>(), [404, 404]);
}

#[tokio::test]
async fn requests_without_a_valid_signature_are_403_and_queue_nothing() {
    let (api, mut queue) = api_with_reconcile().await;
    let (status, headers, _) = invoke(&api, "reconcile", Some("Event"), None, "{}").await;
    assert_eq!(status, 403);
    assert_eq!(headers["x-amzn-errortype"], "MissingAuthenticationTokenException");
    let wrong = Some(Signed { key: KEY, secret: "not the secret" });
    let (status, headers, _) = invoke(&api, "reconcile", Some("Event"), wrong, "{}").await;
    assert_eq!(status, 403);
    assert_eq!(headers["x-amzn-errortype"], "InvalidSignatureException");
    let stranger = Some(Signed { key: "AKIDSTRANGER", secret: SECRET });
    let (status, headers, _) = invoke(&api, "reconcile", Some("Event"), stranger, "{}").await;
    assert_eq!(status, 403);
    assert_eq!(headers["x-amzn-errortype"], "UnrecognizedClientException");
    assert!(drain(&mut queue).await.is_empty());
    let seen: Vec<(bool, Signature)> = api.received().into_iter().map(|r| (r.sigv4, r.signature)).collect();
    assert_eq!(seen, [(false, Signature::Missing), (true, Signature::Invalid), (true, Signature::UnknownKey)]);
}

#[tokio::test]
async fn without_registered_credentials_any_well_formed_signature_passes_unchecked() {
    let api = InvokeApi::start("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut queue = api.add_function("reconcile");
    let anyone = Some(Signed { key: "AKIDANYONE", secret: "whatever" });
    assert_eq!(invoke(&api, "reconcile", Some("Event"), anyone, "{}").await.0, 202);
    assert_eq!(invoke(&api, "reconcile", Some("Event"), None, "{}").await.0, 403);
    assert_eq!(drain(&mut queue).await.len(), 1);
    assert_eq!(api.received()[0].signature, Signature::Unchecked);
}

#[tokio::test]
async fn coalescing_merges_an_event_into_the_one_still_queued() {
    let (api, mut queue) = api_with_reconcile().await;
    api.set_coalesce(true);
    for _ in 0..3 {
        assert_eq!(invoke(&api, "reconcile", Some("Event"), ours(), "{}").await.0, 202);
    }
    assert!(!api.enqueue("reconcile", "scheduled"), "the schedule's event merges too");
    assert_eq!(drain(&mut queue).await.len(), 1, "one event waited for the function");
    // Once the function took it, the next event queues again.
    assert!(api.enqueue("reconcile", "scheduled"));
    let next = drain(&mut queue).await;
    assert_eq!(next.len(), 1);
    assert_eq!((next[0].source, &next[0].payload[..]), (Source::Schedule, &b"scheduled"[..]));
    let coalesced: Vec<bool> = api.received().iter().map(|r| r.coalesced).collect();
    assert_eq!(coalesced, [false, true, true]);

    // Off (the default): every event is queued, as Lambda does.
    api.set_coalesce(false);
    for _ in 0..3 {
        assert_eq!(invoke(&api, "reconcile", Some("Event"), ours(), "{}").await.0, 202);
    }
    assert_eq!(drain(&mut queue).await.len(), 3);
}

#[tokio::test]
async fn a_request_response_invoke_waits_for_the_functions_answer() {
    let (api, mut queue) = api_with_reconcile().await;
    let function = tokio::spawn(async move {
        for answer in [Ok(Outcome::Response(r#"{"pools": 1}"#.into())), Err("the function exited".to_owned())] {
            let q = queue.recv().await.unwrap();
            q.reply.expect("someone waits for a RequestResponse").send(answer).unwrap();
        }
    });
    let (status, headers, body) = invoke(&api, "reconcile", None, ours(), "{}").await;
    assert_eq!((status, body.as_str()), (200, r#"{"pools": 1}"#));
    assert!(headers.get("x-amz-function-error").is_none());
    let (status, headers, body) = invoke(&api, "reconcile", Some("RequestResponse"), ours(), "{}").await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-amz-function-error"], "Unhandled");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["errorMessage"], json!("the function exited"));
    function.await.unwrap();

    assert_eq!(invoke(&api, "reconcile", Some("DryRun"), ours(), "").await.0, 204);
    assert_eq!(invoke(&api, "reconcile", Some("Sometimes"), ours(), "").await.0, 400);
}
