//! The pools function's routes: create, list, get, update and delete (drain) a pool, and
//! list its revisions.
//!
//! Handlers parse the pool's path and query, call `service::pool` and map the answer. They
//! must never touch the store. The pools function also serves `/openapi.json` (see `mod.rs`).

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{Admin, ApiJson, ApiPath, ApiQuery, Consumer, Reader, body_error, parse_optional_json, pool_ref};
use super::openapi::{AdminOnly, AlreadyExists, Common, ConsumerOnly, NotFound, PreconditionFailed, ReadOnly};
use crate::api;
use crate::app::AppState;
use crate::domain::{IfMatch, Name, NameFilter, PoolSpec, validate_name};
use crate::error::ApiError;
use crate::service::pool;

/// A pool's namespace and name in a path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct PoolPath {
    #[param(value_type = Name, inline, example = "default")]
    namespace: String,
    #[param(value_type = Name, inline, example = "ci")]
    name: String,
}

/// A pool answer with its `ETag` header: the pool's spec version, for `If-Match`.
fn tagged(code: StatusCode, t: pool::Tagged) -> Result<Response, ApiError> {
    let etag = HeaderValue::from_str(&t.etag.to_string()).map_err(ApiError::internal)?;
    Ok((code, [(header::ETAG, etag)], Json(t.pool)).into_response())
}

/// Creates a pool; the reconciler fills it. Naming an unregistered host, or hosts that cannot
/// run the pool's hooks, is FAILED_PRECONDITION.
#[utoipa::path(
    post, path = "/v1/pools", tag = "pools", operation_id = "create_pool",
    security(("bearer" = [])), request_body = PoolSpec,
    responses((status = 201, description = "The new pool", body = api::Pool, headers(("ETag" = String, description = "The pool's entity tag, for If-Match: a strong tag that changes with every change of its spec (a PUT, a rollout undo or rollback), not of its status"))), Common, AdminOnly, AlreadyExists)
)]
async fn create_pool(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<Response, ApiError> {
    tagged(StatusCode::CREATED, pool::create_tagged(&state, spec, &admin.name).await?)
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct PoolListQuery {
    /// Only this namespace (empty means every namespace).
    #[param(value_type = Option<NameFilter>, inline)]
    namespace: Option<String>,
    #[param(value_type = Option<crate::rules::PageSize>, inline)]
    page_size: Option<i64>,
    /// A `next_page_token`, passed back unchanged (anything else is INVALID_ARGUMENT); empty
    /// for the first page.
    #[param(value_type = Option<crate::rules::PageToken>, inline)]
    page_token: Option<String>,
}

/// Pools with their live status, by namespace and name, one page at a time.
#[utoipa::path(
    get, path = "/v1/pools", tag = "pools", operation_id = "list_pools",
    security(("bearer" = [])), params(PoolListQuery),
    responses((status = 200, description = "The pools", body = api::PoolList), Common, ReadOnly)
)]
async fn list_pools(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiQuery(q): ApiQuery<PoolListQuery>,
) -> Result<Response, ApiError> {
    let ns = q.namespace.filter(|s| !s.is_empty());
    if let Some(ns) = &ns {
        validate_name("namespace", ns).map_err(ApiError::InvalidArgument)?;
    }
    let (pools, next_page_token) = pool::list(&state, ns.as_deref(), q.page_size, q.page_token.as_deref()).await?;
    Ok(Json(api::PoolList { pools, next_page_token }).into_response())
}

/// A pool with its live status.
#[utoipa::path(
    get, path = "/v1/pools/{namespace}/{name}", tag = "pools", operation_id = "get_pool",
    security(("bearer" = [])), params(PoolPath),
    responses((status = 200, description = "The pool", body = api::Pool, headers(("ETag" = String, description = "The pool's entity tag, for If-Match: a strong tag that changes with every change of its spec (a PUT, a rollout undo or rollback), not of its status"))), Common, ReadOnly, NotFound)
)]
async fn get_pool(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiPath((ns, name)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    tagged(StatusCode::OK, pool::get_tagged(&state, &pool_ref(&ns, &name)?).await?)
}

/// The `If-Match` header of a conditional update.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
struct IfMatchHeader {
    /// Update only if the pool's ETag is one of these (`"42"`, or `"41", "42"`), or, for `*`,
    /// if the pool exists. Absent: unconditional.
    #[serde(rename = "If-Match")]
    #[param(rename = "If-Match", example = "\"42\"")]
    if_match: Option<String>,
}

/// Replaces a pool's spec; `namespace` and `name` in the body must match the path. With
/// `If-Match` (the ETag a GET answered) the update is conditional: when the pool's spec
/// changed since, nothing is changed and the answer is 412 FAILED_PRECONDITION with reason
/// ETAG_MISMATCH (of concurrent updates from one ETag exactly one succeeds). Without it,
/// the update is unconditional.
#[utoipa::path(
    put, path = "/v1/pools/{namespace}/{name}", tag = "pools", operation_id = "update_pool",
    security(("bearer" = [])), params(PoolPath, IfMatchHeader), request_body = PoolSpec,
    responses((status = 200, description = "The updated pool", body = api::Pool, headers(("ETag" = String, description = "The pool's entity tag, for If-Match: a strong tag that changes with every change of its spec (a PUT, a rollout undo or rollback), not of its status"))), Common, AdminOnly, NotFound, PreconditionFailed)
)]
async fn update_pool(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    headers: HeaderMap,
    ApiJson(spec): ApiJson<PoolSpec>,
) -> Result<Response, ApiError> {
    let path = pool_ref(&ns, &name)?;
    let if_match = if headers.contains_key(header::IF_MATCH) {
        let values: Vec<&str> = headers
            .get_all(header::IF_MATCH)
            .iter()
            .map(|v| v.to_str().map_err(|_| ApiError::InvalidArgument("If-Match is not visible ASCII".into())))
            .collect::<Result<_, _>>()?;
        Some(IfMatch::parse(values).map_err(ApiError::InvalidArgument)?)
    } else {
        None
    };
    tagged(StatusCode::OK, pool::update_tagged(&state, &path, spec, &admin.name, if_match.as_ref()).await?)
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
    Admin(admin): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<DeletePoolQuery>,
) -> Result<Response, ApiError> {
    pool::delete(&state, &pool_ref(&ns, &name)?, q.force, &admin.name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Announced demand: how many claims are coming and within how long.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ExpectRequest, example = json!({"claims": 50, "within_seconds": 60}))]
