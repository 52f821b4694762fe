//! Waking the reconciler when something needs a pass now, not at the next schedule: a claim
//! (the pool may be below its target, its demand changed), a refused claim, a release (its VM
//! is replaced), a demand hint. On AWS an asynchronous Lambda Invoke of the reconcile
//! function (`X-Amz-Invocation-Type: Event`, signed with SigV4 from the function's own role
//! credentials); in `poolmgr-local` a signal to its ticker; in tests nothing unless a test
//! asks.
//!
//! A wake is a hint, never needed for correctness: the scheduled pass does the same work a
//! minute later. So it never fails its caller (a failed invoke is logged and counted), and an
//! HTTP function wakes at most once per `POOLMGR_WAKE_DEBOUNCE_MS` (1000): the invocation a
//! wake starts keeps passing for a linger longer than that (`reconcile::driver`), so a claim
//! whose wake was debounced is seen by the passes of the wake before it.
//!
//! The invoke is awaited (bounded by [`INVOKE_TIMEOUT`]) before the HTTP answer goes out: a
//! Lambda environment is frozen once it answered, and a request left in flight would leave
//! only on the next invocation, long after the claim that needed it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

/// The `source` of a wake's event (the schedule's is `aws.scheduler`).
pub const WAKE_SOURCE: &str = "poolmgr.wake";

/// How long a wake may hold up the answer that caused it.
pub const INVOKE_TIMEOUT: Duration = Duration::from_millis(1500);

/// Where a wake goes.
#[derive(Clone)]
enum Target {
    Off,
    Local(Arc<Notify>),
    Lambda(Arc<LambdaInvoke>),
}

/// Wakes the reconciler ([`Waker::wake`]); cheap to clone.
#[derive(Clone)]
pub struct Waker {
    target: Target,
    debounce: Duration,
    last: Arc<Mutex<Option<Instant>>>,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let target = match &self.target {
            Target::Off => "off".to_owned(),
            Target::Local(_) => "local".to_owned(),
            Target::Lambda(l) => format!("lambda:{}", l.function),
        };
        f.debug_struct("Waker").field("target", &target).field("debounce", &self.debounce).finish()
    }
}

impl Default for Waker {
    fn default() -> Waker {
        Waker::off()
    }
}

impl Waker {
    /// Wakes nobody: the schedule alone drives the reconciler.
    pub fn off() -> Waker {
        Waker { target: Target::Off, debounce: Duration::ZERO, last: Arc::default() }
    }

    /// Signals `notify` (poolmgr-local's ticker, a test's loop). Never debounced: a signal
    /// costs nothing and coalesces by itself.
    pub fn local(notify: Arc<Notify>) -> Waker {
        Waker { target: Target::Local(notify), debounce: Duration::ZERO, last: Arc::default() }
    }

    /// Invokes `invoke`'s function asynchronously, at most once per `debounce`.
    pub fn lambda(invoke: LambdaInvoke, debounce: Duration) -> Waker {
        Waker { target: Target::Lambda(Arc::new(invoke)), debounce, last: Arc::default() }
    }

    /// From the configuration: a Lambda invoke when `POOLMGR_WAKE_LAMBDA_FUNCTION` is set,
    /// else off (poolmgr-local replaces it with [`Waker::local`]).
    pub fn from_config(cfg: &crate::config::WakeConfig) -> Waker {
        match &cfg.lambda_function {
            Some(f) => Waker::lambda(LambdaInvoke::new(f, &cfg.region, cfg.lambda_endpoint.as_deref()), cfg.debounce),
            None => Waker::off(),
        }
    }

    /// The signal of a local waker: a loop waits on it between passes, so a wake cuts the wait.
    pub fn local_signal(&self) -> Option<Arc<Notify>> {
        match &self.target {
            Target::Local(n) => Some(n.clone()),
            _ => None,
        }
    }

    pub fn is_off(&self) -> bool {
        matches!(self.target, Target::Off)
    }

