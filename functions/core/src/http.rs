//! The HTTP contract: one Router per function, the same Router on Lambda, locally and in
//! tests.
//!
//! Handlers parse and authorise, call `service`, and map the answer to JSON. Every
//! rejection — a malformed body, a wrong type, an unknown field, a bad query string, an
//! oversized body — answers in the contract's error shape, never axum's plain text.

use std::time::Duration;

use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{LeaseId, Phase, PoolRef, PoolSpec, RequestId, validate_name};
use crate::error::ApiError;
use crate::service::{claim, host, lease, pool};
use crate::store;

/// Largest accepted request body. A PoolSpec with a big cloud-init payload fits.
pub const MAX_BODY_BYTES: usize = 256 * 1024;
/// Longest long-poll on the events feed.
pub const MAX_EVENTS_WAIT_SECONDS: u64 = 20;

// ---------------------------------------------------------------------------------------
// Extractors
// ---------------------------------------------------------------------------------------

/// A JSON body whose every failure is a contract error. The content type is not checked:
/// a body that parses as JSON is accepted.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(body_error)?;
        let value = serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
        reject_nul_in_json(&bytes)?;
        Ok(value)
    }
}

/// A body that could not be read, too large included, as a contract error (never axum's
/// plain-text 413).
fn body_error(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::InvalidArgument(format!("request body is larger than {MAX_BODY_BYTES} bytes"))
    } else {
        ApiError::InvalidArgument(format!("cannot read request body: {e}"))
    }
}

const NUL_MESSAGE: &str = "text must not contain the NUL character (\\u0000)";

/// PostgreSQL text cannot hold NUL: refuse it at the edge as INVALID_ARGUMENT rather than let
/// the database fail with an internal error. In JSON a NUL can only be written `\u0000`, so
/// bodies without that escape are not walked.
fn reject_nul_in_json(bytes: &[u8]) -> Result<(), ApiError> {
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(a) => a.iter().any(has_nul),
            serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    if !bytes.windows(6).any(|w| w == b"\\u0000") {
        return Ok(());
    }
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(v) if has_nul(&v) => Err(ApiError::InvalidArgument(format!("invalid JSON body: {NUL_MESSAGE}"))),
        _ => Ok(()),
    }
}

/// A query string whose failures are contract errors.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // `%00` is the only way to put a NUL in a query string.
        if parts.uri.query().is_some_and(|q| q.contains("%00")) {
            return Err(ApiError::InvalidArgument(format!("invalid query string: {NUL_MESSAGE}")));
        }
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| ApiQuery(q))
            .map_err(|e: QueryRejection| ApiError::InvalidArgument(format!("invalid query string: {}", e.body_text())))
    }
}

/// Path parameters whose failures are contract errors.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        if parts.uri.path().contains("%00") {
            return Err(ApiError::InvalidArgument(format!("invalid path: {NUL_MESSAGE}")));
        }
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(p)| ApiPath(p))
            .map_err(|e: PathRejection| ApiError::InvalidArgument(format!("invalid path: {}", e.body_text())))
    }
}

/// The authenticated caller.
pub struct Caller(pub Principal);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let header = parts.headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
        state.auth.authenticate(header).map(Caller)
    }
}

/// An authenticated caller with the admin role.
pub struct Admin(pub Principal);

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let Caller(p) = Caller::from_request_parts(parts, state).await?;
        p.require_admin()?;
        Ok(Admin(p))
    }
}

fn pool_ref(namespace: &str, name: &str) -> Result<PoolRef, ApiError> {
    PoolRef::parse(namespace, name).map_err(ApiError::InvalidArgument)
}

fn lease_id(raw: &str) -> Result<LeaseId, ApiError> {
    // A malformed id cannot name a lease: NOT_FOUND, like any unknown id.
    LeaseId::parse(raw).map_err(|_| ApiError::NotFound(format!("lease {raw} not found")))
}

/// Both or neither of `namespace` and `pool`.
fn optional_pool(namespace: Option<&str>, pool: Option<&str>) -> Result<Option<PoolRef>, ApiError> {
    match (namespace.filter(|s| !s.is_empty()), pool.filter(|s| !s.is_empty())) {
        (None, None) => Ok(None),
        (Some(ns), Some(p)) => pool_ref(ns, p).map(Some),
        _ => Err(ApiError::InvalidArgument("give both namespace and pool, or neither".into())),
    }
}

