//! The CloudFormation custom-resource protocol, so a stack update runs the migration before it
//! updates the functions that need it (`infra/template.yaml`, resource `MigrateOnDeploy`).
//!
//! CloudFormation invokes the function with a request naming a pre-signed S3 `ResponseURL`
//! and waits for a JSON answer PUT there. Every request must be answered, success or not, or
//! the stack hangs until the resource's `ServiceTimeout`. Create and Update migrate; Delete
//! answers SUCCESS without touching the database: removing the resource (or the stack) never
//! drops a schema.
//!
//! The request and answer are `aws_lambda_events`' CloudFormation types; this module adds what
//! the protocol leaves to the function: which requests migrate, the physical id, the bounded
//! reason, and delivering the answer.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use aws_lambda_events::event::cloudformation::{
    CloudFormationCustomResourceRequest, CloudFormationCustomResourceResponse,
    CloudFormationCustomResourceResponseStatus,
};
use serde_json::Value;

/// A custom-resource request, as `aws_lambda_events` types it (resource properties untyped:
/// the migration reads none of them).
pub type Request = CloudFormationCustomResourceRequest;
/// What the function PUTs to `ResponseURL`.
pub type Response = CloudFormationCustomResourceResponse;

/// A plain invocation (`aws lambda invoke`, `cargo lambda invoke`) is `None`; an event that
/// looks like CloudFormation's is a request, or why it is malformed.
pub fn from_event(event: &Value) -> Option<Result<Request, String>> {
    if event.get("RequestType").is_none() || event.get("ResponseURL").is_none() {
        return None;
    }
    let parsed: Result<Request, String> =
        serde_json::from_value(event.clone()).map_err(|e| format!("malformed custom-resource request: {e}"));
    Some(parsed.and_then(|req| match common(&req) {
        Some(_) => Ok(req),
        None => Err("unsupported custom-resource request type: expected Create, Update or Delete".to_owned()),
    }))
}

/// What every request type carries, and whether it asks to migrate.
struct Common<'a> {
    migrate: bool,
    response_url: &'a str,
    stack_id: &'a str,
    request_id: &'a str,
    logical_resource_id: &'a str,
    /// `None` on Create: CloudFormation has not been told one yet.
    physical_resource_id: Option<&'a str>,
}

/// `None` for a request type CloudFormation may add later (the enum is non-exhaustive).
fn common(req: &Request) -> Option<Common<'_>> {
    Some(match req {
        Request::Create(r) => Common {
            migrate: true,
            response_url: &r.response_url,
            stack_id: &r.stack_id,
            request_id: &r.request_id,
            logical_resource_id: &r.logical_resource_id,
            physical_resource_id: None,
        },
        Request::Update(r) => Common {
            migrate: true,
            response_url: &r.response_url,
            stack_id: &r.stack_id,
            request_id: &r.request_id,
            logical_resource_id: &r.logical_resource_id,
            physical_resource_id: Some(&r.physical_resource_id),
        },
        Request::Delete(r) => Common {
            migrate: false,
            response_url: &r.response_url,
            stack_id: &r.stack_id,
            request_id: &r.request_id,
            logical_resource_id: &r.logical_resource_id,
            physical_resource_id: Some(&r.physical_resource_id),
        },
        _ => return None,
    })
}

/// CloudFormation refuses an answer over 4096 bytes: keep the reason well under that.
const MAX_REASON_CHARS: usize = 1000;

/// The resource id stays what CloudFormation knows, so an Update never looks like a
/// replacement (which would be followed by a Delete of the old id).
const PHYSICAL_ID: &str = "poolmgr-schema";

/// The answer to a request: SUCCESS with `data`, or FAILED with a bounded reason.
fn response(c: &Common<'_>, outcome: Result<HashMap<String, String>, String>) -> Response {
    let mut resp = Response::default();
    match outcome {
        Ok(data) => {
            resp.status = CloudFormationCustomResourceResponseStatus::Success;
            resp.reason = Some("ok".to_owned());
            resp.data = data;
        }
        Err(e) => {
            let mut reason: String = e.chars().take(MAX_REASON_CHARS).collect();
            reason.push_str(" (details in the migrate function's CloudWatch logs)");
            resp.status = CloudFormationCustomResourceResponseStatus::Failed;
            resp.reason = Some(reason);
        }
    }
    resp.physical_resource_id = c.physical_resource_id.unwrap_or(PHYSICAL_ID).to_owned();
    resp.stack_id = c.stack_id.to_owned();
    resp.request_id = c.request_id.to_owned();
    resp.logical_resource_id = c.logical_resource_id.to_owned();
    resp
}

