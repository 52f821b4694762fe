//! The routes every function serves: the probes `/livez` (the process answers; no database)
//! and `/readyz` (the database answers with this binary's schema), `/healthz` (kept: the same
//! as `/readyz`), `/metrics`, and the JSON answers for an unknown route (404) or a wrong
//! method (405).
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

use super::extract::Reader;
use super::openapi::{Common, HealthErrors, ReadOnly};
use crate::api;
use crate::app::AppState;
use crate::error::ApiError;
use crate::service::ops;

fn ok() -> Response {
    Json(api::Health { status: "ok".into() }).into_response()
}

/// Liveness: the process answers. Touches no database, so an unreachable database never
/// gets a live process restarted. No token needed.
#[utoipa::path(
    get, path = "/livez", tag = "operations", operation_id = "livez",
    responses((status = 200, description = "The process is up", body = api::Health))
)]
async fn livez() -> Response {
    ok()
}

/// Readiness: the database answers and its newest applied migration is this binary's
/// newest (version, name and checksum). No token needed.
#[utoipa::path(
    get, path = "/readyz", tag = "operations", operation_id = "readyz",
    responses((status = 200, description = "The database answers, with this binary's schema", body = api::Health), HealthErrors)
)]
async fn readyz(State(state): State<AppState>) -> Result<Response, ApiError> {
    ops::ready(&state).await?;
    Ok(ok())
}

/// The same check as `/readyz`, kept under its old name. No token needed.
#[utoipa::path(
    get, path = "/healthz", tag = "operations", operation_id = "healthz",
    responses((status = 200, description = "The database answers, with this binary's schema (as /readyz)", body = api::Health), HealthErrors)
)]
async fn healthz(State(state): State<AppState>) -> Result<Response, ApiError> {
    ops::ready(&state).await?;
    Ok(ok())
}

/// Prometheus metrics; the pool gauges are computed from the database at scrape time.
#[utoipa::path(
    get, path = "/metrics", tag = "operations", operation_id = "metrics",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Prometheus text exposition format 0.0.4", body = String, content_type = "text/plain"),
        Common, ReadOnly,
    )
)]
async fn metrics(State(state): State<AppState>, Reader(_): Reader) -> Result<Response, ApiError> {
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

/// Probes, health and metrics, on every function.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(livez))
        .routes(routes!(readyz))
        .routes(routes!(healthz))
        .routes(routes!(metrics))
}
