//! The HTTP layer: [`Client`] (endpoint, token, time-outs, trusted roots, retry policy), one
//! [`Call`] constructor per route (the one place each route's method, path and query are
//! written), one typed method per route, [`Client::send`] for callers that want the answer's
//! bytes as the server sent them, and [`Pages`] for the paginated lists.
//!
//! Retries here are only those of calls that are safe to repeat ([`Call::is_idempotent`]:
//! GETs, heartbeats, releases), bounded by the [`RetryPolicy`]. Must never repeat another
//! write: a retried create or update could apply twice; the claim's retrying is
//! [`crate::claim`]'s, with one `request_id`.

use std::collections::{HashSet, VecDeque};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use reqwest::{Method, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::error::{ApiError, Error, Status, TransportKind};
use crate::retry::RetryPolicy;
use crate::types::*;

/// The default limit of one request.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The default limit of opening a connection (TCP and TLS handshakes): short, so an endpoint
/// that does not answer fails fast instead of using the whole request time-out.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest page asked for when every page is read (the server's maximum).
const ALL_PAGES_SIZE: i64 = 1000;

/// A poolmgr endpoint with a token. Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    token: Option<String>,
    timeout: Duration,
    retry: RetryPolicy,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Client")
            .field("endpoint", &self.base.as_str())
            .field("timeout", &self.timeout)
            .field("retry", &self.retry)
            .finish()
    }
}

/// A certificate authority to trust on top of the TLS backend's roots.
#[derive(Debug, Clone)]
enum ExtraRoot {
    /// PEM text given directly (one or more certificates).
    Pem(Vec<u8>),
    /// A PEM file, read when the client is built.
    File(PathBuf),
}

/// Builds a [`Client`]: `Client::builder(endpoint).token(t).build()`.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    endpoint: String,
    token: Option<String>,
    timeout: Duration,
    connect_timeout: Duration,
    user_agent: String,
    roots: Vec<ExtraRoot>,
    retry: RetryPolicy,
}

impl ClientBuilder {
    /// Sent as `Authorization: Bearer <token>`; an empty token sends none.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into()).filter(|t: &String| !t.is_empty());
        self
    }

    /// Limit of one request, from connecting to the last byte of the answer (default 30 s).
    /// Long-polls add their wait. A claim's attempts are also cut at its deadline.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Limit of opening a connection, TLS handshake included (default 5 s, and never more
    /// than [`ClientBuilder::timeout`]).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The `User-Agent` header (default `poolmgr-client/VERSION`).
    pub fn user_agent(mut self, ua: impl Into<String>) -> Self {
        self.user_agent = ua.into();
        self
    }

    /// Trusts the certificate authorities of this PEM file (one or more certificates), on
    /// top of the TLS backend's roots (the platform's trust store by default): for an
    /// endpoint whose certificate a private CA signed. Read by [`ClientBuilder::build`].
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.roots.push(ExtraRoot::File(path.into()));
        self
    }

    /// As [`ClientBuilder::ca_file`], with the PEM text itself.
    pub fn add_root_certificate(mut self, pem: impl AsRef<[u8]>) -> Self {
        self.roots.push(ExtraRoot::Pem(pem.as_ref().to_vec()));
        self
    }

    /// How calls that are safe to repeat are retried (default [`RetryPolicy::default`]: 3
    /// attempts; [`RetryPolicy::none`] for one).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// The client; fails on an endpoint that is not an http(s) URL, an `https://` endpoint
    /// when the crate was built without a TLS feature, a zero time-out, or a CA file that
    /// cannot be read or holds no certificate.
    pub fn build(self) -> Result<Client, Error> {
        let endpoint = self.endpoint.trim();
        let base = Url::parse(endpoint)
            .map_err(|e| Error::InvalidInput(format!("endpoint {endpoint:?} is not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() || base.host().is_none() {
            return Err(Error::InvalidInput(format!(
                "endpoint {endpoint:?} must be an http:// or https:// URL, e.g. http://127.0.0.1:8080"
            )));
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::InvalidInput("the time-outs must be more than 0".into()));
        }
        check_tls_available(&base, endpoint)?;
        let b = reqwest::Client::builder()
            .user_agent(self.user_agent)
            .connect_timeout(self.connect_timeout.min(self.timeout));
        let b = add_roots(b, &self.roots)?;
        let http =
            b.build().map_err(|e| Error::InvalidInput(format!("cannot build the HTTP client: {}", chain(&e))))?;
        Ok(Client { http, base, token: self.token, timeout: self.timeout, retry: self.retry })
    }
}

/// Whether the client was built with a TLS backend (one of the TLS features).
pub(crate) const TLS: bool =
    cfg!(any(feature = "rustls-native-roots", feature = "rustls-webpki-roots", feature = "native-tls"));

/// Without a TLS feature an `https://` endpoint could only fail at the first request: refused
/// when the client is built instead, naming the features that would make it work.
fn check_tls_available(base: &Url, endpoint: &str) -> Result<(), Error> {
    if base.scheme() == "https" && !TLS {
        return Err(Error::InvalidInput(format!(
            "endpoint {endpoint:?} is https://, but poolmgr-client was built without a TLS feature: \
             enable one of rustls-native-roots, rustls-webpki-roots or native-tls"
        )));
    }
    Ok(())
}

/// The PEM text of an extra root and where it came from, for messages.
fn read_root(root: &ExtraRoot) -> Result<(Vec<u8>, String), Error> {
    match root {
        ExtraRoot::Pem(p) => Ok((p.clone(), "the root certificate given".to_owned())),
        ExtraRoot::File(f) => std::fs::read(f)
            .map(|p| (p, format!("CA file {}", f.display())))
            .map_err(|e| Error::InvalidInput(format!("cannot read the CA file {}: {e}", f.display()))),
    }
}

