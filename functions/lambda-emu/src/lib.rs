//! An emulated AWS Lambda execution environment for the function binaries: the Lambda Runtime
//! API (`/2018-06-01/runtime/invocation/next`, `…/{id}/response`, `…/{id}/error`,
//! `/2018-06-01/runtime/init/error`) and the AWS Parameters and Secrets Lambda Extension
//! (`GET /secretsmanager/get?secretId=ARN` with the `X-Aws-Parameters-Secrets-Token` header).
//!
//! It is stricter than cargo-lambda's emulator where AWS is: the extension refuses every call
//! until the runtime has asked for its first event, because AWS documents the extension for
//! the INVOKE phase only, and a function that reads its secrets during INIT fails there. A
//! [`Function`] is a real binary started in an environment like Lambda's (`env_clear`, then
//! the `AWS_LAMBDA_*` variables, a session token and the extension's port), so a test or
//! `scripts/bench-cold-start.sh` drives exactly what `sam build` ships.
//!
//! It also emulates the Lambda Invoke API ([`InvokeApi`]: asynchronous `Event` invokes
//! queued for a function, SigV4 checked) and runs a function binary as one execution
//! environment fed by a schedule and by those invokes ([`schedule`]), the deployed shape of
//! the reconciler that `scripts/bench-demand.sh` drives.
//!
//! Tests use the library ([`Emulator`], [`Function::invoke`], [`http_event`], [`InvokeApi`]);
//! the `lambda-emu` binary measures cold starts with it and runs `lambda-emu schedule`. Never
//! used in production code.
//!
//! # Layout
//!
//! - this file: the Runtime API, the Parameters and Secrets extension, [`Emulator`] and
//!   [`Function`], [`http_event`];
//! - [`invoke`]: the Invoke API and the per-function queues;
//! - [`schedule`]: one execution environment draining a queue, restarted when it dies;
//! - [`sigv4`]: Signature Version 4, parsed, checked and made.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
pub use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

pub mod invoke;
pub mod schedule;
pub mod sigv4;

pub use invoke::{InvocationType, InvokeApi, InvokeQueue, Queued, ReceivedInvoke, Signature, Source};

/// The account and region the emulated environment pretends to be in.
pub const ACCOUNT: &str = "123456789012";
pub const REGION: &str = "eu-west-1";
/// Lines of a function's stderr kept for failure messages.
const KEPT_LINES: usize = 400;
/// Bytes of a function's stderr kept whole for [`Function::full_stderr`] (a test that scans
/// every line of a trace-level run for a secret needs all of them, not the last few).
const KEPT_BYTES: usize = 32 * 1024 * 1024;
/// An invocation's deadline unless the environment was started with another.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What the function answered to one invocation.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// `POST /2018-06-01/runtime/invocation/{id}/response`: the function's result.
    Response(Bytes),
    /// `POST /2018-06-01/runtime/invocation/{id}/error`: `errorType` (the body's, else the
    /// `Lambda-Runtime-Function-Error-Type` header) and the body.
    Error { error_type: String, body: Value },
}

impl Outcome {
    /// The response as JSON; panics with the outcome otherwise (for tests).
    #[track_caller]
    pub fn json(&self) -> Value {
        match self {
            Outcome::Response(b) => serde_json::from_slice(b)
                .unwrap_or_else(|e| panic!("the response is not JSON ({e}): {}", String::from_utf8_lossy(b))),
            Outcome::Error { error_type, body } => panic!("the function answered an error {error_type}: {body}"),
        }
    }
}

/// An answer and when the emulator received it.
#[derive(Debug, Clone)]
pub struct Answer {
    pub outcome: Outcome,
    pub at: Instant,
}

struct Pending {
    id: String,
    payload: Bytes,
    done: oneshot::Sender<Answer>,
}

struct RuntimeShared {
    function_name: String,
    queue_tx: mpsc::UnboundedSender<Pending>,
    /// One `/next` at a time takes the next invocation (Lambda runs one per environment).
    queue_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Pending>>,
    inflight: Mutex<HashMap<String, oneshot::Sender<Answer>>>,
    /// How many times `/next` was called: 0 while the function is still in INIT.
    next_calls: watch::Sender<u64>,
    /// When `/next` was first called: the end of INIT.
    first_next: Mutex<Option<Instant>>,
    init_errors: Mutex<Vec<Value>>,
    /// Each invocation's deadline, from when `/next` hands it out.
    timeout: Duration,
}