struct ExpectBody {
    /// Claims expected (1..=10000).
    #[schema(minimum = 1, maximum = 10000)]
    claims: i32,
    /// Within this many seconds from now (1..=3600).
    #[schema(minimum = 1, maximum = 3600)]
    within_seconds: i32,
}

/// Announces demand a client knows is coming (a CI matrix about to start): the pool pre-warms
/// for it, up to `autoscaling.max` (without autoscaling, bounded by `size`: it only refills
/// faster). The hint expires by itself after `within_seconds` plus the pool's provisioning
/// time. Client role (or admin).
#[utoipa::path(
    post, path = "/v1/pools/{namespace}/{name}/expect", tag = "pools", operation_id = "expect_claims",
    security(("bearer" = [])), params(PoolPath), request_body = ExpectBody,
    responses((status = 202, description = "Recorded: until when, and the size the pool now works towards", body = api::Expected), Common, ConsumerOnly, NotFound)
)]
async fn expect_claims(
    State(state): State<AppState>,
    Consumer(caller): Consumer,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    ApiJson(body): ApiJson<ExpectBody>,
) -> Result<Response, ApiError> {
    let pool = pool_ref(&ns, &name)?;
    crate::service::claim::check_scope(&state, &caller, &pool).await?;
    let out = pool::expect(&state, &pool, body.claims, body.within_seconds).await?;
    Ok((StatusCode::ACCEPTED, Json(out)).into_response())
}

/// The pool's last 10 revisions, newest first: each with the spec that created it and
/// whether it ever rolled out to every warm VM. A revision is made by a change of
/// `microvm_template` or `create_commands`.
#[utoipa::path(
    get, path = "/v1/pools/{namespace}/{name}/revisions", tag = "pools", operation_id = "list_pool_revisions",
    security(("bearer" = [])), params(PoolPath),
    responses((status = 200, description = "The kept revisions, newest first", body = api::RevisionList), Common, ReadOnly, NotFound)
)]
async fn list_pool_revisions(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiPath((ns, name)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::revisions(&state, &pool_ref(&ns, &name)?).await?).into_response())
}

/// Pauses the pool's running rollout: nothing more is surged or retired until it resumes.
/// FAILED_PRECONDITION when no rollout is running.
#[utoipa::path(
    post, path = "/v1/pools/{namespace}/{name}/rollout/pause", tag = "pools", operation_id = "pause_rollout",
    security(("bearer" = [])), params(PoolPath),
    responses((status = 200, description = "The pool, its rollout PAUSED", body = api::Pool), Common, AdminOnly, NotFound)
)]
async fn pause_rollout(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::rollout_pause(&state, &pool_ref(&ns, &name)?, true, &admin.name).await?).into_response())
}

/// Resumes the pool's paused rollout; its progress deadline counts from now.
/// FAILED_PRECONDITION when no rollout is paused.
#[utoipa::path(
    post, path = "/v1/pools/{namespace}/{name}/rollout/resume", tag = "pools", operation_id = "resume_rollout",
    security(("bearer" = [])), params(PoolPath),
    responses((status = 200, description = "The pool, its rollout PROGRESSING", body = api::Pool), Common, AdminOnly, NotFound)
)]
async fn resume_rollout(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(Json(pool::rollout_pause(&state, &pool_ref(&ns, &name)?, false, &admin.name).await?).into_response())
}

/// Which kept revision an undo returns to.
#[derive(Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
#[schema(as = UndoRequest, example = json!({"to_revision": 2}))]
struct UndoBody {
    /// A kept revision (`GET …/revisions`); absent: the newest kept one before the pool's.
    #[serde(default)]
    #[schema(minimum = 1)]
    to_revision: Option<i32>,
}

/// Returns the pool to a kept revision (its `microvm_template` and `create_commands`) and
/// starts a rollout to it. The pool needs a rollout policy. An empty body (or `{}`) goes
/// back to the newest kept revision before the pool's.
#[utoipa::path(
    post, path = "/v1/pools/{namespace}/{name}/rollout/undo", tag = "pools", operation_id = "undo_rollout",
    security(("bearer" = [])), params(PoolPath),
    request_body(content = Option<UndoBody>, description = "Optional"),
    responses((status = 200, description = "The pool, rolling to the revision", body = api::Pool), Common, AdminOnly, NotFound)
)]
async fn undo_rollout(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath((ns, name)): ApiPath<(String, String)>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let body: UndoBody = parse_optional_json(&body)?;
    let pool = pool_ref(&ns, &name)?;
    Ok(Json(pool::rollout_undo(&state, &pool, body.to_revision, &admin.name).await?).into_response())
}

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_pool, list_pools))
        .routes(routes!(get_pool, update_pool, delete_pool))
        .routes(routes!(expect_claims))
        .routes(routes!(list_pool_revisions))
        .routes(routes!(pause_rollout))
        .routes(routes!(resume_rollout))
        .routes(routes!(undo_rollout))
}
