//! Fault injection for chaos runs and tests: `poolmgr-local` only, off unless its variable is
//! set. The Lambda functions never include this file, so no deployment can switch it on.
//!
//! `POOLMGR_LOCAL_FAULT_LOSE_CLAIM_ANSWER_EVERY=N` loses the answer of every N-th fresh claim
//! (1: every one) *after* the claim committed: the connection breaks instead of the 200
//! arriving. A client that retries with the same `request_id` gets the lease that claim
//! created (a replay, whose answer is never lost); one that retries without an id, or with a
//! new one, claims a second VM. Each loss is logged at WARN (`claim answer lost on purpose`)
//! with the lease and request id, so a chaos run can count them.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;

pub const LOSE_CLAIM_ANSWER_EVERY: &str = "POOLMGR_LOCAL_FAULT_LOSE_CLAIM_ANSWER_EVERY";

/// Reads the variable: `None` when unset or empty; an error for anything but a positive
/// integer.
pub fn lose_claim_answer_every(lookup: &impl Fn(&str) -> Option<String>) -> anyhow::Result<Option<u64>> {
    match lookup(LOSE_CLAIM_ANSWER_EVERY) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => anyhow::bail!("{LOSE_CLAIM_ANSWER_EVERY}={v:?}: use a whole number of at least 1, or unset it"),
        },
    }
}

/// Wraps `router` so that every `every`-th fresh claim (a 200 without `Idempotent-Replayed`)
/// loses its answer.
pub fn lose_claim_answers(router: Router, every: u64) -> Router {
    let fresh = Arc::new(AtomicU64::new(0));
    router.layer(axum::middleware::from_fn(move |req: Request, next: Next| {
        let fresh = fresh.clone();
        async move {
            let is_claim = req.method() == Method::POST && req.uri().path() == "/v1/claims";
            let resp = next.run(req).await;
            let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            if !is_claim || resp.status() != 200 || replayed {
                return resp;
            }
            let n = fresh.fetch_add(1, Ordering::Relaxed) + 1;
            if !n.is_multiple_of(every) {
                return resp;
            }
            // The claim has committed: the handler returned. Read what it answered (for the
            // log), then send a body that fails, which makes hyper close the connection with
            // the answer incomplete.
            let (_, body) = resp.into_parts();
            let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            tracing::warn!(
                lease_id = %v["lease"]["lease_id"].as_str().unwrap_or(""),
                request_id = %v["lease"]["request_id"].as_str().unwrap_or(""),
                fresh_claims = n,
                "claim answer lost on purpose ({LOSE_CLAIM_ANSWER_EVERY}={every})"
            );
            let lost = failing_body(io::Error::new(io::ErrorKind::ConnectionAborted, "answer lost on purpose"));
            Response::builder().status(200).body(lost).expect("a valid response")
        }
    }))
}

/// A body whose first frame is `err`.
fn failing_body(err: io::Error) -> Body {
    Body::from_stream(futures::stream::once(async move { Err::<bytes::Bytes, io::Error>(err) }))
}