#[cfg(any(feature = "rustls-native-roots", feature = "rustls-webpki-roots", feature = "native-tls"))]
fn add_roots(mut b: reqwest::ClientBuilder, roots: &[ExtraRoot]) -> Result<reqwest::ClientBuilder, Error> {
    for root in roots {
        let (pem, what) = read_root(root)?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| Error::InvalidInput(format!("{what} is not PEM certificates: {}", chain(&e))))?;
        if certs.is_empty() {
            return Err(Error::InvalidInput(format!("{what} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")));
        }
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    Ok(b)
}

#[cfg(not(any(feature = "rustls-native-roots", feature = "rustls-webpki-roots", feature = "native-tls")))]
fn add_roots(b: reqwest::ClientBuilder, roots: &[ExtraRoot]) -> Result<reqwest::ClientBuilder, Error> {
    match roots.first() {
        Some(r) => Err(Error::InvalidInput(format!(
            "{} cannot be used: poolmgr-client was built without a TLS feature",
            read_root(r)?.1
        ))),
        None => Ok(b),
    }
}

/// One request of the contract: method, path segments (each escaped), query, JSON body.
///
/// Each route this crate models has its constructor ([`Call::get_pool`], [`Call::claim`],
/// …). For one it does not (a route a newer server added), build the call from its parts
/// with [`Call::new`] and send it with [`Client::send`]:
///
/// ```no_run
/// use poolmgr_client::{Call, Client, Method};
///
/// # async fn run(client: &Client) -> Result<(), poolmgr_client::Error> {
/// let call = Call::new(Method::POST, &["v1", "pools", "default", "ci", "drain"])
///     .with_query("dry_run", true)
///     .with_body(serde_json::json!({ "reason": "maintenance" }));
/// let reply = client.send(call).await?;
/// let answer: serde_json::Value = reply.json()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Call {
    /// The HTTP method.
    pub method: Method,
    /// The path's segments under the endpoint, unescaped.
    pub path: Vec<String>,
    /// The query's pairs, unescaped.
    pub query: Vec<(&'static str, String)>,
    /// The JSON body, if any.
    pub body: Option<serde_json::Value>,
    /// Added to the client's time-out (long-polls).
    pub extra_timeout: Duration,
    /// `If-Match` ([`Call::if_match`]): a conditional update.
    pub if_match: Option<String>,
}

fn body<T: Serialize>(v: &T) -> Option<serde_json::Value> {
    Some(serde_json::to_value(v).expect("contract objects serialize"))
}

impl Call {
    /// A call of `method` on the path made of `path`'s segments under the endpoint (each
    /// escaped, so a segment may hold `/`: `&["v1", "vms", id]`), with no query and no body.
    /// Add them with [`Call::with_query`] and [`Call::with_body`]. Whether [`Client::send`]
    /// retries it is [`Call::is_idempotent`]'s answer: a GET is retried, a POST is not.
    pub fn new(method: Method, path: &[&str]) -> Call {
        Call {
            method,
            path: path.iter().map(|s| s.to_string()).collect(),
            query: Vec::new(),
            body: None,
            extra_timeout: Duration::ZERO,
            if_match: None,
        }
    }

    /// The same call, conditional on `etag` (sent as `If-Match`): an update refused with 412
    /// FAILED_PRECONDITION when the object changed since that ETag was read
    /// ([`Reply::etag`]).
    pub fn if_match(mut self, etag: impl Into<String>) -> Call {
        self.if_match = Some(etag.into());
        self
    }

    fn query(mut self, key: &'static str, value: impl ToString) -> Call {
        self.query.push((key, value.to_string()));
        self
    }

    /// The same call with query parameter `key` set to `value` (replacing any it had).
    pub fn with_query(mut self, key: &'static str, value: impl ToString) -> Call {
        self.query.retain(|(k, _)| *k != key);
        self.query(key, value)
    }

    /// The same call with `body` as its JSON body (replacing any it had).
    pub fn with_body(mut self, body: serde_json::Value) -> Call {
        self.body = Some(body);
        self
    }

    /// The same call with `extra` added to the client's time-out (a long-poll's wait).
    pub fn with_extra_timeout(mut self, extra: Duration) -> Call {
        self.extra_timeout = extra;
        self
    }

    /// Whether sending this call twice has the effect of sending it once, so a transient
    /// failure may be retried without a `request_id`: every GET; a heartbeat (it only moves
    /// `expires_at`); a release (`DELETE /v1/leases/{id}`: a repeat finds the lease gone,
    /// which [`Client::send`] and [`Client::release`] count as released after an attempt that
    /// may have taken effect). Creates,
    /// updates, deletes of pools, hosts and VMs, and claims are not.
    pub fn is_idempotent(&self) -> bool {
        let p: Vec<&str> = self.path.iter().map(String::as_str).collect();
        match (&self.method, p.as_slice()) {
            (m, _) if *m == Method::GET || *m == Method::HEAD => true,
            (m, ["v1", "leases", _, "heartbeat"]) if *m == Method::POST => true,
            (m, ["v1", "leases", _]) if *m == Method::DELETE => true,
            _ => false,
        }
    }

    /// Whether this is a lease's release (`DELETE /v1/leases/{id}`), whose NOT_FOUND after an
    /// attempt that may have taken effect means released ([`Client::send`]).
    pub fn is_lease_release(&self) -> bool {
        self.method == Method::DELETE && matches!(self.path.as_slice(), [v, l, _] if v == "v1" && l == "leases")
    }

