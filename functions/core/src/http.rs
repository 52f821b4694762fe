//! The HTTP contract: one Router per function, the same Router on Lambda, locally and in
//! tests.
//!
//! Handlers parse and authorise, call `service`, and map the answer to JSON. Every
//! rejection — a malformed body, a wrong type, an unknown field, a bad query string, an
//! oversized body, a wrong method — answers in the contract's error shape, never axum's plain
//! text.
//!
//! Each handler carries its `#[utoipa::path]` and is routed with `routes!`, so a route cannot
//! exist without its entry in the OpenAPI document (`crate::openapi`), and the document cannot
//! name a route that is not served.

use std::time::Duration;

use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{LeaseId, Phase, PoolRef, PoolSpec, RequestId, validate_name};
use crate::error::ApiError;
use crate::openapi::{AdminOnly, AlreadyExists, ClaimErrors, Common, HealthErrors, NotFound};
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

/// An optional name filter: empty means absent, anything else must be a valid name.
fn optional_name(field: &str, value: Option<String>) -> Result<Option<String>, ApiError> {
    match value.filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(v) => validate_name(field, &v).map(|()| Some(v)).map_err(ApiError::InvalidArgument),
    }
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

/// ClaimVM's request.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ClaimVMRequest, example = json!({"pool": {"namespace": "default", "name": "ci"}, "request_id": "job-42"}))]
struct ClaimBody {
    pool: PoolRef,
    /// Idempotency key, at most 255 bytes; empty or absent: every call claims a new VM.
    #[serde(default)]
    #[schema(max_length = 255)]
    request_id: Option<String>,
}

/// ClaimVM: one AVAILABLE VM of the pool, or the lease this `request_id` already holds.
#[utoipa::path(
    post, path = "/v1/claims", tag = "claims", operation_id = "claim_vm",
    security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "The same as the body's request_id (if both are given they must be equal)")),
    request_body = ClaimBody,
    responses(
        (status = 200, description = "The lease and its VM, fresh or replayed", body = api::ClaimResponse,
         headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        Common, ClaimErrors,
    )
)]
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

pub fn claims_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(claim_vm))
}

// ---------------------------------------------------------------------------------------
// Leases
// ---------------------------------------------------------------------------------------

/// A lease id in a path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct LeasePath {
    /// A lease id (`lease_id` of a LeaseRecord); a malformed one is NOT_FOUND like any unknown id.
    lease_id: String,
}

/// A lease, by id.
#[utoipa::path(
    get, path = "/v1/leases/{lease_id}", tag = "leases", operation_id = "get_lease",
    security(("bearer" = [])), params(LeasePath),
    responses((status = 200, description = "The lease", body = api::LeaseRecord), Common, NotFound)
)]
async fn get_lease(
    State(state): State<AppState>,
    Caller(_): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(lease::get(&state, &lease_id(&id)?).await?).into_response())
}

/// Extends a lease: `expires_at` = now + the pool's current `heartbeat_expiry_seconds`.
#[utoipa::path(
    post, path = "/v1/leases/{lease_id}/heartbeat", tag = "leases", operation_id = "heartbeat_lease",
    security(("bearer" = [])), params(LeasePath),
    responses((status = 200, description = "The extended lease", body = api::HeartbeatResponse), Common, NotFound)
)]
async fn heartbeat(
    State(state): State<AppState>,
    Caller(_): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let lease = lease::heartbeat(&state, &lease_id(&id)?).await?;
    Ok(Json(api::HeartbeatResponse { lease }).into_response())
}

/// ReleaseVM: the VM is deleted in flintlock, then the VM and the lease go. If flintlock fails
/// the answer is 503, the VM stays DELETING and the reconciler finishes the delete.
#[utoipa::path(
    delete, path = "/v1/leases/{lease_id}", tag = "leases", operation_id = "release_lease",
    security(("bearer" = [])), params(LeasePath),
    responses((status = 204, description = "Released"), Common, NotFound)
)]
async fn release(
    State(state): State<AppState>,
    Caller(_): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    lease::release(&state, &lease_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct LeaseListQuery {
    /// Pool namespace; give both `namespace` and `pool`, or neither (empty means absent).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    namespace: Option<String>,
    /// Pool name; give both `namespace` and `pool`, or neither (empty means absent).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    pool: Option<String>,
    /// Default 100.
    #[param(minimum = 1, maximum = 1000)]
    page_size: Option<i64>,
    /// A `next_page_token`, passed back unchanged.
    page_token: Option<String>,
}

/// Leases ordered by `lease_id`: a client token sees only the leases its own principal
/// claimed, an admin token sees all.
#[utoipa::path(
    get, path = "/v1/leases", tag = "leases", operation_id = "list_leases",
    security(("bearer" = [])), params(LeaseListQuery),
    responses((status = 200, description = "One page of leases", body = api::LeaseList), Common)
)]
async fn list_leases(
    State(state): State<AppState>,
    Caller(p): Caller,
    ApiQuery(q): ApiQuery<LeaseListQuery>,
) -> Result<Response, ApiError> {
    let pool = optional_pool(q.namespace.as_deref(), q.pool.as_deref())?;
    let page = lease::list(&state, &p, pool.as_ref(), q.page_size, q.page_token.as_deref()).await?;
    Ok(Json(api::LeaseList { leases: page.leases, next_page_token: page.next_page_token }).into_response())
}