// ---------------------------------------------------------------------------------------
// Claims
// ---------------------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimBody {
    pool: PoolRef,
    #[serde(default)]
    request_id: Option<String>,
}

async fn claim_vm(
    State(state): State<AppState>,
    Caller(p): Caller,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ClaimBody>,
) -> Result<Response, ApiError> {
    let header_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::InvalidArgument("Idempotency-Key header must be visible ASCII".into()))?
                .to_owned(),
        ),
    };
    let raw = match (body.request_id.filter(|s| !s.is_empty()), header_key.filter(|s| !s.is_empty())) {
        (Some(b), Some(h)) if b != h => {
            return Err(ApiError::InvalidArgument(
                "the Idempotency-Key header and the body's request_id differ: send one, or the same value in both"
                    .into(),
            ));
        }
        (b, h) => b.or(h).unwrap_or_default(),
    };
    // Order matters: an over-long request_id is refused before the pool is looked up.
    let request_id = RequestId::parse(&raw).map_err(ApiError::InvalidArgument)?;
    let pool = pool_ref(&body.pool.namespace, &body.pool.name)?;
    let resp = claim::claim(&state, &p, claim::ClaimRequest { pool, request_id }).await?;
    let replayed = resp.replayed;
    let mut r = Json(resp).into_response();
    if replayed {
        r.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(r)
}

pub fn claims_routes() -> Router<AppState> {
    Router::new().route("/v1/claims", post(claim_vm))
}

// ---------------------------------------------------------------------------------------
// Leases
// ---------------------------------------------------------------------------------------

async fn get_lease(
    State(state): State<AppState>,
    Caller(_): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(lease::get(&state, &lease_id(&id)?).await?).into_response())
}

async fn heartbeat(
    State(state): State<AppState>,
    Caller(_): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let l = lease::heartbeat(&state, &lease_id(&id)?).await?;
    Ok(Json(serde_json::json!({ "lease": l })).into_response())
}

async fn release(
    State(state): State<AppState>,
    Caller(_): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    lease::release(&state, &lease_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseListQuery {
    namespace: Option<String>,
    pool: Option<String>,
    page_size: Option<i64>,
    page_token: Option<String>,
}

async fn list_leases(
    State(state): State<AppState>,
    Caller(p): Caller,
    ApiQuery(q): ApiQuery<LeaseListQuery>,
) -> Result<Response, ApiError> {
    let pool = optional_pool(q.namespace.as_deref(), q.pool.as_deref())?;
    let page = lease::list(&state, &p, pool.as_ref(), q.page_size, q.page_token.as_deref()).await?;
    Ok(Json(serde_json::json!({ "leases": page.leases, "next_page_token": page.next_page_token })).into_response())
}

pub fn leases_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/leases", get(list_leases))
        .route("/v1/leases/{lease_id}", get(get_lease).delete(release))
        .route("/v1/leases/{lease_id}/heartbeat", post(heartbeat))
}

// ---------------------------------------------------------------------------------------
// Pools
// ---------------------------------------------------------------------------------------

async fn create_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<Response, ApiError> {
    Ok((StatusCode::CREATED, Json(pool::create(&state, spec).await?)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamespaceQuery {
    namespace: Option<String>,
}

async fn list_pools(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiQuery(q): ApiQuery<NamespaceQuery>,
) -> Result<Response, ApiError> {
    let ns = q.namespace.filter(|s| !s.is_empty());
    if let Some(ns) = &ns {
        validate_name("namespace", ns).map_err(ApiError::InvalidArgument)?;
    }
    let pools = pool::list(&state, ns.as_deref()).await?;
    Ok(Json(serde_json::json!({ "pools": pools })).into_response())
}

async fn get_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::get(&state, &pool_ref(&ns, &name)?).await?).into_response())
}

async fn update_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::update(&state, &pool_ref(&ns, &name)?, spec).await?).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeletePoolQuery {
    #[serde(default)]
    force: bool,
}

