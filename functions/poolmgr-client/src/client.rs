//! The HTTP layer: [`Client`] (endpoint, token, time-out), one [`Call`] constructor per route
//! (the one place each route's method, path and query are written), one typed method per
//! route, and [`Client::send`] for callers that want the answer's bytes as the server sent
//! them. Single attempts only: retrying is [`crate::claim`]'s and [`crate::keepalive`]'s job.

use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use reqwest::{Method, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, Error, Status, TransportKind};
use crate::types::*;

/// A poolmgr endpoint with a token. Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    token: Option<String>,
    timeout: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Client").field("endpoint", &self.base.as_str()).field("timeout", &self.timeout).finish()
    }
}

/// Builds a [`Client`]: `Client::builder(endpoint).token(t).build()`.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    endpoint: String,
    token: Option<String>,
    timeout: Duration,
    user_agent: String,
}

impl ClientBuilder {
    /// Sent as `Authorization: Bearer <token>`; an empty token sends none.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into()).filter(|t: &String| !t.is_empty());
        self
    }

    /// Limit of one request, connection included (default 30 s). Long-polls add their wait.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn user_agent(mut self, ua: impl Into<String>) -> Self {
        self.user_agent = ua.into();
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        let endpoint = self.endpoint.trim();
        let base = Url::parse(endpoint)
            .map_err(|e| Error::InvalidInput(format!("endpoint {endpoint:?} is not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() || base.host().is_none() {
            return Err(Error::InvalidInput(format!(
                "endpoint {endpoint:?} must be an http:// or https:// URL, e.g. http://127.0.0.1:8080"
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::InvalidInput("the time-out must be more than 0".into()));
        }
        let http = reqwest::Client::builder()
            .user_agent(self.user_agent)
            .connect_timeout(self.timeout)
            .build()
            .map_err(|e| Error::InvalidInput(format!("cannot build the HTTP client: {}", chain(&e))))?;
        Ok(Client { http, base, token: self.token, timeout: self.timeout })
    }
}

/// One request of the contract: method, path segments (each escaped), query, JSON body.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: Method,
    pub path: Vec<String>,
    pub query: Vec<(&'static str, String)>,
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
    fn new(method: Method, path: &[&str]) -> Call {
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
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
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

    pub fn builder(endpoint: &str) -> ClientBuilder {
        ClientBuilder {
            endpoint: endpoint.to_owned(),
            token: None,
            timeout: Duration::from_secs(30),
            user_agent: concat!("poolmgr-client/", env!("CARGO_PKG_VERSION")).to_owned(),
        }
    }

    pub fn endpoint(&self) -> &str {
        self.base.as_str()
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
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

    /// Sends one request. A 2xx answer is returned as received; anything else is an
    /// [`Error`]: the contract's error body as [`Error::Api`], no (complete) answer as
    /// [`Error::Transport`].
    pub async fn send(&self, call: Call) -> Result<Reply, Error> {
        let url = self.url(&call);
        let what = format!("{} {}", call.method, url.path());
        let timeout = self.timeout + call.extra_timeout;
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
            if e.is_timeout() {
                Error::Transport {
                    kind: TransportKind::Timeout,
                    message: format!("no answer from {} within {:.1}s ({what})", self.base, timeout.as_secs_f64()),
                }
            } else if e.is_connect() {
                Error::Transport {
                    kind: TransportKind::Connect,
                    message: format!("cannot connect to {}: {}", self.base, root_cause(&e)),
                }
            } else {
                let how = if sent { "the answer was cut off" } else { "failed" };
                Error::Transport { kind: TransportKind::Interrupted, message: format!("{what} {how}: {}", chain(&e)) }
            }
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
        self.call(Call::claim(req)).await
    }

    pub async fn get_lease(&self, lease_id: &str) -> Result<Lease, Error> {
        self.call(Call::get_lease(lease_id)).await
    }

    /// Extends the lease: `expires_at` becomes now + the pool's `heartbeat_expiry_seconds`.
    pub async fn heartbeat(&self, lease_id: &str) -> Result<Lease, Error> {
        Ok(self.call::<HeartbeatResponse>(Call::heartbeat(lease_id)).await?.lease)
    }

    /// Releases the lease; its VM is deleted.
    pub async fn release(&self, lease_id: &str) -> Result<(), Error> {
        self.call_empty(Call::release(lease_id)).await
    }

    /// One page of leases.
    pub async fn list_leases(&self, q: &LeaseQuery) -> Result<LeaseList, Error> {
        self.call(Call::list_leases(q)).await
    }

    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<Pool, Error> {
        spec.validate().map_err(Error::InvalidInput)?;
        self.call(Call::create_pool(spec)).await
    }

    pub async fn update_pool(&self, spec: &PoolSpec) -> Result<Pool, Error> {
        spec.validate().map_err(Error::InvalidInput)?;
        self.call(Call::update_pool(spec)).await
    }

    pub async fn get_pool(&self, p: &PoolRef) -> Result<Pool, Error> {
        self.call(Call::get_pool(p)).await
    }

    /// Every pool (optionally one namespace's), following the pages.
    pub async fn list_pools(&self, namespace: Option<&str>) -> Result<Vec<Pool>, Error> {
        self.all_pages(|| Call::list_pools(namespace), |l: PoolList| (l.pools, l.next_page_token)).await
    }

    /// Every item of a paginated list: pages of the largest size, each asked with the token the
    /// last one gave, until one gives none. A server that repeats a token is an error rather
    /// than a loop.
    async fn all_pages<L: DeserializeOwned, T>(
        &self,
        call: impl Fn() -> Call,
        split: impl Fn(L) -> (Vec<T>, String),
    ) -> Result<Vec<T>, Error> {
        let mut all = Vec::new();
        let mut token = String::new();
        loop {
            let mut c = call().query("page_size", 1000);
            if !token.is_empty() {
                c = c.query("page_token", &token);
            }
            let (items, next) = split(self.call::<L>(c).await?);
            all.extend(items);
            if next.is_empty() {
                return Ok(all);
            }
            if next == token {
                return Err(Error::Decode(format!("the server repeated page token {next:?}: its list never ends")));
            }
            token = next;
        }
    }

    /// Announces `req.claims` claims within `req.within_seconds`: the pool pre-warms for them
    /// (up to its autoscaling ceiling; without autoscaling it only refills faster).
    pub async fn expect(&self, p: &PoolRef, req: &ExpectRequest) -> Result<Expected, Error> {
        req.validate().map_err(Error::InvalidInput)?;
        self.call(Call::expect(p, req)).await
    }

    /// Drains the pool; refused while a VM is leased unless `force`.
    pub async fn delete_pool(&self, p: &PoolRef, force: bool) -> Result<(), Error> {
        self.call_empty(Call::delete_pool(p, force)).await
    }

    pub async fn list_vms(&self, q: &VmQuery) -> Result<Vec<Vm>, Error> {
        self.all_pages(|| Call::list_vms(q), |l: VmList| (l.vms, l.next_page_token)).await
    }

    pub async fn get_vm(&self, id: &str) -> Result<Vm, Error> {
        self.call(Call::get_vm(id)).await
    }

    /// Discards a VM (a LEASED one is refused: release its lease instead).
    pub async fn delete_vm(&self, id: &str) -> Result<(), Error> {
        self.call_empty(Call::delete_vm(id)).await
    }

    pub async fn create_host(&self, spec: &HostSpec) -> Result<Host, Error> {
        self.call(Call::create_host(spec)).await
    }

    pub async fn update_host(&self, spec: &HostSpec) -> Result<Host, Error> {
        self.call(Call::update_host(spec)).await
    }

    pub async fn get_host(&self, name: &str) -> Result<Host, Error> {
        self.call(Call::get_host(name)).await
    }

    pub async fn list_hosts(&self) -> Result<Vec<Host>, Error> {
        self.all_pages(Call::list_hosts, |l: HostList| (l.hosts, l.next_page_token)).await
    }

    pub async fn delete_host(&self, name: &str) -> Result<(), Error> {
        self.call_empty(Call::delete_host(name)).await
    }

    pub async fn cordon_host(&self, name: &str, reason: Option<&str>) -> Result<Host, Error> {
        self.call(Call::cordon_host(name, reason)).await
    }

    pub async fn uncordon_host(&self, name: &str) -> Result<Host, Error> {
        self.call(Call::uncordon_host(name)).await
    }

    /// Events after `q.after`; with `wait_seconds` the server long-polls for new ones.
    pub async fn events(&self, q: &EventQuery) -> Result<EventList, Error> {
        self.call(Call::events(q)).await
    }

    pub async fn health(&self) -> Result<Health, Error> {
        self.call(Call::health()).await
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
    fn an_overlong_request_id_is_refused_before_sending() {
        assert!(check_request_id(Some(&"r".repeat(255))).is_ok());
        assert!(matches!(check_request_id(Some(&"r".repeat(256))), Err(Error::InvalidInput(_))));
    }
}