pub fn leases_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_leases)).routes(routes!(get_lease, release)).routes(routes!(heartbeat))
}

// ---------------------------------------------------------------------------------------
// Pools
// ---------------------------------------------------------------------------------------

/// A pool's namespace and name in a path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct PoolPath {
    #[param(pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", example = "default")]
    namespace: String,
    #[param(pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", example = "ci")]
    name: String,
}

/// Creates a pool; the reconciler fills it. Naming an unregistered host, or hosts that cannot
/// run the pool's hooks, is FAILED_PRECONDITION.
#[utoipa::path(
    post, path = "/v1/pools", tag = "pools", operation_id = "create_pool",
    security(("bearer" = [])), request_body = PoolSpec,
    responses((status = 201, description = "The new pool", body = api::Pool), Common, AdminOnly, AlreadyExists)
)]
async fn create_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<Response, ApiError> {
    Ok((StatusCode::CREATED, Json(pool::create(&state, spec).await?)).into_response())
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct NamespaceQuery {
    /// Only this namespace (empty means every namespace).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    namespace: Option<String>,
}

/// Pools with their live status.
#[utoipa::path(
    get, path = "/v1/pools", tag = "pools", operation_id = "list_pools",
    security(("bearer" = [])), params(NamespaceQuery),
    responses((status = 200, description = "The pools", body = api::PoolList), Common, AdminOnly)
)]
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
    Ok(Json(api::PoolList { pools }).into_response())
}

/// A pool with its live status.
#[utoipa::path(
    get, path = "/v1/pools/{namespace}/{name}", tag = "pools", operation_id = "get_pool",
    security(("bearer" = [])), params(PoolPath),
    responses((status = 200, description = "The pool", body = api::Pool), Common, AdminOnly, NotFound)
)]
async fn get_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::get(&state, &pool_ref(&ns, &name)?).await?).into_response())
}

/// Replaces a pool's spec; `namespace` and `name` in the body must match the path.
#[utoipa::path(
    put, path = "/v1/pools/{namespace}/{name}", tag = "pools", operation_id = "update_pool",
    security(("bearer" = [])), params(PoolPath), request_body = PoolSpec,
    responses((status = 200, description = "The updated pool", body = api::Pool), Common, AdminOnly, NotFound)
)]
async fn update_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::update(&state, &pool_ref(&ns, &name)?, spec).await?).into_response())
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct DeletePoolQuery {
    /// Delete even while VMs are leased (their leases end).
    #[serde(default)]
    #[param(default = false)]
    force: bool,
}

/// Drains and deletes a pool: every VM goes DELETING, leases are removed. Refused with
/// FAILED_PRECONDITION while a VM is leased, unless `force=true`.
#[utoipa::path(
    delete, path = "/v1/pools/{namespace}/{name}", tag = "pools", operation_id = "delete_pool",
    security(("bearer" = [])), params(PoolPath, DeletePoolQuery),
    responses((status = 204, description = "Deleted"), Common, AdminOnly, NotFound)
)]
async fn delete_pool(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<DeletePoolQuery>,
) -> Result<Response, ApiError> {
    pool::delete(&state, &pool_ref(&ns, &name)?, q.force).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub fn pools_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(create_pool, list_pools)).routes(routes!(get_pool, update_pool, delete_pool))
}

// ---------------------------------------------------------------------------------------
// Hosts and VMs
// ---------------------------------------------------------------------------------------

/// A host name in a path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct HostPath {
    #[param(example = "spare")]
    name: String,
}

/// Registers a flintlock host.
#[utoipa::path(
    post, path = "/v1/hosts", tag = "hosts", operation_id = "create_host",
    security(("bearer" = [])), request_body = host::HostSpec,
    responses((status = 201, description = "The new host", body = api::Host), Common, AdminOnly, AlreadyExists)
)]
async fn create_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiJson(spec): ApiJson<host::HostSpec>,
) -> Result<Response, ApiError> {
    Ok((StatusCode::CREATED, Json(host::create(&state, spec).await?)).into_response())
}