    fn pool_filter(self, pool: Option<&PoolRef>) -> Call {
        match pool {
            Some(p) => self.query("namespace", &p.namespace).query("pool", &p.name),
            None => self,
        }
    }

    /// `POST /v1/claims`.
    pub fn claim(req: &ClaimRequest) -> Call {
        Call { body: body(req), ..Call::new(Method::POST, &["v1", "claims"]) }
    }

    /// `GET /v1/leases/{lease_id}`.
    pub fn get_lease(lease_id: &str) -> Call {
        Call::new(Method::GET, &["v1", "leases", lease_id])
    }

    /// `POST /v1/leases/{lease_id}/heartbeat`.
    pub fn heartbeat(lease_id: &str) -> Call {
        Call::new(Method::POST, &["v1", "leases", lease_id, "heartbeat"])
    }

    /// `DELETE /v1/leases/{lease_id}`.
    pub fn release(lease_id: &str) -> Call {
        Call::new(Method::DELETE, &["v1", "leases", lease_id])
    }

    /// `GET /v1/leases`.
    pub fn list_leases(q: &LeaseQuery) -> Call {
        let mut c = Call::new(Method::GET, &["v1", "leases"]).pool_filter(q.pool.as_ref());
        if let Some(n) = q.page_size {
            c = c.query("page_size", n);
        }
        if let Some(t) = q.page_token.as_deref().filter(|t| !t.is_empty()) {
            c = c.query("page_token", t);
        }
        c
    }

    /// `POST /v1/pools`.
    pub fn create_pool(spec: &PoolSpec) -> Call {
        Call { body: body(spec), ..Call::new(Method::POST, &["v1", "pools"]) }
    }

    /// `PUT /v1/pools/{namespace}/{name}`: the pool the spec names.
    pub fn update_pool(spec: &PoolSpec) -> Call {
        let p = spec.pool_ref();
        Call { body: body(spec), ..Call::new(Method::PUT, &["v1", "pools", &p.namespace, &p.name]) }
    }

    /// `GET /v1/pools/{namespace}/{name}`.
    pub fn get_pool(p: &PoolRef) -> Call {
        Call::new(Method::GET, &["v1", "pools", &p.namespace, &p.name])
    }

    /// `GET /v1/pools?namespace=`.
    pub fn list_pools(namespace: Option<&str>) -> Call {
        let c = Call::new(Method::GET, &["v1", "pools"]);
        match namespace {
            Some(ns) => c.query("namespace", ns),
            None => c,
        }
    }

    /// `POST /v1/pools/{namespace}/{name}/expect`.
    pub fn expect(p: &PoolRef, req: &ExpectRequest) -> Call {
        Call { body: body(req), ..Call::new(Method::POST, &["v1", "pools", &p.namespace, &p.name, "expect"]) }
    }

    /// `GET /v1/pools/{namespace}/{name}/revisions`.
    pub fn pool_revisions(p: &PoolRef) -> Call {
        Call::new(Method::GET, &["v1", "pools", &p.namespace, &p.name, "revisions"])
    }

    /// `POST /v1/pools/{namespace}/{name}/rollout/pause` (`pause`) or `…/resume`.
    pub fn rollout_pause(p: &PoolRef, pause: bool) -> Call {
        let action = if pause { "pause" } else { "resume" };
        Call::new(Method::POST, &["v1", "pools", &p.namespace, &p.name, "rollout", action])
    }

    /// `POST /v1/pools/{namespace}/{name}/rollout/undo` `{"to_revision": N}` (`None`: the
    /// previous kept revision).
    pub fn rollout_undo(p: &PoolRef, to_revision: Option<i32>) -> Call {
        let req = match to_revision {
            Some(n) => serde_json::json!({"to_revision": n}),
            None => serde_json::json!({}),
        };
        Call { body: body(&req), ..Call::new(Method::POST, &["v1", "pools", &p.namespace, &p.name, "rollout", "undo"]) }
    }

    /// `DELETE /v1/pools/{namespace}/{name}?force=`.
    pub fn delete_pool(p: &PoolRef, force: bool) -> Call {
        let c = Call::new(Method::DELETE, &["v1", "pools", &p.namespace, &p.name]);
        if force { c.query("force", "true") } else { c }
    }

    /// `GET /v1/vms`.
    pub fn list_vms(q: &VmQuery) -> Call {
        let mut c = Call::new(Method::GET, &["v1", "vms"]);
        if let Some(ns) = &q.namespace {
            c = c.query("namespace", ns);
        }
        if let Some(p) = &q.pool {
            c = c.query("pool", p);
        }
        if let Some(ph) = q.phase {
            c = c.query("phase", ph);
        }
        c
    }

    /// `GET /v1/vms/{id}`.
    pub fn get_vm(id: &str) -> Call {
        Call::new(Method::GET, &["v1", "vms", id])
    }

    /// `DELETE /v1/vms/{id}`.
    pub fn delete_vm(id: &str) -> Call {
        Call::new(Method::DELETE, &["v1", "vms", id])
    }

    /// `POST /v1/hosts`.
    pub fn create_host(spec: &HostSpec) -> Call {
        Call { body: body(spec), ..Call::new(Method::POST, &["v1", "hosts"]) }
    }

    /// `PUT /v1/hosts/{name}`.
    pub fn update_host(spec: &HostSpec) -> Call {
        Call { body: body(spec), ..Call::new(Method::PUT, &["v1", "hosts", &spec.name]) }
    }

    /// `GET /v1/hosts/{name}`.
    pub fn get_host(name: &str) -> Call {
        Call::new(Method::GET, &["v1", "hosts", name])
    }