/// An HTTP server on a free loopback port, stopped when dropped.
struct Server {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Server {
    async fn start(app: Router) -> std::io::Result<Server> {
        Server::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), app).await
    }

    async fn start_on(addr: SocketAddr, app: Router) -> std::io::Result<Server> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Server { addr, task })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The emulated Lambda Runtime API of one execution environment.
pub struct RuntimeApi {
    server: Server,
    shared: Arc<RuntimeShared>,
}

impl RuntimeApi {
    /// Serves the Runtime API on a free loopback port for function `function_name`.
    pub async fn start(function_name: &str) -> std::io::Result<RuntimeApi> {
        RuntimeApi::start_with_timeout(function_name, DEFAULT_TIMEOUT).await
    }

    /// As [`RuntimeApi::start`], each invocation's deadline `timeout` after `/next` hands it out.
    pub async fn start_with_timeout(function_name: &str, timeout: Duration) -> std::io::Result<RuntimeApi> {
        let (queue_tx, queue_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(RuntimeShared {
            function_name: function_name.to_owned(),
            queue_tx,
            queue_rx: tokio::sync::Mutex::new(queue_rx),
            inflight: Mutex::new(HashMap::new()),
            next_calls: watch::Sender::new(0),
            first_next: Mutex::new(None),
            init_errors: Mutex::new(vec![]),
            timeout,
        });
        let app = Router::new()
            .route("/2018-06-01/runtime/invocation/next", get(next))
            .route("/2018-06-01/runtime/invocation/{id}/response", post(response))
            .route("/2018-06-01/runtime/invocation/{id}/error", post(invocation_error))
            .route("/2018-06-01/runtime/init/error", post(init_error))
            .with_state(shared.clone());
        Ok(RuntimeApi { server: Server::start(app).await?, shared })
    }

    /// `host:port`, the value of `AWS_LAMBDA_RUNTIME_API`.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// How many times the function asked for an event (0: it is still in INIT).
    pub fn next_calls(&self) -> u64 {
        *self.shared.next_calls.borrow()
    }

    /// What the function posted to `/runtime/init/error`.
    pub fn init_errors(&self) -> Vec<Value> {
        self.shared.init_errors.lock().unwrap().clone()
    }
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()
}

async fn next(State(s): State<Arc<RuntimeShared>>) -> Response {
    // From here on the environment is in INVOKE: the extension serves.
    s.first_next.lock().unwrap().get_or_insert_with(Instant::now);
    s.next_calls.send_modify(|n| *n += 1);
    let Some(p) = s.queue_rx.lock().await.recv().await else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the emulator is shutting down").into_response();
    };
    let deadline = now_ms() + s.timeout.as_millis();
    let arn = format!("arn:aws:lambda:{REGION}:{ACCOUNT}:function:{}", s.function_name);
    s.inflight.lock().unwrap().insert(p.id.clone(), p.done);
    let headers = [
        ("lambda-runtime-aws-request-id", p.id.clone()),
        ("lambda-runtime-deadline-ms", deadline.to_string()),
        ("lambda-runtime-invoked-function-arn", arn),
        ("lambda-runtime-trace-id", format!("Root=1-{:08x}-{};Sampled=0", now_ms() / 1000, &p.id[..24])),
        ("content-type", "application/json".to_owned()),
    ];
    let mut resp = p.payload.into_response();
    for (k, v) in headers {
        resp.headers_mut().insert(k, v.parse().expect("valid header value"));
    }
    resp
}

fn complete(s: &RuntimeShared, id: &str, outcome: Outcome) -> Response {
    let at = Instant::now();
    match s.inflight.lock().unwrap().remove(id) {
        Some(done) => {
            let _ = done.send(Answer { outcome, at });
            (StatusCode::ACCEPTED, axum::Json(json!({"status": "OK"}))).into_response()
        }
        None => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"errorMessage": format!("Invalid request ID: {id}"), "errorType": "InvalidRequestID"})),
        )
            .into_response(),
    }
}

async fn response(State(s): State<Arc<RuntimeShared>>, UrlPath(id): UrlPath<String>, body: Bytes) -> Response {
    complete(&s, &id, Outcome::Response(body))
}

fn error_body(headers: &HeaderMap, body: &Bytes) -> (String, Value) {
    let body: Value =
        serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()));
    // The body's `errorType` is what the invoker sees; the header is often just "unhandled".
    let error_type = body["errorType"]
        .as_str()
        .map(str::to_owned)
        .or_else(|| headers.get("lambda-runtime-function-error-type").and_then(|v| v.to_str().ok()).map(str::to_owned))
        .unwrap_or_default();
    (error_type, body)
}

