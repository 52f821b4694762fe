//! The routes every function serves: `/healthz` and `/metrics`, and the JSON answers for an
//! unknown route (404) or a wrong method (405).
//!
//! Handlers call `service::ops` and map the answer; they must never touch the store.
//! `/openapi.json` is served from `mod.rs`, next to the route table it documents, so that no
//! file of this folder imports `mod.rs`.

use axum::Json;
use axum::extract::State;
use axum::http::{Method, Uri, header};
use axum::response::{IntoResponse, Response};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::Admin;
use super::openapi::{AdminOnly, Common, HealthErrors};
use crate::api;
use crate::app::AppState;
use crate::error::ApiError;
use crate::service::ops;

/// Liveness with a database round trip. No token needed.
#[utoipa::path(
    get, path = "/healthz", tag = "operations", operation_id = "healthz",
    responses((status = 200, description = "The database answers", body = api::Health), HealthErrors)
)]
async fn healthz(State(state): State<AppState>) -> Result<Response, ApiError> {
    ops::health(&state).await?;
    Ok(Json(api::Health { status: "ok".into() }).into_response())
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
    let text = ops::metrics_text(&state).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

pub(super) async fn no_route() -> ApiError {
    ApiError::NotFound("no such route: see the HTTP API reference".into())
}

/// A route that exists, with a method it does not have. axum adds the `Allow` header.
pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("method {method} is not allowed on {}: see the Allow header", uri.path()))
}

/// Health and metrics, on every function.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(healthz)).routes(routes!(metrics))
}
