//! The leases function's routes: get, list, heartbeat and release a lease.
//!
//! Handlers parse the lease id and filters, call `service::lease` and map the answer. They
//! must never touch the store.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{ApiPath, ApiQuery, Caller, Consumer, lease_id, optional_pool};
use super::openapi::{Common, ConsumerOnly, NotFound};
use crate::api;
use crate::app::AppState;
use crate::domain::NameFilter;
use crate::error::ApiError;
use crate::rules::{LeaseIdText, PageSize, PageToken};
use crate::service::lease;

/// A lease id in a path.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct LeasePath {
    /// A lease id (`lease_id` of a LeaseRecord); a malformed one is NOT_FOUND like any unknown
    /// id, and so is another principal's unless the token is an admin's.
    #[param(value_type = LeaseIdText, inline)]
    lease_id: String,
}

/// A lease, by id. Lease routes are owner-scoped: a client token reaches only the leases its
/// own principal claimed (another principal's lease is NOT_FOUND, exactly as an unknown id),
/// an admin token reaches every lease.
#[utoipa::path(
    get, path = "/v1/leases/{lease_id}", tag = "leases", operation_id = "get_lease",
    security(("bearer" = [])), params(LeasePath),
    responses((status = 200, description = "The lease", body = api::LeaseRecord), Common, NotFound)
)]
async fn get_lease(
    State(state): State<AppState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(lease::get(&state, &p, &lease_id(&id)?).await?).into_response())
}

/// Extends a lease: `expires_at` = now + the pool's current `heartbeat_expiry_seconds`.
/// Owner-scoped like every lease route.
#[utoipa::path(
    post, path = "/v1/leases/{lease_id}/heartbeat", tag = "leases", operation_id = "heartbeat_lease",
    security(("bearer" = [])), params(LeasePath),
    responses((status = 200, description = "The extended lease", body = api::HeartbeatResponse), Common, ConsumerOnly, NotFound)
)]
async fn heartbeat(
    State(state): State<AppState>,
    Consumer(p): Consumer,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let lease = lease::heartbeat(&state, &p, &lease_id(&id)?).await?;
    Ok(Json(api::HeartbeatResponse { lease }).into_response())
}

/// ReleaseVM: the VM is deleted in flintlock, then the VM and the lease go. If flintlock fails
/// the answer is 503, the VM stays DELETING and the reconciler finishes the delete.
/// Owner-scoped like every lease route.
#[utoipa::path(
    delete, path = "/v1/leases/{lease_id}", tag = "leases", operation_id = "release_lease",
    security(("bearer" = [])), params(LeasePath),
    responses((status = 204, description = "Released"), Common, ConsumerOnly, NotFound)
)]
async fn release(
    State(state): State<AppState>,
    Consumer(p): Consumer,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    lease::release(&state, &p, &lease_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct LeaseListQuery {
    /// Pool namespace; give both `namespace` and `pool`, or neither (empty means absent).
    #[param(value_type = Option<NameFilter>, inline)]
    namespace: Option<String>,
    /// Pool name; give both `namespace` and `pool`, or neither (empty means absent).
    #[param(value_type = Option<NameFilter>, inline)]
    pool: Option<String>,
    #[param(value_type = Option<PageSize>, inline)]
    page_size: Option<i64>,
    /// A `next_page_token`, passed back unchanged (anything else is INVALID_ARGUMENT); empty
    /// for the first page.
    #[param(value_type = Option<PageToken>, inline)]
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

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_leases)).routes(routes!(get_lease, release)).routes(routes!(heartbeat))
}