async fn invocation_error(
    State(s): State<Arc<RuntimeShared>>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (error_type, body) = error_body(&headers, &body);
    complete(&s, &id, Outcome::Error { error_type, body })
}

async fn init_error(State(s): State<Arc<RuntimeShared>>, headers: HeaderMap, body: Bytes) -> Response {
    let (error_type, body) = error_body(&headers, &body);
    s.init_errors.lock().unwrap().push(json!({"error_type": error_type, "body": body}));
    (StatusCode::ACCEPTED, axum::Json(json!({"status": "OK"}))).into_response()
}

/// What the extension was asked, by outcome.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ExtensionCalls {
    /// Refused because the runtime had not asked for its first event yet (INIT).
    pub refused_in_init: u32,
    /// Answered with the secret.
    pub served: u32,
    /// Answered `ResourceNotFoundException` (no such secret).
    pub not_found: u32,
    /// Refused for a missing or wrong `X-Aws-Parameters-Secrets-Token`.
    pub unauthorized: u32,
}

struct ExtensionShared {
    token: String,
    secrets: Mutex<HashMap<String, String>>,
    calls: Mutex<ExtensionCalls>,
    /// The runtime's `/next` count: the extension serves once it is not 0.
    next_calls: watch::Receiver<u64>,
}

/// The emulated AWS Parameters and Secrets Lambda Extension (its Secrets Manager part).
pub struct SecretsExtension {
    server: Server,
    shared: Arc<ExtensionShared>,
}

impl SecretsExtension {
    /// Serves on a free loopback port; accepts `token` (the environment's
    /// `AWS_SESSION_TOKEN`) and refuses everything until `runtime` saw its first `/next`.
    pub async fn start(runtime: &RuntimeApi, token: &str) -> std::io::Result<SecretsExtension> {
        let shared = Arc::new(ExtensionShared {
            token: token.to_owned(),
            secrets: Mutex::new(HashMap::new()),
            calls: Mutex::new(ExtensionCalls::default()),
            next_calls: runtime.shared.next_calls.subscribe(),
        });
        let app = Router::new().route("/secretsmanager/get", get(get_secret)).with_state(shared.clone());
        Ok(SecretsExtension { server: Server::start(app).await?, shared })
    }

    pub fn port(&self) -> u16 {
        self.server.addr.port()
    }

    /// Stores (or replaces) secret `arn` with `secret_string`.
    pub fn put_secret(&self, arn: &str, secret_string: &str) {
        self.shared.secrets.lock().unwrap().insert(arn.to_owned(), secret_string.to_owned());
    }

    /// Removes secret `arn`: reads answer `ResourceNotFoundException`.
    pub fn remove_secret(&self, arn: &str) {
        self.shared.secrets.lock().unwrap().remove(arn);
    }

    pub fn calls(&self) -> ExtensionCalls {
        self.shared.calls.lock().unwrap().clone()
    }
}

async fn get_secret(
    State(s): State<Arc<ExtensionShared>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let count = |f: fn(&mut ExtensionCalls)| f(&mut s.calls.lock().unwrap());
    let token = headers.get("x-aws-parameters-secrets-token").and_then(|v| v.to_str().ok());
    if token != Some(s.token.as_str()) {
        count(|c| c.unauthorized += 1);
        return (StatusCode::UNAUTHORIZED, "missing or invalid X-Aws-Parameters-Secrets-Token").into_response();
    }
    if *s.next_calls.borrow() == 0 {
        // As AWS's extension: usable in the INVOKE phase only.
        count(|c| c.refused_in_init += 1);
        return (StatusCode::BAD_REQUEST, "not ready to serve traffic, please wait").into_response();
    }
    let Some(arn) = query.get("secretId") else {
        return (StatusCode::BAD_REQUEST, "secretId is required").into_response();
    };
    let secret = s.secrets.lock().unwrap().get(arn).cloned();
    match secret {
        Some(value) => {
            count(|c| c.served += 1);
            let name = arn.rsplit(':').next().unwrap_or(arn);
            axum::Json(json!({
                "ARN": arn,
                "Name": name,
                "SecretString": value,
                "VersionId": "00000000-0000-0000-0000-000000000001",
                "VersionStages": ["AWSCURRENT"],
                "CreatedDate": "2026-01-01T00:00:00.000Z",
            }))
            .into_response()
        }
        None => {
            count(|c| c.not_found += 1);
            (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({
                    "__type": "ResourceNotFoundException",
                    "message": "Secrets Manager can't find the specified secret."
                })),
            )
                .into_response()
        }
    }
}