    /// Asks for a reconcile pass soon; `why` is logged. Never fails: a wake is a hint.
    /// Returns whether a wake went out (not debounced, not off, and accepted).
    ///
    /// On Lambda, `ask_holder` runs first (after the debounce): it asks a running loop to go
    /// on (`store::loop_ask`, [`crate::app::AppState::wake`]) and answers whether one was
    /// there. Then no invoke is sent: the holder's next pass sees the work, and an invocation
    /// started now would only join it, or, with the reconcile function's concurrency
    /// reserved (the template reserves 2), be throttled and retried by Lambda for minutes
    /// and end in the dead-letter queue. Elsewhere `ask_holder` is never polled.
    pub async fn wake(&self, why: &'static str, ask_holder: impl Future<Output = bool>) -> bool {
        match &self.target {
            Target::Off => false,
            Target::Local(n) => {
                n.notify_one();
                true
            }
            Target::Lambda(invoke) => {
                {
                    let mut last = self.last.lock().expect("wake debounce");
                    let now = Instant::now();
                    if last.is_some_and(|t| now.duration_since(t) < self.debounce) {
                        return false;
                    }
                    *last = Some(now);
                }
                if ask_holder.await {
                    tracing::debug!(why, "a reconcile loop is running: asked it to go on instead of invoking");
                    return true;
                }
                let outcome = match tokio::time::timeout(INVOKE_TIMEOUT, invoke.invoke_event(why)).await {
                    Ok(Ok(())) => {
                        tracing::debug!(why, function = %invoke.function, "reconciler woken");
                        return true;
                    }
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "timed out".to_owned(),
                };
                tracing::warn!(why, function = %invoke.function, error = %outcome, "could not wake the reconciler; the next wake or scheduled pass does the work");
                // A wake that did not go out covers nothing: the next one may go at once.
                *self.last.lock().expect("wake debounce") = None;
                false
            }
        }
    }
}

/// Why an invoke failed (logged only).
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    #[error("no AWS credentials in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")]
    NoCredentials,
    #[error("the Lambda Invoke API could not be reached: {0}")]
    Transport(String),
    #[error("the Lambda Invoke API answered {status}: {body}")]
    Refused { status: u16, body: String },
}

/// AWS credentials, as Lambda gives them to a function (its execution role's).
#[derive(Clone)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl Credentials {
    /// From `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN`, read at each
    /// invoke (never kept in the configuration, never logged).
    pub fn from_env() -> Option<Credentials> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Some(Credentials {
            access_key_id: var("AWS_ACCESS_KEY_ID")?,
            secret_access_key: var("AWS_SECRET_ACCESS_KEY")?,
            session_token: var("AWS_SESSION_TOKEN"),
        })
    }
}

/// An asynchronous invoke of one Lambda function through the Lambda Invoke API.
pub struct LambdaInvoke {
    client: reqwest::Client,
    /// `https://lambda.{region}.amazonaws.com`, or an override (`POOLMGR_LAMBDA_ENDPOINT`:
    /// tests, the deployed shape emulated by `lambda-emu schedule`).
    endpoint: String,
    function: String,
    region: String,
}

impl LambdaInvoke {
    pub fn new(function: &str, region: &str, endpoint: Option<&str>) -> LambdaInvoke {
        let endpoint = endpoint.map_or_else(|| format!("https://lambda.{region}.amazonaws.com"), str::to_owned);
        let client = reqwest::Client::builder().timeout(INVOKE_TIMEOUT).build().unwrap_or_default();
        LambdaInvoke {
            client,
            endpoint: endpoint.trim_end_matches('/').to_owned(),
            function: function.to_owned(),
            region: region.to_owned(),
        }
    }

    pub fn function(&self) -> &str {
        &self.function
    }

    /// `POST /2015-03-31/functions/{name}/invocations` with `X-Amz-Invocation-Type: Event`:
    /// Lambda queues the event and answers 202 at once.
    pub async fn invoke_event(&self, why: &str) -> Result<(), InvokeError> {
        let creds = Credentials::from_env().ok_or(InvokeError::NoCredentials)?;
        let body = serde_json::json!({"source": WAKE_SOURCE, "detail-type": why}).to_string();
        let name = uri_encode(&self.function);
        let path = format!("/2015-03-31/functions/{name}/invocations");
        let url = format!("{}{path}", self.endpoint);
        let host = host_of(&self.endpoint);
        let amz_date = Utc::now();
        let mut headers = vec![
            ("host", host),
            ("x-amz-date", amz_date_text(amz_date)),
            ("x-amz-invocation-type", "Event".to_owned()),
        ];
        if let Some(t) = &creds.session_token {
            headers.push(("x-amz-security-token", t.clone()));
        }
        // Lambda is not S3: the canonical URI is the path encoded once more.
        let auth = authorization(
            &creds,
            &self.region,
            "lambda",
            &Request { method: "POST", canonical_uri: &uri_encode_path(&path), query: "", headers: &headers },
            &sha256_hex(body.as_bytes()),
            amz_date,
        );
        let mut req = self.client.post(&url).header("authorization", auth).body(body);
        for (k, v) in &headers {
            if *k != "host" {
                req = req.header(*k, v);
            }
        }
        let resp = req.send().await.map_err(|e| InvokeError::Transport(e.to_string()))?;
        let status = resp.status().as_u16();
        if status == 202 {
            return Ok(());
        }
        let body = resp.text().await.unwrap_or_default();
        Err(InvokeError::Refused { status, body: crate::domain::printable(&body, 300, crate::domain::Keep::Head) })
    }
}