    /// `GET /v1/hosts`.
    pub fn list_hosts() -> Call {
        Call::new(Method::GET, &["v1", "hosts"])
    }

    /// `DELETE /v1/hosts/{name}`.
    pub fn delete_host(name: &str) -> Call {
        Call::new(Method::DELETE, &["v1", "hosts", name])
    }

    /// `POST /v1/hosts/{name}/cordon`.
    pub fn cordon_host(name: &str, reason: Option<&str>) -> Call {
        let b = match reason {
            Some(r) => serde_json::json!({ "reason": r }),
            None => serde_json::json!({}),
        };
        Call { body: Some(b), ..Call::new(Method::POST, &["v1", "hosts", name, "cordon"]) }
    }

    /// `POST /v1/hosts/{name}/uncordon`.
    pub fn uncordon_host(name: &str) -> Call {
        Call::new(Method::POST, &["v1", "hosts", name, "uncordon"])
    }

    /// `GET /v1/events`; with `wait_seconds` the request's time-out grows by that much.
    pub fn events(q: &EventQuery) -> Call {
        let mut c = Call::new(Method::GET, &["v1", "events"]).query("after", q.after).pool_filter(q.pool.as_ref());
        if let Some(n) = q.limit {
            c = c.query("limit", n);
        }
        if let Some(w) = q.wait_seconds {
            c = c.query("wait_seconds", w);
            c.extra_timeout = Duration::from_secs(w);
        }
        c
    }

    /// `GET /healthz`.
    pub fn health() -> Call {
        Call::new(Method::GET, &["healthz"])
    }
}

/// A success answer: status, headers and the body exactly as received.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Reply {
    /// The HTTP status (2xx).
    pub status: u16,
    /// The answer's headers.
    pub headers: HeaderMap,
    /// The body as received.
    pub body: Bytes,
    /// `METHOD /path`, for messages.
    what: String,
}

impl Reply {
    /// The body as a contract object.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_slice(&self.body).map_err(|e| {
            Error::Decode(format!(
                "{} answered {} with a body that is not the expected object: {e}",
                self.what, self.status
            ))
        })
    }

    /// `Idempotent-Replayed: true` (a claim's replay).
    pub fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }

    /// The `ETag` header (a pool's answers carry one), for [`Call::if_match`].
    pub fn etag(&self) -> Option<&str> {
        self.headers.get(reqwest::header::ETAG).and_then(|v| v.to_str().ok())
    }

    #[cfg(test)]
    pub(crate) fn for_test(status: u16, body: &'static str) -> Reply {
        Reply {
            status,
            headers: HeaderMap::new(),
            body: Bytes::from_static(body.as_bytes()),
            what: "POST /v1/claims".into(),
        }
    }
}

/// The innermost cause: for a connection failure, the part that says what went wrong.
fn root_cause(e: &dyn std::error::Error) -> String {
    let mut cur = e;
    while let Some(s) = cur.source() {
        cur = s;
    }
    cur.to_string()
}

/// A message from an error and its causes, without repeating what an outer one already says.
fn chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = s.source();
    }
    parts.join(": ")
}

impl Client {
    /// A client of `endpoint` (`http://…` or `https://…`, a base path is kept) without a token.
    pub fn new(endpoint: &str) -> Result<Client, Error> {
        Client::builder(endpoint).build()
    }

    /// A builder for a client of `endpoint`: token, time-outs, trusted roots, retries.
    pub fn builder(endpoint: &str) -> ClientBuilder {
        ClientBuilder {
            endpoint: endpoint.to_owned(),
            token: None,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            user_agent: concat!("poolmgr-client/", env!("CARGO_PKG_VERSION")).to_owned(),
            roots: Vec::new(),
            retry: RetryPolicy::default(),
        }
    }

    /// The endpoint, as a URL.
    pub fn endpoint(&self) -> &str {
        self.base.as_str()
    }

    /// Whether a token is sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The limit of one request (without a long-poll's wait).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How calls that are safe to repeat are retried.
    pub fn retry_policy(&self) -> RetryPolicy {
        self.retry
    }