/// A Runtime API and an extension for one execution environment.
pub struct Emulator {
    pub runtime: RuntimeApi,
    pub extension: SecretsExtension,
    session_token: String,
    /// The execution role's temporary credentials, as Lambda puts them in the environment.
    access_key_id: String,
    secret_access_key: String,
}

impl Emulator {
    pub async fn start(function_name: &str) -> std::io::Result<Emulator> {
        Emulator::start_with_timeout(function_name, DEFAULT_TIMEOUT).await
    }

    /// As [`Emulator::start`], with the function's timeout (each invocation's deadline).
    pub async fn start_with_timeout(function_name: &str, timeout: Duration) -> std::io::Result<Emulator> {
        let runtime = RuntimeApi::start_with_timeout(function_name, timeout).await?;
        let session_token = format!("emulated-session-{}", ulid::Ulid::generate());
        let extension = SecretsExtension::start(&runtime, &session_token).await?;
        let id = ulid::Ulid::generate().to_string();
        Ok(Emulator {
            runtime,
            extension,
            session_token,
            access_key_id: format!("ASIA{}", &id[10..]),
            secret_access_key: format!("emulated/{}", ulid::Ulid::generate()),
        })
    }

    /// The environment's `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (for
    /// [`InvokeApi::add_credentials`], so the function's own invokes are checked).
    pub fn credentials(&self) -> (&str, &str) {
        (&self.access_key_id, &self.secret_access_key)
    }

    /// The variables Lambda sets for a function, pointing at this emulator.
    pub fn lambda_env(&self) -> Vec<(String, String)> {
        let name = &self.runtime.shared.function_name;
        [
            ("AWS_LAMBDA_RUNTIME_API", self.runtime.addr().to_string()),
            ("AWS_LAMBDA_FUNCTION_NAME", name.clone()),
            ("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256".into()),
            ("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST".into()),
            ("AWS_LAMBDA_INITIALIZATION_TYPE", "on-demand".into()),
            ("AWS_LAMBDA_LOG_GROUP_NAME", format!("/aws/lambda/{name}")),
            ("AWS_LAMBDA_LOG_STREAM_NAME", "2026/01/01/[$LATEST]emulated".into()),
            ("AWS_REGION", REGION.into()),
            ("AWS_DEFAULT_REGION", REGION.into()),
            ("AWS_ACCESS_KEY_ID", self.access_key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_access_key.clone()),
            ("AWS_SESSION_TOKEN", self.session_token.clone()),
            ("PARAMETERS_SECRETS_EXTENSION_HTTP_PORT", self.extension.port().to_string()),
            ("TZ", ":UTC".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Starts `bin` as this environment's function: an empty environment, then
    /// [`Emulator::lambda_env`], then `env` (which wins).
    pub fn spawn(&self, bin: &Path, env: &[(String, String)]) -> std::io::Result<Function> {
        let mut cmd = tokio::process::Command::new(bin);
        cmd.env_clear()
            .envs(self.lambda_env())
            .envs(env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let started = Instant::now();
        let mut child = cmd.spawn()?;
        let output = Arc::new(Mutex::new(Vec::new()));
        let transcript = Arc::new(Mutex::new(Some(String::new())));
        let stderr = child.stderr.take().expect("stderr is piped");
        let (lines, all) = (output.clone(), transcript.clone());
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                {
                    let mut all = all.lock().unwrap();
                    if let Some(text) = all.as_mut() {
                        if text.len() + line.len() < KEPT_BYTES {
                            text.push_str(&line);
                            text.push('\n');
                        } else {
                            *all = None;
                        }
                    }
                }
                let mut lines = lines.lock().unwrap();
                if lines.len() == KEPT_LINES {
                    lines.remove(0);
                }
                lines.push(line);
            }
        });
        Ok(Function { child, started, output, transcript, runtime: self.runtime.shared.clone() })
    }
}

/// A function process.
pub struct Function {
    child: tokio::process::Child,
    started: Instant,
    output: Arc<Mutex<Vec<String>>>,
    /// Everything written to stderr, or `None` once it outgrew [`KEPT_BYTES`].
    transcript: Arc<Mutex<Option<String>>>,
    runtime: Arc<RuntimeShared>,
}

/// Why an invocation got no answer.
#[derive(Debug)]
pub enum NoAnswer {
    /// The process ended first (a crash, a failed start).
    Exited {
        status: ExitStatus,
        asked_for_events: u64,
        stderr: String,
    },
    TimedOut {
        after: Duration,
        stderr: String,
    },
}

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoAnswer::Exited { status, asked_for_events, stderr } => write!(
                f,
                "the function exited ({status}) without answering, after asking for {asked_for_events} event(s); \
                 its stderr:\n{stderr}"
            ),
            NoAnswer::TimedOut { after, stderr } => {
                write!(f, "the function did not answer within {after:?}; its stderr:\n{stderr}")
            }
        }
    }
}