/// Registered hosts.
#[utoipa::path(
    get, path = "/v1/hosts", tag = "hosts", operation_id = "list_hosts",
    security(("bearer" = [])),
    responses((status = 200, description = "The hosts", body = api::HostList), Common, AdminOnly)
)]
async fn list_hosts(State(state): State<AppState>, Admin(_): Admin) -> Result<Response, ApiError> {
    Ok(Json(api::HostList { hosts: host::list(&state).await? }).into_response())
}

/// A host.
#[utoipa::path(
    get, path = "/v1/hosts/{name}", tag = "hosts", operation_id = "get_host",
    security(("bearer" = [])), params(HostPath),
    responses((status = 200, description = "The host", body = api::Host), Common, AdminOnly, NotFound)
)]
async fn get_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(host::get(&state, &name).await?).into_response())
}

/// Replaces a host's address, TLS and credentials; a `name` in the body must match the path.
#[utoipa::path(
    put, path = "/v1/hosts/{name}", tag = "hosts", operation_id = "update_host",
    security(("bearer" = [])), params(HostPath), request_body = host::HostSpec,
    responses((status = 200, description = "The updated host", body = api::Host), Common, AdminOnly, NotFound)
)]
async fn update_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
    ApiJson(spec): ApiJson<host::HostSpec>,
) -> Result<Response, ApiError> {
    Ok(Json(host::update(&state, &name, spec).await?).into_response())
}

/// Removes a host; refused (FAILED_PRECONDITION) while a pool names it or it has VMs.
#[utoipa::path(
    delete, path = "/v1/hosts/{name}", tag = "hosts", operation_id = "delete_host",
    security(("bearer" = [])), params(HostPath),
    responses((status = 204, description = "Removed"), Common, AdminOnly, NotFound)
)]
async fn delete_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    host::remove(&state, &name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The optional body of a cordon.
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CordonRequest)]
struct CordonBody {
    /// At most 1024 bytes.
    #[serde(default)]
    #[schema(max_length = 1024)]
    reason: Option<String>,
}

/// Cordons a host: no new placements on it. An empty body cordons without a reason.
#[utoipa::path(
    post, path = "/v1/hosts/{name}/cordon", tag = "hosts", operation_id = "cordon_host",
    security(("bearer" = [])), params(HostPath),
    request_body(content = Option<CordonBody>, description = "Optional"),
    responses((status = 200, description = "The cordoned host", body = api::Host), Common, AdminOnly, NotFound)
)]
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

/// Uncordons a host.
#[utoipa::path(
    post, path = "/v1/hosts/{name}/uncordon", tag = "hosts", operation_id = "uncordon_host",
    security(("bearer" = [])), params(HostPath),
    responses((status = 200, description = "The host", body = api::Host), Common, AdminOnly, NotFound)
)]
async fn uncordon_host(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(host::set_cordon(&state, &name, None).await?).into_response())
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct VmListQuery {
    /// Only this pool namespace (empty means any).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    namespace: Option<String>,
    /// Only pools of this name (empty means any).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    pool: Option<String>,
    /// Only VMs in this phase.
    #[param(value_type = Option<Phase>)]
    phase: Option<String>,
}

/// VMs, optionally filtered.
#[utoipa::path(
    get, path = "/v1/vms", tag = "hosts", operation_id = "list_vms",
    security(("bearer" = [])), params(VmListQuery),
    responses((status = 200, description = "The VMs", body = api::VmList), Common, AdminOnly)
)]
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
    let ns = optional_name("namespace", q.namespace)?;
    let pool = optional_name("pool", q.pool)?;
    let conn = state.conn().await?;
    let vms = store::vm_list(&**conn, ns.as_deref(), pool.as_deref(), phase).await?;
    Ok(Json(api::VmList { vms: vms.iter().map(Into::into).collect() }).into_response())
}

/// A VM id in a path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct VmPath {
    /// `<pool name>-<lowercase ULID>`.
    id: String,
}

/// A VM.
#[utoipa::path(
    get, path = "/v1/vms/{id}", tag = "hosts", operation_id = "get_vm",
    security(("bearer" = [])), params(VmPath),
    responses((status = 200, description = "The VM", body = api::VmRecord), Common, AdminOnly, NotFound)
)]
async fn get_vm(
    State(state): State<AppState>,
    Admin(_): Admin,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let conn = state.conn().await?;
    let vm = store::vm_get(&**conn, &id).await?.ok_or_else(|| ApiError::NotFound(format!("vm {id} not found")))?;
    Ok(Json(crate::api::VmRecord::from(&vm)).into_response())
}

pub fn hosts_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_host, list_hosts))
        .routes(routes!(get_host, update_host, delete_host))
        .routes(routes!(cordon_host))
        .routes(routes!(uncordon_host))
        .routes(routes!(list_vms))
        .routes(routes!(get_vm))
}

