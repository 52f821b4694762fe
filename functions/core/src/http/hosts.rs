//! The hosts function's routes: flintlock hosts (register, list, get, update, remove,
//! cordon, uncordon) and the VMs on them (list, get, discard).
//!
//! Handlers parse and authorise (every route is admin-only), call `service::host` or
//! `service::vm` and map the answer. They must never touch the store.

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{Admin, ApiJson, ApiPath, ApiQuery, Reader, body_error, optional_name, parse_optional_json};
use super::openapi::{AddressTaken, AdminOnly, AlreadyExists, Common, NotFound, ReadOnly};
use crate::api;
use crate::app::AppState;
use crate::domain::{Name, NameFilter, Phase, PhaseFilter};
use crate::error::ApiError;
use crate::rules::{CordonReason, MAX_CORDON_REASON_CHARS};
use crate::service::{host, vm};

/// A host name in a path. Only `PUT` checks it (400); elsewhere a malformed name is NOT_FOUND
/// like any unknown one.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct HostPath {
    #[param(value_type = Name, inline, example = "spare")]
    name: String,
}

/// Registers a flintlock host: once per name and once per address (one record per flintlockd).
#[utoipa::path(
    post, path = "/v1/hosts", tag = "hosts", operation_id = "create_host",
    security(("bearer" = [])), request_body = host::HostCreate,
    responses((status = 201, description = "The new host", body = api::Host), Common, AdminOnly, AlreadyExists)
)]
async fn create_host(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiJson(spec): ApiJson<host::HostSpec>,
) -> Result<Response, ApiError> {
    Ok((StatusCode::CREATED, Json(host::create(&state, spec, &admin.name).await?)).into_response())
}

/// Registered hosts by name, one page at a time.
#[utoipa::path(
    get, path = "/v1/hosts", tag = "hosts", operation_id = "list_hosts",
    security(("bearer" = [])), params(HostListQuery),
    responses((status = 200, description = "The hosts", body = api::HostList), Common, ReadOnly)
)]
async fn list_hosts(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiQuery(q): ApiQuery<HostListQuery>,
) -> Result<Response, ApiError> {
    let (hosts, next_page_token) = host::list(&state, q.page_size, q.page_token.as_deref()).await?;
    Ok(Json(api::HostList { hosts, next_page_token }).into_response())
}

/// A host.
#[utoipa::path(
    get, path = "/v1/hosts/{name}", tag = "hosts", operation_id = "get_host",
    security(("bearer" = [])), params(HostPath),
    responses((status = 200, description = "The host", body = api::Host), Common, ReadOnly, NotFound)
)]
async fn get_host(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(host::get(&state, &name).await?).into_response())
}

/// Replaces a host's address, TLS and credentials; a `name` in the body must match the path,
/// and the address must not be another host's.
#[utoipa::path(
    put, path = "/v1/hosts/{name}", tag = "hosts", operation_id = "update_host",
    security(("bearer" = [])), params(HostPath), request_body = host::HostSpec,
    responses((status = 200, description = "The updated host", body = api::Host), Common, AdminOnly, NotFound, AddressTaken)
)]
async fn update_host(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath(name): ApiPath<String>,
    ApiJson(spec): ApiJson<host::HostSpec>,
) -> Result<Response, ApiError> {
    Ok(Json(host::update(&state, &name, spec, &admin.name).await?).into_response())
}

/// Removes a host; refused (FAILED_PRECONDITION) while a pool names it or it has VMs.
#[utoipa::path(
    delete, path = "/v1/hosts/{name}", tag = "hosts", operation_id = "delete_host",
    security(("bearer" = [])), params(HostPath),
    responses((status = 204, description = "Removed"), Common, AdminOnly, NotFound)
)]
async fn delete_host(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    host::remove(&state, &name, &admin.name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The optional body of a cordon.
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CordonRequest)]
struct CordonBody {
    #[serde(default)]
    #[schema(value_type = Option<CordonReason>)]
    reason: Option<String>,
}