fn host_of(endpoint: &str) -> String {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    rest.split('/').next().unwrap_or(rest).to_owned()
}

/// The request parts SigV4 signs.
pub struct Request<'a> {
    pub method: &'a str,
    /// The canonical URI (for every service but S3: each path segment URI-encoded twice).
    pub canonical_uri: &'a str,
    /// The canonical query string (already sorted and encoded).
    pub query: &'a str,
    /// Every signed header, names in lowercase.
    pub headers: &'a [(&'a str, String)],
}

fn amz_date_text(t: DateTime<Utc>) -> String {
    t.format("%Y%m%dT%H%M%SZ").to_string()
}

/// The `Authorization` header of a request signed with AWS Signature Version 4.
pub fn authorization(
    creds: &Credentials,
    region: &str,
    service: &str,
    req: &Request<'_>,
    payload_sha256: &str,
    at: DateTime<Utc>,
) -> String {
    let mut headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.split_whitespace().collect::<Vec<_>>().join(" ")))
        .collect();
    headers.sort();
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    let signed = signed.join(";");
    let canonical = format!(
        "{}\n{}\n{}\n{canonical_headers}\n{signed}\n{payload_sha256}",
        req.method, req.canonical_uri, req.query
    );
    let date = at.format("%Y%m%d").to_string();
    let scope = format!("{date}/{region}/{service}/aws4_request");
    let to_sign = format!("AWS4-HMAC-SHA256\n{}\n{scope}\n{}", amz_date_text(at), sha256_hex(canonical.as_bytes()));
    let key = [date.as_str(), region, service, "aws4_request"]
        .iter()
        .fold(format!("AWS4{}", creds.secret_access_key).into_bytes(), |k, part| hmac_sha256(&k, part.as_bytes()));
    let signature = hex(&hmac_sha256(&key, to_sign.as_bytes()));
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
        creds.access_key_id
    )
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// URI-encodes everything but SigV4's unreserved characters (`A-Z a-z 0-9 - _ . ~`).
fn uri_encode(s: &str) -> String {
    const UNRESERVED: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
    percent_encoding::utf8_percent_encode(s, UNRESERVED).to_string()
}

/// Each segment of an (already encoded) path encoded again: SigV4's canonical URI.
fn uri_encode_path(path: &str) -> String {
    path.split('/').map(uri_encode).collect::<Vec<_>>().join("/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn example() -> Credentials {
        Credentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        }
    }

    fn at() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2015, 8, 30, 12, 36, 0).unwrap()
    }

    /// AWS's Signature Version 4 test suite: get-vanilla and post-vanilla.
    #[test]
    fn signatures_match_the_aws_test_suite() {
        let headers = [("Host", "example.amazonaws.com".to_owned()), ("X-Amz-Date", "20150830T123600Z".to_owned())];
        let empty = sha256_hex(b"");
        for (method, sig) in [
            ("GET", "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"),
            ("POST", "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"),
        ] {
            let req = Request { method, canonical_uri: "/", query: "", headers: &headers };
            let auth = authorization(&example(), "us-east-1", "service", &req, &empty, at());
            assert_eq!(
                auth,
                format!(
                    "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature={sig}"
                ),
                "{method}"
            );
        }
    }

    #[test]
    fn a_function_arn_is_encoded_in_the_path_and_twice_in_the_canonical_uri() {
        let name = uri_encode("arn:aws:lambda:eu-west-1:123456789012:function:reconcile");
        assert_eq!(name, "arn%3Aaws%3Alambda%3Aeu-west-1%3A123456789012%3Afunction%3Areconcile");
        let path = format!("/2015-03-31/functions/{name}/invocations");
        assert!(uri_encode_path(&path).contains("arn%253Aaws%253A"), "{}", uri_encode_path(&path));
        assert_eq!(
            uri_encode_path("/2015-03-31/functions/reconcile/invocations"),
            "/2015-03-31/functions/reconcile/invocations"
        );
        assert_eq!(host_of("http://127.0.0.1:9001/"), "127.0.0.1:9001");
        assert_eq!(host_of("https://lambda.eu-west-1.amazonaws.com"), "lambda.eu-west-1.amazonaws.com");
    }

    #[tokio::test]
    async fn a_local_waker_signals_and_an_off_one_does_nothing() {
        let n = Arc::new(Notify::new());
        assert!(Waker::local(n.clone()).wake("test", async { panic!("a local waker asks nobody") }).await);
        tokio::time::timeout(Duration::from_secs(1), n.notified()).await.expect("notified");
        assert!(!Waker::off().wake("test", async { panic!("an off waker asks nobody") }).await);
    }
}