    /// The URL of a call: segments escaped, under the endpoint's own path.
    pub fn url(&self, call: &Call) -> Url {
        let mut url = self.base.clone();
        {
            let mut segs = url.path_segments_mut().expect("checked in build: the endpoint can be a base");
            segs.pop_if_empty();
            segs.extend(&call.path);
        }
        if !call.query.is_empty() {
            url.query_pairs_mut().extend_pairs(call.query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        url
    }

    /// Sends a request. A call that is safe to repeat ([`Call::is_idempotent`]) is retried
    /// on a transient failure as the client's [`RetryPolicy`] says; any other is sent once.
    /// A 2xx answer is returned as received; anything else is an [`Error`]: the contract's
    /// error body as [`Error::Api`], no (complete) answer as [`Error::Transport`].
    ///
    /// A release ([`Call::release`]) answered NOT_FOUND after an earlier attempt of it that may
    /// have taken effect (its answer was lost, or a 503/409) is that attempt's doing: it is
    /// returned as the release's success, a `204` with no headers and no body.
    pub async fn send(&self, call: Call) -> Result<Reply, Error> {
        if call.is_idempotent() { self.send_safe(&call, None).await } else { self.send_once(call).await }
    }

    /// A call that is safe to repeat, with the client's retries until `until`; a release's
    /// NOT_FOUND after an attempt that may have released it counts as released.
    async fn send_safe(&self, call: &Call, until: Option<Instant>) -> Result<Reply, Error> {
        match self.send_retrying(call, until).await {
            (Err(e), true) if call.is_lease_release() && e.status() == Some(&Status::NotFound) => {
                let url = self.url(call);
                Ok(Reply {
                    status: 204,
                    headers: HeaderMap::new(),
                    body: Bytes::new(),
                    what: format!("{} {}", call.method, url.path()),
                })
            }
            (r, _) => r,
        }
    }

    /// Sends a request exactly once, whatever it is.
    pub async fn send_once(&self, call: Call) -> Result<Reply, Error> {
        self.attempt(&call, None).await
    }

    /// The time-out of one attempt of `call`: the client's (plus a long-poll's wait), cut to
    /// what is left before `until` — but never below [`MIN_ATTEMPT`] (or the client's own
    /// time-out if that is less), so the last attempt before a deadline can still get a
    /// fast answer.
    fn attempt_timeout(&self, call: &Call, until: Option<Instant>) -> Duration {
        let full = self.timeout + call.extra_timeout;
        match until {
            Some(u) => full.min(u.saturating_duration_since(Instant::now()).max(MIN_ATTEMPT.min(full))),
            None => full,
        }
    }

    /// `call` with the client's retries, each attempt's time-out cut at `until` and no retry
    /// starting after it. Also says whether an earlier attempt failed in a way that may have
    /// taken effect (for the release's "NOT_FOUND after that means released"): an answer lost
    /// or cut off, a 503 or a 409 — not a connection never made.
    pub(crate) async fn send_retrying(&self, call: &Call, until: Option<Instant>) -> (Result<Reply, Error>, bool) {
        let mut retried = false;
        let mut attempt = 1u32;
        loop {
            let err = match self.attempt(call, until).await {
                Ok(r) => return (Ok(r), retried),
                Err(e) => e,
            };
            let now = Instant::now();
            let mut delay = self.retry.backoff.delay(attempt, err.retry_after(), &mut rand::rng());
            if let Some(u) = until {
                delay = delay.min(u.saturating_duration_since(now));
            }
            if !err.is_transient() || attempt >= self.retry.attempts || until.is_some_and(|u| now + delay >= u) {
                return (Err(err), retried);
            }
            // A lost answer may have taken effect; a release's 503 leaves the lease to the
            // reconciler, which ends it, and its 409 says a release is under way: either way a
            // later NOT_FOUND is that release's doing. A connection never made sent nothing.
            retried |= !matches!(err, Error::Transport { kind: TransportKind::Connect, .. });
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// One attempt of `call`, its time-out cut at `until`.
    pub(crate) async fn attempt(&self, call: &Call, until: Option<Instant>) -> Result<Reply, Error> {
        let url = self.url(call);
        let what = format!("{} {}", call.method, url.path());
        let timeout = self.attempt_timeout(call, until);
        let mut b = self.http.request(call.method.clone(), url).timeout(timeout);
        if let Some(t) = &self.token {
            b = b.bearer_auth(t);
        }
        if let Some(body) = &call.body {
            b = b.json(body);
        }
        if let Some(etag) = &call.if_match {
            b = b.header(reqwest::header::IF_MATCH, etag);
        }
        let transport = |e: reqwest::Error, sent: bool| -> Error {
            let (kind, message) = if e.is_timeout() {
                let m = format!("no answer from {} within {:.1}s ({what})", self.base, timeout.as_secs_f64());
                (TransportKind::Timeout, m)
            } else if e.is_connect() {
                (TransportKind::Connect, format!("cannot connect to {}: {}", self.base, root_cause(&e)))
            } else {
                let how = if sent { "the answer was cut off" } else { "failed" };
                (TransportKind::Interrupted, format!("{what} {how}: {}", chain(&e)))
            };
            Error::transport(kind, message, Some(Box::new(e)))
        };
        let resp = b.send().await.map_err(|e| transport(e, false))?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.bytes().await.map_err(|e| transport(e, true))?;
        if (200..300).contains(&status) {
            return Ok(Reply { status, headers, body, what });
        }
        let retry_after = headers
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let parsed: Option<serde_json::Value> =
            serde_json::from_slice::<serde_json::Value>(&body).ok().filter(|v| v["error"]["status"].is_string());
        let text_of = |e: &serde_json::Value, k: &str| e[k].as_str().map(str::to_owned);
        let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (st, message, reason, request_id) = match parsed {
            Some(v) => {
                let e = &v["error"];
                let st = Status::parse(e["status"].as_str().unwrap_or_default().trim());
                (
                    st,
                    text_of(e, "message").unwrap_or_default(),
                    text_of(e, "reason"),
                    text_of(e, "request_id").or(request_id),
                )
            }
            None => {
                let text = String::from_utf8_lossy(&body);
                let text: String = text.trim().chars().take(200).collect();
                let tail = if text.is_empty() { String::new() } else { format!(": {text}") };
                (Status::for_http(status), format!("{what} answered HTTP {status}{tail}"), None, request_id)
            }
        };
        Err(Error::Api(ApiError { code: status, status: st, message, reason, request_id, retry_after }))
    }

    async fn call<T: DeserializeOwned>(&self, call: Call) -> Result<T, Error> {
        self.send(call).await?.json()
    }

    async fn call_empty(&self, call: Call) -> Result<(), Error> {
        self.send(call).await.map(|_| ())
    }

    /// One claim attempt, exactly as given: no retry. Prefer [`Client::claim`], which makes
    /// retries safe.
    pub async fn claim_once(&self, req: &ClaimRequest) -> Result<ClaimResponse, Error> {
        check_request_id(req.request_id.as_deref())?;
        let reply = self.send_once(Call::claim(req)).await?;
        crate::claim::decode_claim(&reply, req.request_id.as_deref().filter(|r| !r.is_empty()))
    }

    /// The lease (404 once it ended, or for another principal's lease).
    pub async fn get_lease(&self, lease_id: &str) -> Result<Lease, Error> {
        self.call(Call::get_lease(lease_id)).await
    }

    /// Extends the lease: `expires_at` becomes now + the pool's `heartbeat_expiry_seconds`.
    /// Retried on transient failures (a heartbeat is safe to repeat).
    pub async fn heartbeat(&self, lease_id: &str) -> Result<Lease, Error> {
        Ok(self.call::<HeartbeatResponse>(Call::heartbeat(lease_id)).await?.lease)
    }

    /// As [`Client::heartbeat`], each attempt cut at `until` and no retry starting after it.
    pub(crate) async fn heartbeat_until(&self, lease_id: &str, until: Instant) -> Result<Lease, Error> {
        let reply = self.send_retrying(&Call::heartbeat(lease_id), Some(until)).await.0?;
        Ok(reply.json::<HeartbeatResponse>()?.lease)
    }

    /// Releases the lease; its VM is deleted. Retried on transient failures as the client's
    /// [`RetryPolicy`] says; NOT_FOUND after an attempt whose answer was lost (or a 503)
    /// means that attempt released it, and counts as done.
    pub async fn release(&self, lease_id: &str) -> Result<(), Error> {
        self.release_until(lease_id, None).await
    }

    /// As [`Client::release`], retrying until `until` (and within the retry policy).
    pub(crate) async fn release_until(&self, lease_id: &str, until: Option<Instant>) -> Result<(), Error> {
        self.send_safe(&Call::release(lease_id), until).await.map(|_| ())
    }

    /// One page of leases.
    pub async fn list_leases(&self, q: &LeaseQuery) -> Result<LeaseList, Error> {
        self.call(Call::list_leases(q)).await
    }

    /// Every lease `q` selects (its `page_token` is the starting point), following the pages.
    pub async fn list_leases_all(&self, q: &LeaseQuery) -> Result<Vec<Lease>, Error> {
        self.pages::<LeaseList>(Call::list_leases(q)).all().await
    }

    /// Every lease `q` selects, as a stream that asks for the next page when it needs it.
    pub fn leases(&self, q: &LeaseQuery) -> impl Stream<Item = Result<Lease, Error>> + Send + 'static {
        self.pages::<LeaseList>(Call::list_leases(q)).into_stream()
    }

    /// Creates a pool (the spec is checked first: [`PoolSpec::validate`]).
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<Pool, Error> {
        spec.validate()?;
        self.call(Call::create_pool(spec)).await
    }

    /// Replaces the spec of the pool the spec names.
    pub async fn update_pool(&self, spec: &PoolSpec) -> Result<Pool, Error> {
        spec.validate()?;
        self.call(Call::update_pool(spec)).await
    }

    /// One pool, with its status.
    pub async fn get_pool(&self, p: &PoolRef) -> Result<Pool, Error> {
        self.call(Call::get_pool(p)).await
    }

    /// Every pool (optionally one namespace's), following the pages.
    pub async fn list_pools(&self, namespace: Option<&str>) -> Result<Vec<Pool>, Error> {
        self.pages::<PoolList>(Call::list_pools(namespace)).all().await
    }

    /// Every pool (optionally one namespace's), as a stream of pages read when needed.
    pub fn pools(&self, namespace: Option<&str>) -> impl Stream<Item = Result<Pool, Error>> + Send + 'static {
        self.pages::<PoolList>(Call::list_pools(namespace)).into_stream()
    }

    /// The pages of a paginated list `call` (one of [`Call::list_leases`],
    /// [`Call::list_pools`], [`Call::list_vms`], [`Call::list_hosts`]), read one at a time.
    /// `P` is the page's type: [`LeaseList`], [`PoolList`], [`VmList`], [`HostList`], or a
    /// caller's own ([`Page`]).
    pub fn pages<P: Page>(&self, call: Call) -> Pages<P> {
        Pages { client: self.clone(), call, token: None, seen: SeenTokens::default(), done: false, _page: PhantomData }
    }

    /// Announces `req.claims` claims within `req.within_seconds`: the pool pre-warms for them
    /// (up to its autoscaling ceiling; without autoscaling it only refills faster).
    pub async fn expect(&self, p: &PoolRef, req: &ExpectRequest) -> Result<Expected, Error> {
        req.validate()?;
        self.call(Call::expect(p, req)).await
    }

    /// Drains the pool; refused while a VM is leased unless `force`.
    pub async fn delete_pool(&self, p: &PoolRef, force: bool) -> Result<(), Error> {
        self.call_empty(Call::delete_pool(p, force)).await
    }

    /// Every VM `q` selects, following the pages.
    pub async fn list_vms(&self, q: &VmQuery) -> Result<Vec<Vm>, Error> {
        self.pages::<VmList>(Call::list_vms(q)).all().await
    }

    /// Every VM `q` selects, as a stream of pages read when needed.
    pub fn vms(&self, q: &VmQuery) -> impl Stream<Item = Result<Vm, Error>> + Send + 'static {
        self.pages::<VmList>(Call::list_vms(q)).into_stream()
    }

    /// One VM.
    pub async fn get_vm(&self, id: &str) -> Result<Vm, Error> {
        self.call(Call::get_vm(id)).await
    }

    /// Discards a VM (a LEASED one is refused: release its lease instead).
    pub async fn delete_vm(&self, id: &str) -> Result<(), Error> {
        self.call_empty(Call::delete_vm(id)).await
    }

    /// Registers a flintlock host.
    pub async fn create_host(&self, spec: &HostSpec) -> Result<Host, Error> {
        self.call(Call::create_host(spec)).await
    }

    /// Replaces a host's address, TLS settings and credentials.
    pub async fn update_host(&self, spec: &HostSpec) -> Result<Host, Error> {
        self.call(Call::update_host(spec)).await
    }

    /// One host.
    pub async fn get_host(&self, name: &str) -> Result<Host, Error> {
        self.call(Call::get_host(name)).await
    }

    /// Every host, following the pages.
    pub async fn list_hosts(&self) -> Result<Vec<Host>, Error> {
        self.pages::<HostList>(Call::list_hosts()).all().await
    }

    /// Every host, as a stream of pages read when needed.
    pub fn hosts(&self) -> impl Stream<Item = Result<Host, Error>> + Send + 'static {
        self.pages::<HostList>(Call::list_hosts()).into_stream()
    }