// ---------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Events with a greater id (the previous answer's `next_after`).
    #[serde(default)]
    #[param(minimum = 0, default = 0)]
    after: i64,
    /// Only this pool namespace (empty means any).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    namespace: Option<String>,
    /// Only pools of this name (empty means any).
    #[param(pattern = r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)?$")]
    pool: Option<String>,
    /// Default 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// Long-poll: wait up to this long for a first new event.
    #[serde(default)]
    #[param(minimum = 0, maximum = 20, default = 0)]
    wait_seconds: u64,
}

/// The outbox as a cursor feed.
#[utoipa::path(
    get, path = "/v1/events", tag = "events", operation_id = "list_events",
    security(("bearer" = [])), params(EventsQuery),
    responses((status = 200, description = "Events after the cursor", body = api::EventList), Common, AdminOnly)
)]
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
    let ns = optional_name("namespace", q.namespace)?;
    let pool = optional_name("pool", q.pool)?;
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
    Ok(Json(api::EventList { events: events.iter().map(Into::into).collect(), next_after }).into_response())
}

pub fn events_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_events))
}

// ---------------------------------------------------------------------------------------
// Operations: health and metrics
// ---------------------------------------------------------------------------------------

/// Liveness with a database round trip. No token needed.
#[utoipa::path(
    get, path = "/healthz", tag = "operations", operation_id = "healthz",
    responses((status = 200, description = "The database answers", body = api::Health), HealthErrors)
)]
async fn healthz(State(state): State<AppState>) -> Result<Response, ApiError> {
    let conn = state.conn().await?;
    store::ping(&**conn).await?;
    Ok(Json(api::Health { status: "ok" }).into_response())
}

/// Prometheus metrics; the pool gauges are computed from the database at scrape time.
#[utoipa::path(
    get, path = "/metrics", tag = "operations", operation_id = "metrics",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Prometheus text exposition format 0.0.4", body = String, content_type = "text/plain"),
        Common, AdminOnly,
    )
)]
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

/// This document. No token needed.
#[utoipa::path(
    get, path = "/openapi.json", tag = "operations", operation_id = "openapi",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", body = Object))
)]
async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], crate::openapi::document_json()).into_response()
}

async fn no_route() -> ApiError {
    ApiError::NotFound("no such route: see the HTTP API reference".into())
}

/// A route that exists, with a method it does not have. axum adds the `Allow` header.
async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("method {method} is not allowed on {}: see the Allow header", uri.path()))
}

/// Health and metrics, on every function.
fn ops_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(healthz)).routes(routes!(metrics))
}

/// The OpenAPI document: on the pools function (which also owns `/healthz`, `/metrics` and
/// unknown routes behind API Gateway) and on [`router`].
fn openapi_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(openapi_json))
}

/// Writes the request's metrics as EMF lines once it is answered (on Lambda; a no-op with
/// Prometheus only).
async fn flush_metrics(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    state.metrics.flush();
    resp
}

/// Wraps routes with what every function shares: health and metrics, JSON 404s and 405s,
/// the body limit, request ids, request logs and the EMF metrics flush.
fn finish(routes: OpenApiRouter<AppState>, state: AppState) -> Router {
    let (routes, _doc) = routes.merge(ops_routes()).split_for_parts();
    routes
        .fallback(no_route)
        // After every route: it replaces the 405 fallback of the routes present.
        .method_not_allowed_fallback(method_not_allowed)
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

/// The pools function (and the OpenAPI document).
pub fn pools_router(state: AppState) -> Router {
    finish(pools_routes().merge(openapi_routes()), state)
}

/// The hosts function (hosts and VMs).
pub fn hosts_router(state: AppState) -> Router {
    finish(hosts_routes(), state)
}

/// The events function.
pub fn events_router(state: AppState) -> Router {
    finish(events_routes(), state)
}

/// The route table of the whole API: every function's routes, health, metrics and the
/// OpenAPI document. [`router`] serves it and [`crate::openapi::document`] documents it.
pub fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(<crate::openapi::ApiDoc as utoipa::OpenApi>::openapi())
        .merge(claims_routes())
        .merge(leases_routes())
        .merge(pools_routes())
        .merge(hosts_routes())
        .merge(events_routes())
        .merge(ops_routes())
        .merge(openapi_routes())
}

/// Every route on one Router: `poolmgr-local` and the tests.
pub fn router(state: AppState) -> Router {
    // `finish` merges the ops routes itself.
    finish(
        claims_routes()
            .merge(leases_routes())
            .merge(pools_routes())
            .merge(hosts_routes())
            .merge(events_routes())
            .merge(openapi_routes()),
        state,
    )
}
