//! The emulated Lambda Invoke API: `POST /2015-03-31/functions/{name}/invocations`, as the
//! HTTP functions and the reconcile function call it to wake the reconciler.
//!
//! - `X-Amz-Invocation-Type: Event` → 202 and the payload queued for the function (Lambda's
//!   asynchronous invoke); `RequestResponse` (the default) → the function's answer, 200, with
//!   `X-Amz-Function-Error` on an error; `DryRun` → 204.
//! - The name may be the function's name or its ARN (encoded in the path), with or without
//!   the `:$LATEST` qualifier; anything else → 404 `ResourceNotFoundException`.
//! - No `Authorization: AWS4-HMAC-SHA256 …` header → 403 `MissingAuthenticationTokenException`.
//!   With credentials registered ([`InvokeApi::add_credentials`]) the signature is checked:
//!   an unknown access key → 403 `UnrecognizedClientException`, a wrong signature → 403
//!   `InvalidSignatureException`. With none registered, a well-formed header is accepted.
//!
//! Every request is recorded ([`InvokeApi::received`]) with its function, invocation type and
//! what its signature was, so a test can count the wakes it caused. The queue of each
//! function is drained by its owner ([`InvokeQueue::recv`]), one invocation at a time, as one
//! execution environment runs them. Never runs a function itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::{OriginalUri, Path as UrlPath, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::{ACCOUNT, Outcome, REGION, Server, sigv4};

/// How an invoke asked to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvocationType {
    Event,
    RequestResponse,
    DryRun,
}

impl InvocationType {
    fn parse(v: Option<&str>) -> Option<InvocationType> {
        match v.map(str::trim) {
            None | Some("RequestResponse") => Some(InvocationType::RequestResponse),
            Some("Event") => Some(InvocationType::Event),
            Some("DryRun") => Some(InvocationType::DryRun),
            Some(_) => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            InvocationType::Event => "Event",
            InvocationType::RequestResponse => "RequestResponse",
            InvocationType::DryRun => "DryRun",
        }
    }
}

/// What the request's signature was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signature {
    /// No `Authorization` header, or not an `AWS4-HMAC-SHA256` one.
    Missing,
    /// Well-formed, not checked (no credentials registered).
    Unchecked,
    /// Checked against the registered secret key: correct.
    Valid,
    /// Checked: wrong, or a signed header missing.
    Invalid,
    /// Its access key is not one of the registered ones.
    UnknownKey,
}

/// One request the API received.
#[derive(Debug, Clone)]
pub struct ReceivedInvoke {
    /// The function name or ARN as requested (decoded).
    pub function: String,
    /// The `X-Amz-Invocation-Type` header as sent (`None`: absent, which means RequestResponse).
    pub invocation_type: Option<String>,
    /// Whether it carried an `Authorization: AWS4-HMAC-SHA256 …` header.
    pub sigv4: bool,
    pub signature: Signature,
    pub access_key_id: Option<String>,
    /// Whether it carried `X-Amz-Security-Token` (temporary credentials, as Lambda's role has).
    pub security_token: bool,
    /// The status answered.
    pub status: u16,
    /// An Event merged into one already queued ([`InvokeApi::set_coalesce`]).
    pub coalesced: bool,
    pub payload: Bytes,
    pub at: Instant,
}

/// Where an invocation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Through the Invoke API.
    Invoke,
    /// [`InvokeApi::enqueue`] (a schedule).
    Schedule,
}

/// An invocation waiting for the function.
#[derive(Debug)]
pub struct Queued {
    pub payload: Bytes,
    pub invocation_type: InvocationType,
    pub source: Source,
    pub queued_at: Instant,
    /// For RequestResponse: where the answer goes (`Err`: why there is none).
    pub reply: Option<oneshot::Sender<Result<Outcome, String>>>,
}

struct FunctionQueue {
    tx: mpsc::UnboundedSender<Queued>,
    /// Events queued and not received yet: what coalescing looks at.
    pending_events: Arc<AtomicUsize>,
}

/// Where refused requests are reported ([`InvokeApi::set_log`]).
type Log = Arc<dyn Fn(String) + Send + Sync>;

struct InvokeShared {
    log: Mutex<Option<Log>>,
    functions: Mutex<HashMap<String, FunctionQueue>>,
    credentials: Mutex<HashMap<String, String>>,
    coalesce: std::sync::atomic::AtomicBool,
    received: Mutex<Vec<ReceivedInvoke>>,
}

/// The invocations queued for one function, in order.
pub struct InvokeQueue {
    rx: mpsc::UnboundedReceiver<Queued>,
    pending_events: Arc<AtomicUsize>,
}

impl InvokeQueue {
    /// The next invocation; `None` once the API is gone.
    pub async fn recv(&mut self) -> Option<Queued> {
        let q = self.rx.recv().await?;
        if q.invocation_type == InvocationType::Event {
            self.pending_events.fetch_sub(1, Ordering::SeqCst);
        }
        Some(q)
    }
}

/// The emulated Lambda Invoke API, stopped when dropped.
pub struct InvokeApi {
    server: Server,
    shared: Arc<InvokeShared>,
}