    /// Unregisters a host (refused while a pool names it or it has VMs).
    pub async fn delete_host(&self, name: &str) -> Result<(), Error> {
        self.call_empty(Call::delete_host(name)).await
    }

    /// Stops new placements on a host.
    pub async fn cordon_host(&self, name: &str, reason: Option<&str>) -> Result<Host, Error> {
        self.call(Call::cordon_host(name, reason)).await
    }

    /// Allows new placements on a host again.
    pub async fn uncordon_host(&self, name: &str) -> Result<Host, Error> {
        self.call(Call::uncordon_host(name)).await
    }

    /// Events after `q.after`; with `wait_seconds` the server long-polls for new ones. One
    /// request: [`Client::event_feed`] follows the cursor.
    pub async fn events(&self, q: &EventQuery) -> Result<EventList, Error> {
        self.call(Call::events(q)).await
    }

    /// `GET /healthz`: the server and its database answer.
    pub async fn health(&self) -> Result<Health, Error> {
        self.call(Call::health()).await
    }
}

/// The shortest time-out an attempt gets when a deadline is nearly spent.
pub(crate) const MIN_ATTEMPT: Duration = Duration::from_secs(1);

/// One page of a paginated list: its items and the token of the next page.
pub trait Page: DeserializeOwned + Send + 'static {
    /// What the page lists.
    type Item: Send + 'static;
    /// The token to ask for the next page with; empty on the last page.
    fn next_page_token(&self) -> &str;
    /// The page's items.
    fn into_items(self) -> Vec<Self::Item>;
}

