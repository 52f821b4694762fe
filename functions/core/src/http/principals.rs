//! Client scopes and quotas (`/v1/principals`): admins set and remove them, admins and viewers
//! read them. Served by the hosts function (the fleet's other admin routes).
//!
//! Handlers parse and authorise, call `service::principal` and map the answer.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{Admin, ApiJson, ApiPath, Reader};
use super::openapi::{AdminOnly, Common, NotFound, ReadOnly};
use crate::api;
use crate::app::AppState;
use crate::error::ApiError;
use crate::service::principal;

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct PrincipalPath {
    /// A token's name.
    #[param(example = "ci")]
    name: String,
}

/// The body of `PUT /v1/principals/{name}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = PrincipalLimitsSpec)]
struct LimitsBody {
    /// Pool patterns (`namespace/*`, `namespace/name`, at most 100); absent or `null`: every
    /// pool; `[]`: none.
    #[serde(default)]
    #[schema(example = json!(["team-a/*"]))]
    pools: Option<Vec<String>>,
    /// Live leases at most (≥ 0); absent or `null`: no quota.
    #[serde(default)]
    #[schema(minimum = 0, example = 10)]
    max_live_leases: Option<i32>,
}

/// Every principal that has limits.
#[utoipa::path(
    get, path = "/v1/principals", tag = "principals", operation_id = "list_principal_limits",
    security(("bearer" = [])),
    responses((status = 200, description = "Principals with limits", body = api::PrincipalLimitsList), Common, ReadOnly)
)]
async fn list_limits(State(state): State<AppState>, Reader(_): Reader) -> Result<Response, ApiError> {
    Ok(Json(principal::list(&state).await?).into_response())
}

/// One principal's limits and what its quota counts now; 404 if it has none.
#[utoipa::path(
    get, path = "/v1/principals/{name}", tag = "principals", operation_id = "get_principal_limits",
    security(("bearer" = [])), params(PrincipalPath),
    responses((status = 200, description = "The limits", body = api::PrincipalLimits), Common, ReadOnly, NotFound)
)]
async fn get_limits(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    Ok(Json(principal::get(&state, &name).await?).into_response())
}

/// Sets a client principal's scope and quota (201 when it had none). Every instance applies
/// them within `POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS`; admins are never limited.
#[utoipa::path(
    put, path = "/v1/principals/{name}", tag = "principals", operation_id = "set_principal_limits",
    security(("bearer" = [])), params(PrincipalPath), request_body = LimitsBody,
    responses(
        (status = 200, description = "The limits", body = api::PrincipalLimits),
        (status = 201, description = "The limits, new", body = api::PrincipalLimits),
        Common, AdminOnly
    )
)]
async fn set_limits(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath(name): ApiPath<String>,
    ApiJson(body): ApiJson<LimitsBody>,
) -> Result<Response, ApiError> {
    let (limits, created) = principal::set(&state, &name, body.pools, body.max_live_leases, &admin.name).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(limits)).into_response())
}

/// Removes a principal's limits: it may claim from every pool again, without a quota.
#[utoipa::path(
    delete, path = "/v1/principals/{name}", tag = "principals", operation_id = "delete_principal_limits",
    security(("bearer" = [])), params(PrincipalPath),
    responses((status = 204, description = "Removed"), Common, AdminOnly, NotFound)
)]
async fn delete_limits(
    State(state): State<AppState>,
    Admin(admin): Admin,
    ApiPath(name): ApiPath<String>,
) -> Result<Response, ApiError> {
    principal::remove(&state, &name, &admin.name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_limits)).routes(routes!(get_limits, set_limits, delete_limits))
}