impl InvokeApi {
    /// Serves the Invoke API on `addr` (port 0: a free one); no function yet.
    pub async fn start(addr: SocketAddr) -> std::io::Result<InvokeApi> {
        let shared = Arc::new(InvokeShared {
            log: Mutex::new(None),
            functions: Mutex::new(HashMap::new()),
            credentials: Mutex::new(HashMap::new()),
            coalesce: Default::default(),
            received: Mutex::new(vec![]),
        });
        let app =
            Router::new().route("/2015-03-31/functions/{name}/invocations", post(invoke)).with_state(shared.clone());
        Ok(InvokeApi { server: Server::start_on(addr, app).await?, shared })
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// Makes `name` invokable; its invocations go to the returned queue.
    pub fn add_function(&self, name: &str) -> InvokeQueue {
        let (tx, rx) = mpsc::unbounded_channel();
        let pending_events = Arc::new(AtomicUsize::new(0));
        self.shared
            .functions
            .lock()
            .unwrap()
            .insert(name.to_owned(), FunctionQueue { tx, pending_events: pending_events.clone() });
        InvokeQueue { rx, pending_events }
    }

    /// Accepts requests signed with this key pair (and checks every signature from now on).
    pub fn add_credentials(&self, access_key_id: &str, secret_access_key: &str) {
        self.shared.credentials.lock().unwrap().insert(access_key_id.to_owned(), secret_access_key.to_owned());
    }

    /// When on, an Event for a function that already has an Event queued (not yet started)
    /// is answered 202 and merged into it, as a second environment's pass would have found
    /// nothing the first did not. Off by default: every Event is queued, as Lambda does.
    pub fn set_coalesce(&self, on: bool) {
        self.shared.coalesce.store(on, Ordering::SeqCst);
    }

    /// Queues an Event for `function` as a schedule does (coalesced like one from the API).
    /// Returns whether it was queued (`false`: coalesced, or no such function).
    pub fn enqueue(&self, function: &str, payload: impl Into<Bytes>) -> bool {
        queue_event(&self.shared, function, payload.into(), Source::Schedule) == Some(true)
    }

    /// Reports every refused request (4xx, 5xx) to `log`, one line each.
    pub fn set_log(&self, log: impl Fn(String) + Send + Sync + 'static) {
        *self.shared.log.lock().unwrap() = Some(Arc::new(log));
    }

    /// Every request received so far, in order.
    pub fn received(&self) -> Vec<ReceivedInvoke> {
        self.shared.received.lock().unwrap().clone()
    }
}

/// The registered function `requested` names: its name, or its ARN with an optional
/// `$LATEST` qualifier.
fn resolve(functions: &HashMap<String, FunctionQueue>, requested: &str) -> Option<String> {
    if functions.contains_key(requested) {
        return Some(requested.to_owned());
    }
    let rest = requested.strip_prefix(&format!("arn:aws:lambda:{REGION}:{ACCOUNT}:function:"))?;
    let name = rest.strip_suffix(":$LATEST").unwrap_or(rest);
    functions.contains_key(name).then(|| name.to_owned())
}

/// Queues an Event: `Some(true)` queued, `Some(false)` coalesced, `None` no such function.
fn queue_event(s: &InvokeShared, function: &str, payload: Bytes, source: Source) -> Option<bool> {
    let functions = s.functions.lock().unwrap();
    let q = functions.get(&resolve(&functions, function)?)?;
    if s.coalesce.load(Ordering::SeqCst) && q.pending_events.load(Ordering::SeqCst) > 0 {
        return Some(false);
    }
    q.pending_events.fetch_add(1, Ordering::SeqCst);
    let queued =
        Queued { payload, invocation_type: InvocationType::Event, source, queued_at: Instant::now(), reply: None };
    if q.tx.send(queued).is_err() {
        // Nobody drains this queue any more: the event is lost, as an environment that
        // never comes back loses it.
        q.pending_events.fetch_sub(1, Ordering::SeqCst);
    }
    Some(true)
}

/// An error as the Lambda API sends it: the type in `x-amzn-ErrorType` and in the body.
fn aws_error(status: StatusCode, error_type: &str, message: &str) -> Response {
    let body = json!({"__type": error_type, "Type": "User", "message": message});
    (status, [("x-amzn-errortype", error_type.to_owned())], axum::Json(body)).into_response()
}

async fn invoke(
    State(s): State<Arc<InvokeShared>>,
    UrlPath(name): UrlPath<String>,
    OriginalUri(uri): OriginalUri,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let invocation_type = header("x-amz-invocation-type");
    let auth = header("authorization").as_deref().and_then(sigv4::parse);
    let signature = match &auth {
        None => Signature::Missing,
        Some(a) => {
            let credentials = s.credentials.lock().unwrap().clone();
            if credentials.is_empty() {
                Signature::Unchecked
            } else {
                match credentials.get(&a.access_key_id) {
                    None => Signature::UnknownKey,
                    Some(secret) => {
                        let hs: Vec<(String, String)> = headers
                            .iter()
                            .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                            .collect();
                        let req = sigv4::Request {
                            method: method.as_str(),
                            path: uri.path(),
                            query: uri.query().unwrap_or(""),
                            headers: &hs,
                            body: &body,
                        };
                        match sigv4::signature(&req, a, secret) {
                            Some(sig) if sig == a.signature => Signature::Valid,
                            _ => Signature::Invalid,
                        }
                    }
                }
            }
        }
    };
    let mut record = ReceivedInvoke {
        function: name.clone(),
        invocation_type: invocation_type.clone(),
        sigv4: auth.is_some(),
        signature: signature.clone(),
        access_key_id: auth.as_ref().map(|a| a.access_key_id.clone()),
        security_token: headers.contains_key("x-amz-security-token"),
        status: 0,
        coalesced: false,
        payload: body.clone(),
        at: Instant::now(),
    };
    let (resp, coalesced) = answer(&s, &name, invocation_type.as_deref(), signature, body).await;
    record.status = resp.status().as_u16();
    record.coalesced = coalesced;
    if record.status >= 400
        && let Some(log) = s.log.lock().unwrap().clone()
    {
        let error_type = resp.headers().get("x-amzn-errortype").and_then(|v| v.to_str().ok()).unwrap_or("");
        log(format!(
            "invoke of {name:?} ({}) refused: {} {error_type} (signature {:?}, key {})",
            record.invocation_type.as_deref().unwrap_or("RequestResponse"),
            record.status,
            record.signature,
            record.access_key_id.as_deref().unwrap_or("none")
        ));
    }
    s.received.lock().unwrap().push(record);
    resp
}

async fn answer(
    s: &InvokeShared,
    name: &str,
    invocation_type: Option<&str>,
    signature: Signature,
    body: Bytes,
) -> (Response, bool) {
    match signature {
        Signature::Missing => {
            return (
                aws_error(StatusCode::FORBIDDEN, "MissingAuthenticationTokenException", "Missing Authentication Token"),
                false,
            );
        }
        Signature::UnknownKey => {
            let msg = "The security token included in the request is invalid.";
            return (aws_error(StatusCode::FORBIDDEN, "UnrecognizedClientException", msg), false);
        }
        Signature::Invalid => {
            let msg = "The request signature we calculated does not match the signature you provided.";
            return (aws_error(StatusCode::FORBIDDEN, "InvalidSignatureException", msg), false);
        }
        Signature::Valid | Signature::Unchecked => {}
    }
    let not_found = || {
        let msg = format!("Function not found: arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name}");
        aws_error(StatusCode::NOT_FOUND, "ResourceNotFoundException", &msg)
    };
    let Some(kind) = InvocationType::parse(invocation_type) else {
        let msg = format!(
            "1 validation error detected: Value '{}' at 'invocationType' failed to satisfy constraint: Member must satisfy enum value set: [Event, RequestResponse, DryRun]",
            invocation_type.unwrap_or("")
        );
        return (aws_error(StatusCode::BAD_REQUEST, "InvalidParameterValueException", &msg), false);
    };
    match kind {
        InvocationType::Event => match queue_event(s, name, body, Source::Invoke) {
            None => (not_found(), false),
            Some(queued) => (StatusCode::ACCEPTED.into_response(), !queued),
        },
        InvocationType::DryRun => {
            let known = resolve(&s.functions.lock().unwrap(), name).is_some();
            (if known { StatusCode::NO_CONTENT.into_response() } else { not_found() }, false)
        }
        InvocationType::RequestResponse => {
            let (tx, rx) = oneshot::channel();
            let sent = {
                let functions = s.functions.lock().unwrap();
                resolve(&functions, name).and_then(|n| functions.get(&n).map(|q| q.tx.clone())).map(|q| {
                    q.send(Queued {
                        payload: body,
                        invocation_type: kind,
                        source: Source::Invoke,
                        queued_at: Instant::now(),
                        reply: Some(tx),
                    })
                    .is_ok()
                })
            };
            match sent {
                None => (not_found(), false),
                Some(false) => (
                    aws_error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "ServiceException",
                        "the function's environment is gone",
                    ),
                    false,
                ),
                Some(true) => (sync_answer(rx.await), false),
            }
        }
    }
}

/// A RequestResponse answer: the function's result, or its error with `X-Amz-Function-Error`.
fn sync_answer(outcome: Result<Result<Outcome, String>, oneshot::error::RecvError>) -> Response {
    let executed = [("x-amz-executed-version", "$LATEST")];
    let unhandled = [("x-amz-function-error", "Unhandled")];
    let body = match outcome {
        Ok(Ok(Outcome::Response(b))) => return (StatusCode::OK, executed, b).into_response(),
        Ok(Ok(Outcome::Error { body, .. })) => body,
        Ok(Err(why)) => json!({"errorType": "Runtime.ExitError", "errorMessage": why}),
        Err(_) => json!({"errorType": "Runtime.ExitError", "errorMessage": "the invocation was dropped"}),
    };
    (StatusCode::OK, executed, unhandled, axum::Json::<Value>(body)).into_response()
}