macro_rules! page {
    ($list:ty, $item:ty, $field:ident) => {
        impl Page for $list {
            type Item = $item;
            fn next_page_token(&self) -> &str {
                &self.next_page_token
            }
            fn into_items(self) -> Vec<$item> {
                self.$field
            }
        }
    };
}
page!(LeaseList, Lease, leases);
page!(PoolList, Pool, pools);
page!(VmList, Vm, vms);
page!(HostList, Host, hosts);

/// The pages of one list, read in order ([`Client::pages`]). Each page is asked with the
/// token the previous one gave; a server that gives a token it gave before (at once, or
/// after others: A, B, A) is an error rather than a loop. Cancel-safe: dropping
/// [`Pages::next_page`]'s future loses nothing, the next call asks for the same page again.
#[derive(Debug)]
pub struct Pages<P> {
    client: Client,
    call: Call,
    /// The token of the page to read next (`None`: the call's own, the first).
    token: Option<String>,
    /// Every token asked with so far.
    seen: SeenTokens,
    done: bool,
    _page: PhantomData<fn() -> P>,
}

/// The page tokens a paginator has asked with: a token given again would repeat pages
/// already read, for ever.
#[derive(Debug, Default)]
struct SeenTokens(HashSet<String>);

impl SeenTokens {
    /// Records that the page asked with `asked` (`None`: the first, without a token) gave
    /// `next`; an error naming `list` when `next` was asked with before.
    fn check(&mut self, list: &str, asked: Option<&str>, next: &str) -> Result<(), Error> {
        if let Some(a) = asked {
            self.0.insert(a.to_owned());
        }
        if !next.is_empty() && self.0.contains(next) {
            return Err(Error::Decode(format!(
                "{list}: the server gave page token {next:?} again after {} page(s): its list never ends",
                self.0.len()
            )));
        }
        Ok(())
    }
}

impl<P: Page> Pages<P> {
    /// The next page, or `None` after the last.
    pub async fn next_page(&mut self) -> Result<Option<P>, Error> {
        if self.done {
            return Ok(None);
        }
        let call = match &self.token {
            Some(t) => self.call.clone().with_query("page_token", t),
            None => self.call.clone(),
        };
        let asked = call.query.iter().find(|(k, _)| *k == "page_token").map(|(_, v)| v.clone());
        let list = format!("{} {}", call.method, self.client.url(&call).path());
        let page: P = self.client.send(call).await?.json()?;
        let next = page.next_page_token();
        self.seen.check(&list, asked.as_deref(), next)?;
        if next.is_empty() {
            self.done = true;
        } else {
            self.token = Some(next.to_owned());
        }
        Ok(Some(page))
    }

    /// Every remaining item, in pages of the largest size unless the call chose one.
    pub async fn all(mut self) -> Result<Vec<P::Item>, Error> {
        self.largest_pages();
        let mut all = Vec::new();
        while let Some(p) = self.next_page().await? {
            all.extend(p.into_items());
        }
        Ok(all)
    }