/// Runs `migrate` for Create and Update (not Delete) and answers CloudFormation. `migrate`
/// returns the report of the plain invocation (`applied`, `schema_version`); its fields are
/// exposed as strings (`Fn::GetAtt MigrateOnDeploy.SchemaVersion`).
pub async fn handle<F, Fut>(req: Request, migrate: F) -> Result<Response, String>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Value, String>>,
{
    let c = common(&req).ok_or("unsupported custom-resource request type: expected Create, Update or Delete")?;
    tracing::info!(migrate = c.migrate, logical_resource_id = %c.logical_resource_id, "custom-resource request");
    let outcome = if c.migrate {
        migrate().await.map(|report| {
            let field = |k: &str| match report.get(k) {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            HashMap::from([
                ("SchemaVersion".to_owned(), field("schema_version")),
                ("Applied".to_owned(), field("applied")),
            ])
        })
    } else {
        Ok(HashMap::new())
    };
    if let Err(e) = &outcome {
        tracing::error!(error = %e, "migration failed; answering FAILED");
    }
    let resp = response(&c, outcome);
    send(c.response_url, &resp).await?;
    Ok(resp)
}

/// PUTs the answer to the pre-signed URL, retrying a few times: an unanswered request leaves
/// the stack waiting. No `Content-Type`: the URL was signed without one.
async fn send(url: &str, resp: &Response) -> Result<(), String> {
    let body = serde_json::to_string(resp).map_err(|e| format!("encoding the answer: {e}"))?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let mut last = String::new();
    for attempt in 1..=4u32 {
        match client.put(url).body(body.clone()).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("HTTP {}", r.status()),
            Err(e) => last = e.to_string(),
        }
        if attempt < 4 {
            tracing::warn!(attempt, error = %last, "cannot deliver the custom-resource answer, retrying");
            tokio::time::sleep(Duration::from_millis(500 * u64::from(attempt))).await;
        }
    }
    // The URL is a credential of sorts (pre-signed): log only its host.
    let host = reqwest::Url::parse(url).ok().and_then(|u| u.host_str().map(str::to_owned)).unwrap_or_default();
    Err(format!(
        "cannot deliver the custom-resource answer to {host}: {last}; is S3 reachable from the function's subnets (NAT or S3 gateway endpoint)?"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn event(request_type: &str, response_url: &str, physical: Option<&str>) -> Value {
        let mut e = json!({
            "RequestType": request_type,
            "ServiceToken": "arn:aws:lambda:eu-west-1:123456789012:function:poolmgr-migrate:live",
            "ResponseURL": response_url,
            "StackId": "arn:aws:cloudformation:eu-west-1:123456789012:stack/poolmgr/guid",
            "RequestId": "req-1",
            "LogicalResourceId": "MigrateOnDeploy",
            "ResourceType": "AWS::CloudFormation::CustomResource",
            "ResourceProperties": {"ServiceToken": "…", "FunctionVersion": "3"}
        });
        if let Some(p) = physical {
            e["PhysicalResourceId"] = json!(p);
        }
        if request_type == "Update" {
            e["OldResourceProperties"] = json!({"ServiceToken": "…", "FunctionVersion": "2"});
        }
        e
    }

    /// Accepts one PUT and records (request head, body); answers 200.
    async fn fake_s3() -> (String, Arc<Mutex<Option<(String, String)>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/cfn-response/key?X-Amz-Signature=abc", listener.local_addr().unwrap());
        let got = Arc::new(Mutex::new(None));
        let slot = got.clone();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut data = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = sock.read(&mut buf).await.unwrap();
                data.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&data).into_owned();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    if body.len() >= len {
                        *slot.lock().unwrap() = Some((head.to_owned(), body.to_owned()));
                        break;
                    }
                }
                if n == 0 {
                    break;
                }
            }
            let _ = sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
        });
        (url, got)
    }

    #[test]
    fn plain_invocations_are_not_custom_resource_requests() {
        assert!(from_event(&json!({})).is_none());
        assert!(from_event(&json!({"detail-type": "Scheduled Event"})).is_none());
        assert!(from_event(&json!({"RequestType": "Create", "ResponseURL": "u"})).unwrap().is_err());
        let req = from_event(&event("Update", "https://s3/x", Some("poolmgr-schema"))).unwrap().unwrap();
        let Request::Update(update) = req else { panic!("an Update request: {req:?}") };
        assert_eq!(update.physical_resource_id, "poolmgr-schema");
    }

    #[test]
    fn failures_carry_a_bounded_reason_and_keep_the_physical_id() {
        let req = from_event(&event("Create", "https://s3/x", None)).unwrap().unwrap();
        let resp = response(&common(&req).unwrap(), Err("x".repeat(5000)));
        assert_eq!(resp.status, CloudFormationCustomResourceResponseStatus::Failed);
        assert!(resp.reason.as_ref().unwrap().len() < 1100);
        assert_eq!(resp.physical_resource_id, "poolmgr-schema");
        assert!(serde_json::to_string(&resp).unwrap().len() < 4096);
    }

    #[tokio::test]
    async fn create_migrates_and_puts_success_to_the_response_url() {
        let (url, got) = fake_s3().await;
        let req = from_event(&event("Create", &url, None)).unwrap().unwrap();
        let resp = handle(req, || async { Ok(json!({"applied": [1, 2, 3], "schema_version": 3})) }).await.unwrap();
        assert_eq!(resp.status, CloudFormationCustomResourceResponseStatus::Success);
        let (head, body) = got.lock().unwrap().clone().expect("an answer was PUT");
        assert!(head.starts_with("PUT /cfn-response/key?X-Amz-Signature=abc HTTP/1.1"), "{head}");
        assert!(!head.to_ascii_lowercase().contains("content-type"), "signed without a content type: {head}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["Status"], "SUCCESS");
        assert_eq!(body["PhysicalResourceId"], "poolmgr-schema");
        assert_eq!(body["StackId"], "arn:aws:cloudformation:eu-west-1:123456789012:stack/poolmgr/guid");
        assert_eq!(body["RequestId"], "req-1");
        assert_eq!(body["LogicalResourceId"], "MigrateOnDeploy");
        assert_eq!(body["Data"], json!({"SchemaVersion": "3", "Applied": "[1,2,3]"}));
    }

    #[tokio::test]
    async fn a_failed_migration_is_answered_failed() {
        let (url, got) = fake_s3().await;
        let req = from_event(&event("Update", &url, Some("poolmgr-schema"))).unwrap().unwrap();
        let resp = handle(req, || async { Err("the database schema is at version 9".to_owned()) }).await.unwrap();
        assert_eq!(resp.status, CloudFormationCustomResourceResponseStatus::Failed);
        let body: Value = serde_json::from_str(&got.lock().unwrap().clone().unwrap().1).unwrap();
        assert_eq!(body["Status"], "FAILED");
        assert!(body["Reason"].as_str().unwrap().starts_with("the database schema is at version 9"));
    }

    #[tokio::test]
    async fn delete_answers_success_without_touching_the_database() {
        let (url, got) = fake_s3().await;
        let req = from_event(&event("Delete", &url, Some("poolmgr-schema"))).unwrap().unwrap();
        let resp = handle(req, || async { panic!("Delete must not migrate") as Result<Value, String> }).await.unwrap();
        assert_eq!(resp.status, CloudFormationCustomResourceResponseStatus::Success);
        assert!(got.lock().unwrap().is_some());
    }

    #[tokio::test]
    async fn an_unreachable_response_url_is_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/x", listener.local_addr().unwrap());
        drop(listener);
        let req = from_event(&event("Delete", &url, Some("poolmgr-schema"))).unwrap().unwrap();
        let err = handle(req, || async { Ok(json!({})) }).await.unwrap_err();
        assert!(err.contains("S3 reachable"), "{err}");
    }
}