async fn delete_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<DeletePoolQuery>,
) -> Result<Response, ApiError> {
    pool::delete(&state, &pool_ref(&ns, &name)?, q.force).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub fn pools_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/pools", post(create_pool).get(list_pools))
        .route("/v1/pools/{namespace}/{name}", get(get_pool).put(update_pool).delete(delete_pool))
}

// ---------------------------------------------------------------------------------------
// Hosts and VMs
// ---------------------------------------------------------------------------------------

async fn create_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiJson(spec): ApiJson<host::HostSpec>,
) -> Result<Response, ApiError> {
    Ok((StatusCode::CREATED, Json(host::create(&state, spec).await?)).into_response())
}

async fn list_hosts(State(state): State<AppState>, Admin(_): Admin) -> Result<Response, ApiError> {
    Ok(Json(serde_json::json!({ "hosts": host::list(&state).await? })).into_response())
}

async fn get_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(host::get(&state, &name).await?).into_response())
}

async fn update_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
    ApiJson(spec): ApiJson<host::HostSpec>,
) -> Result<Response, ApiError> {
    Ok(Json(host::update(&state, &name, spec).await?).into_response())
}

async fn delete_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    host::remove(&state, &name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CordonBody {
    #[serde(default)]
    reason: Option<String>,
}

async fn cordon_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    // The body is optional: an empty one cordons without a reason.
    let body: CordonBody = if body.iter().all(u8::is_ascii_whitespace) {
        CordonBody::default()
    } else {
        let b =
            serde_json::from_slice(&body).map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
        reject_nul_in_json(&body)?;
        b
    };
    let reason = body.reason.unwrap_or_default();
    if reason.len() > 1024 {
        return Err(ApiError::InvalidArgument("reason is longer than 1024 bytes".into()));
    }
    Ok(Json(host::set_cordon(&state, &name, Some(&reason)).await?).into_response())
}

async fn uncordon_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(host::set_cordon(&state, &name, None).await?).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VmListQuery {
    namespace: Option<String>,
    pool: Option<String>,
    phase: Option<String>,
}

async fn list_vms(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiQuery(q): ApiQuery<VmListQuery>,
) -> Result<Response, ApiError> {
    let phase = match q.phase.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(Phase::parse(s).ok_or_else(|| {
            let all: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
            ApiError::InvalidArgument(format!("phase {s:?} is unknown: use one of {}", all.join(", ")))
        })?),
    };
    let ns = q.namespace.filter(|s| !s.is_empty());
    let pool = q.pool.filter(|s| !s.is_empty());
    let conn = state.conn().await?;
    let vms = store::vm_list(&**conn, ns.as_deref(), pool.as_deref(), phase).await?;
    let vms: Vec<crate::api::VmRecord> = vms.iter().map(Into::into).collect();
    Ok(Json(serde_json::json!({ "vms": vms })).into_response())
}

async fn get_vm(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let conn = state.conn().await?;
    let vm = store::vm_get(&**conn, &id).await?.ok_or_else(|| ApiError::NotFound(format!("vm {id} not found")))?;
    Ok(Json(crate::api::VmRecord::from(&vm)).into_response())
}

pub fn hosts_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/hosts", post(create_host).get(list_hosts))
        .route("/v1/hosts/{name}", get(get_host).put(update_host).delete(delete_host))
        .route("/v1/hosts/{name}/cordon", post(cordon_host))
        .route("/v1/hosts/{name}/uncordon", post(uncordon_host))
        .route("/v1/vms", get(list_vms))
        .route("/v1/vms/{id}", get(get_vm))
}

// ---------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    #[serde(default)]
    after: i64,
    namespace: Option<String>,
    pool: Option<String>,
    limit: Option<i64>,
    #[serde(default)]
    wait_seconds: u64,
}