impl Function {
    /// When the process was started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// When the function first asked for an event (the end of its INIT phase), if it did.
    pub fn init_done(&self) -> Option<Instant> {
        *self.runtime.first_next.lock().unwrap()
    }

    /// The last lines the function wrote to stderr (its logs).
    pub fn stderr(&self) -> String {
        self.output.lock().unwrap().join("\n")
    }

    /// Every line the function wrote to stderr so far, or `None` if that was more than
    /// 32 MiB (then no line is missing from an answer that is `Some`).
    pub fn full_stderr(&self) -> Option<String> {
        self.transcript.lock().unwrap().clone()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends one event and waits up to `timeout` for the answer, or for the process to end.
    pub async fn invoke(&mut self, payload: impl Into<Bytes>, timeout: Duration) -> Result<Answer, NoAnswer> {
        let (done, rx) = oneshot::channel();
        let id = ulid::Ulid::generate().to_string().to_lowercase();
        // The receiver lives in `runtime`, as long as the sender: sending cannot fail.
        let _ = self.runtime.queue_tx.send(Pending { id, payload: payload.into(), done });
        tokio::select! {
            answer = rx => Ok(answer.expect("the emulator keeps every invocation until it is answered")),
            status = self.child.wait() => {
                let status = status.expect("waiting for the function process");
                // Let the reader drain what the process wrote last.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(NoAnswer::Exited {
                    status,
                    asked_for_events: *self.runtime.next_calls.borrow(),
                    stderr: self.stderr(),
                })
            }
            _ = tokio::time::sleep(timeout) => Err(NoAnswer::TimedOut { after: timeout, stderr: self.stderr() }),
        }
    }

    /// Stops the process (SIGKILL, as Lambda does to an environment it reclaims).
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// An API Gateway HTTP API (payload format 2.0) event for `method` `path_and_query`, as the
/// template's `HttpApi` sends it to a function.
pub fn http_event(method: &str, path_and_query: &str, headers: &[(&str, &str)], body: Option<&str>) -> Value {
    let (path, query) = path_and_query.split_once('?').unwrap_or((path_and_query, ""));
    let mut header_map = serde_json::Map::new();
    header_map.insert("host".into(), json!("abcdef1234.execute-api.eu-west-1.amazonaws.com"));
    header_map.insert("user-agent".into(), json!("lambda-emu"));
    header_map.insert("x-forwarded-proto".into(), json!("https"));
    if body.is_some() {
        header_map.insert("content-type".into(), json!("application/json"));
    }
    for (k, v) in headers {
        header_map.insert(k.to_ascii_lowercase(), json!(v));
    }
    let mut query_map = serde_json::Map::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        query_map.insert(k.to_owned(), json!(v));
    }
    let now = now_ms();
    let mut event = json!({
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": query,
        "headers": header_map,
        "requestContext": {
            "accountId": ACCOUNT,
            "apiId": "abcdef1234",
            "domainName": "abcdef1234.execute-api.eu-west-1.amazonaws.com",
            "domainPrefix": "abcdef1234",
            "http": {"method": method, "path": path, "protocol": "HTTP/1.1", "sourceIp": "192.0.2.1", "userAgent": "lambda-emu"},
            "requestId": ulid::Ulid::generate().to_string(),
            "routeKey": "$default",
            "stage": "$default",
            "time": "01/Jan/2026:00:00:00 +0000",
            "timeEpoch": now as i64
        },
        "isBase64Encoded": false
    });
    if !query_map.is_empty() {
        event["queryStringParameters"] = Value::Object(query_map);
    }
    if let Some(b) = body {
        event["body"] = json!(b);
    }
    event
}