/// Cordons a host: no new placements on it. An empty body (or `null`) cordons without a
/// reason.
#[utoipa::path(
    post, path = "/v1/hosts/{name}/cordon", tag = "hosts", operation_id = "cordon_host",
    security(("bearer" = [])), params(HostPath),
    request_body(content = Option<CordonBody>, description = "Optional"),
    responses((status = 200, description = "The cordoned host", body = api::Host), Common, AdminOnly, NotFound)
)]
async fn cordon_host(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath(name): ApiPath<String>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    // The body is optional: an empty one, or JSON `null`, cordons without a reason.
    let body: CordonBody = parse_optional_json(&body)?;
    let reason = body.reason.unwrap_or_default();
    if reason.chars().count() > MAX_CORDON_REASON_CHARS {
        return Err(ApiError::InvalidArgument(format!("reason is longer than {MAX_CORDON_REASON_CHARS} characters")));
    }
    Ok(Json(host::set_cordon(&state, &name, Some(&reason), &admin.name).await?).into_response())
}

/// Uncordons a host.
#[utoipa::path(
    post, path = "/v1/hosts/{name}/uncordon", tag = "hosts", operation_id = "uncordon_host",
    security(("bearer" = [])), params(HostPath),
    responses((status = 200, description = "The host", body = api::Host), Common, AdminOnly, NotFound)
)]
async fn uncordon_host(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(host::set_cordon(&state, &name, None, &admin.name).await?).into_response())
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct VmListQuery {
    /// Only this pool namespace (empty means any).
    #[param(value_type = Option<NameFilter>, inline)]
    namespace: Option<String>,
    /// Only pools of this name (empty means any).
    #[param(value_type = Option<NameFilter>, inline)]
    pool: Option<String>,
    /// Only VMs in this phase (empty means any).
    #[param(value_type = Option<PhaseFilter>, inline)]
    phase: Option<String>,
    #[param(value_type = Option<crate::rules::PageSize>, inline)]
    page_size: Option<i64>,
    /// A `next_page_token`, passed back unchanged (anything else is INVALID_ARGUMENT); empty
    /// for the first page.
    #[param(value_type = Option<crate::rules::PageToken>, inline)]
    page_token: Option<String>,
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct HostListQuery {
    #[param(value_type = Option<crate::rules::PageSize>, inline)]
    page_size: Option<i64>,
    /// A `next_page_token`, passed back unchanged (anything else is INVALID_ARGUMENT); empty
    /// for the first page.
    #[param(value_type = Option<crate::rules::PageToken>, inline)]
    page_token: Option<String>,
}

/// VMs by id, optionally filtered, one page at a time.
#[utoipa::path(
    get, path = "/v1/vms", tag = "hosts", operation_id = "list_vms",
    security(("bearer" = [])), params(VmListQuery),
    responses((status = 200, description = "The VMs", body = api::VmList), Common, ReadOnly)
)]
async fn list_vms(
    State(state): State<AppState>,
    Reader(_): Reader,
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
    let (vms, next_page_token) =
        vm::list(&state, ns.as_deref(), pool.as_deref(), phase, q.page_size, q.page_token.as_deref()).await?;
    Ok(Json(api::VmList { vms, next_page_token }).into_response())
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
    responses((status = 200, description = "The VM", body = api::VmRecord), Common, ReadOnly, NotFound)
)]
async fn get_vm(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(vm::get(&state, &id).await?).into_response())
}

/// Discards a VM (typically QUARANTINED, once an operator looked at it): DELETING, deleted
/// in flintlock, row removed. A LEASED VM is refused with FAILED_PRECONDITION (release its
/// lease instead); a VM already DELETING is finished. 503 if flintlock cannot delete it yet
/// (it stays DELETING and the reconciler finishes it).
#[utoipa::path(
    delete, path = "/v1/vms/{id}", tag = "hosts", operation_id = "delete_vm",
    security(("bearer" = [])), params(VmPath),
    responses((status = 204, description = "Deleted"), Common, AdminOnly, NotFound)
)]
async fn delete_vm(
    State(state): State<AppState>,
    Admin(principal): Admin,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    vm::discard(&state, &id, &principal.name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_host, list_hosts))
        .routes(routes!(get_host, update_host, delete_host))
        .routes(routes!(cordon_host))
        .routes(routes!(uncordon_host))
        .routes(routes!(list_vms))
        .routes(routes!(get_vm, delete_vm))
}