async fn list_events(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::InvalidArgument("limit must be between 1 and 1000".into()));
    }
    if q.wait_seconds > MAX_EVENTS_WAIT_SECONDS {
        return Err(ApiError::InvalidArgument(format!("wait_seconds must be at most {MAX_EVENTS_WAIT_SECONDS}")));
    }
    if q.after < 0 {
        return Err(ApiError::InvalidArgument("after must not be negative".into()));
    }
    let ns = q.namespace.filter(|s| !s.is_empty());
    let pool = q.pool.filter(|s| !s.is_empty());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(q.wait_seconds);
    // Long-poll by polling: no LISTEN, so it works through a transaction-mode pooler. The
    // connection goes back to the pool between polls.
    let events = loop {
        let events = {
            let conn = state.conn().await?;
            store::event_list(&**conn, q.after, ns.as_deref(), pool.as_deref(), limit).await?
        };
        if !events.is_empty() || tokio::time::Instant::now() >= deadline {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let next_after = events.last().map_or(q.after, |e| e.id);
    let events: Vec<crate::api::Event> = events.iter().map(Into::into).collect();
    Ok(Json(serde_json::json!({ "events": events, "next_after": next_after })).into_response())
}

pub fn events_routes() -> Router<AppState> {
    Router::new().route("/v1/events", get(list_events))
}

// ---------------------------------------------------------------------------------------
// Operations: health and metrics
// ---------------------------------------------------------------------------------------

async fn healthz(State(state): State<AppState>) -> Result<Response, ApiError> {
    let conn = state.conn().await?;
    store::ping(&**conn).await?;
    Ok(Json(serde_json::json!({ "status": "ok" })).into_response())
}

async fn metrics(State(state): State<AppState>, Admin(_): Admin) -> Result<Response, ApiError> {
    let mut text = state.metrics.render();
    let conn = state.conn().await?;
    let pools = store::pool_gauges(&**conn).await?;
    type Gauge = fn(&store::PoolRow, &store::PoolStatus) -> i64;
    let gauges: [(&str, &str, Gauge); 5] = [
        ("poolmgr_pool_size", "Target size of the pool.", |p, _| i64::from(p.size)),
        ("poolmgr_pool_available", "AVAILABLE VMs.", |_, s| s.available),
        ("poolmgr_pool_leased", "LEASED VMs, plus VMs being claimed.", |_, s| s.leased + s.claiming),
        ("poolmgr_pool_provisioning", "VMs being provisioned or running create hooks.", |_, s| s.provisioning),
        ("poolmgr_pool_quarantined", "QUARANTINED VMs.", |_, s| s.quarantined),
    ];
    for (name, help, f) in gauges {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (p, s) in &pools {
            text.push_str(&format!(
                "{name}{{pool_namespace=\"{}\",pool_name=\"{}\"}} {}\n",
                p.namespace,
                p.name,
                f(p, s)
            ));
        }
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

async fn no_route() -> ApiError {
    ApiError::NotFound("no such route: see the HTTP API reference".into())
}

fn ops_routes() -> Router<AppState> {
    Router::new().route("/healthz", get(healthz)).route("/metrics", get(metrics))
}

/// Writes the request's metrics as EMF lines once it is answered (on Lambda; a no-op with
/// Prometheus only).
async fn flush_metrics(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    state.metrics.flush();
    resp
}

/// Wraps routes with what every function shares: health and metrics, JSON 404s, the body
/// limit, request ids, request logs and the EMF metrics flush.
fn finish(routes: Router<AppState>, state: AppState) -> Router {
    routes
        .merge(ops_routes())
        .fallback(no_route)
        .layer(axum::middleware::from_fn_with_state(state.clone(), flush_metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
        }))
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(state)
}

/// The claims function.
pub fn claims_router(state: AppState) -> Router {
    finish(claims_routes(), state)
}

/// The leases function.
pub fn leases_router(state: AppState) -> Router {
    finish(leases_routes(), state)
}

/// The pools function.
pub fn pools_router(state: AppState) -> Router {
    finish(pools_routes(), state)
}

/// The hosts function (hosts and VMs).
pub fn hosts_router(state: AppState) -> Router {
    finish(hosts_routes(), state)
}

/// The events function.
pub fn events_router(state: AppState) -> Router {
    finish(events_routes(), state)
}

/// Every route on one Router: `poolmgr-local` and the tests.
pub fn router(state: AppState) -> Router {
    finish(
        claims_routes().merge(leases_routes()).merge(pools_routes()).merge(hosts_routes()).merge(events_routes()),
        state,
    )
}