    /// The remaining items as a stream (pages of the largest size unless the call chose one,
    /// each read when the items before it are used up). It ends after the first error.
    pub fn into_stream(mut self) -> impl Stream<Item = Result<P::Item, Error>> + Send + 'static {
        self.largest_pages();
        let state = (self, VecDeque::<P::Item>::new(), false);
        futures_util::stream::unfold(state, |(mut pages, mut buf, failed)| async move {
            loop {
                if failed {
                    return None;
                }
                if let Some(item) = buf.pop_front() {
                    return Some((Ok(item), (pages, buf, false)));
                }
                match pages.next_page().await {
                    Ok(Some(p)) => buf.extend(p.into_items()),
                    Ok(None) => return None,
                    Err(e) => return Some((Err(e), (pages, buf, true))),
                }
            }
        })
    }

    fn largest_pages(&mut self) {
        if !self.call.query.iter().any(|(k, _)| *k == "page_size") {
            self.call = self.call.clone().with_query("page_size", ALL_PAGES_SIZE);
        }
    }
}

/// A `request_id` the server would refuse, refused here before anything is sent.
pub(crate) fn check_request_id(id: Option<&str>) -> Result<(), Error> {
    match id {
        Some(r) if r.len() > MAX_REQUEST_ID_BYTES => Err(Error::InvalidInput(format!(
            "request_id is {} bytes long; at most {MAX_REQUEST_ID_BYTES} bytes are allowed",
            r.len()
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_escape_segments_and_keep_a_base_path() {
        let c = Client::new("http://h:1/prefix/").unwrap();
        assert_eq!(c.url(&Call::get_vm("a/b c")).as_str(), "http://h:1/prefix/v1/vms/a%2Fb%20c");
        let c = Client::new("http://h:1").unwrap();
        let q = LeaseQuery { pool: Some(PoolRef::parse("ci").unwrap()), ..Default::default() };
        assert_eq!(c.url(&Call::list_leases(&q)).as_str(), "http://h:1/v1/leases?namespace=default&pool=ci");
        let q = EventQuery { after: 7, limit: Some(5), wait_seconds: Some(20), pool: None };
        let call = Call::events(&q);
        assert_eq!(c.url(&call).as_str(), "http://h:1/v1/events?after=7&limit=5&wait_seconds=20");
        assert_eq!(call.extra_timeout, Duration::from_secs(20));
    }

    #[test]
    fn a_call_to_a_route_the_crate_does_not_model_is_built_from_its_parts() {
        let c = Client::new("http://h:1/base").unwrap();
        let call = Call::new(Method::POST, &["v1", "pools", "default", "ci", "drain"])
            .with_query("dry_run", true)
            .with_query("dry_run", false)
            .with_body(serde_json::json!({"reason": "x"}))
            .with_extra_timeout(Duration::from_secs(3));
        assert_eq!(c.url(&call).as_str(), "http://h:1/base/v1/pools/default/ci/drain?dry_run=false");
        assert_eq!(call.body, Some(serde_json::json!({"reason": "x"})));
        assert_eq!(call.extra_timeout, Duration::from_secs(3));
        assert!(!call.is_idempotent());
        assert!(Call::new(Method::GET, &["v1", "things"]).is_idempotent());
    }

    #[test]
    fn endpoints_must_be_http_urls() {
        for bad in ["127.0.0.1:8080", "ftp://x", "nonsense", ""] {
            assert!(matches!(Client::new(bad), Err(Error::InvalidInput(_))), "{bad} accepted");
        }
        assert!(Client::builder("http://h").timeout(Duration::ZERO).build().is_err());
    }

    #[test]
    fn the_token_is_never_in_debug_output() {
        let c = Client::builder("http://h").token("s3cret-token-value").build().unwrap();
        assert!(c.has_token());
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(!Client::builder("http://h").token("").build().unwrap().has_token());
    }

    #[test]
    fn an_https_endpoint_needs_a_tls_feature_and_says_which() {
        let built = Client::new("https://h:8443");
        if TLS {
            assert!(built.is_ok(), "{built:?}");
        } else {
            let e = built.unwrap_err();
            let m = e.to_string();
            assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
            for feature in ["rustls-native-roots", "rustls-webpki-roots", "native-tls"] {
                assert!(m.contains(feature), "{m}");
            }
            // Plain http:// still works.
            assert!(Client::new("http://h:8080").is_ok());
        }
    }

    #[test]
    fn a_page_token_given_again_is_an_error_naming_the_list_however_late() {
        let list = "GET /v1/leases";
        // A, B, A: the third page would start the loop again.
        let mut seen = SeenTokens::default();
        seen.check(list, None, "A").unwrap();
        seen.check(list, Some("A"), "B").unwrap();
        let e = seen.check(list, Some("B"), "A").unwrap_err();
        assert!(matches!(&e, Error::Decode(m) if m.starts_with(list) && m.contains("\"A\"")), "{e:?}");
        // At once (A, A), and back to the call's own starting token.
        let mut seen = SeenTokens::default();
        assert!(seen.check(list, Some("A"), "A").is_err());
        let mut seen = SeenTokens::default();
        seen.check(list, Some("S"), "A").unwrap();
        assert!(seen.check(list, Some("A"), "S").is_err());
        // The last page (an empty token) ends the list, however many came before.
        let mut seen = SeenTokens::default();
        for (asked, next) in [(None, "1"), (Some("1"), "2"), (Some("2"), "3"), (Some("3"), "")] {
            seen.check(list, asked, next).unwrap();
        }
    }

    #[test]
    fn an_overlong_request_id_is_refused_before_sending() {
        assert!(check_request_id(Some(&"r".repeat(255))).is_ok());
        assert!(matches!(check_request_id(Some(&"r".repeat(256))), Err(Error::InvalidInput(_))));
    }
}
