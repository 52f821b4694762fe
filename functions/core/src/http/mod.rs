//! The HTTP contract: one Router per function, the same Router on Lambda, locally and in
//! tests.
//!
//! Handlers parse and authorise, call `service`, and map the answer to JSON; none touches the
//! store. Every rejection — a malformed body, a wrong type, an unknown field, a bad query
//! string, an oversized body, a wrong method — answers in the contract's error shape, never
//! axum's plain text.
//!
//! Each handler carries its `#[utoipa::path]` and is routed with `routes!`, so a route cannot
//! exist without its entry in the OpenAPI document ([`document`]), and the document cannot
//! name a route that is not served.
//!
//! # Layout
//!
//! - this file: the Routers of the functions (`claims_router`, …, [`router`] with every
//!   route), the middleware they share (`finish`), the whole route table ([`api_routes`])
//!   and the OpenAPI document built from it, served at `/openapi.json`.
//! - [`extract`]: the extractors (`ApiJson`, `ApiQuery`, `ApiPath`, `Caller`, `Admin`) and
//!   the parsers of path and query values; `shape`: the check behind `ApiJson` that refuses
//!   an array where the body's schema documents an object.
//! - `claims`, `leases`, `pools`, `hosts` (hosts and VMs), `events`: one file per function's
//!   routes; `ops`: `/livez`, `/readyz`, `/healthz`, `/metrics` and the 404/405 fallbacks,
//!   on every function.
//! - [`openapi`]: what the document's operations share (error responses, bearer scheme) and
//!   the builder of a document from a route table.
//!
//! Imports go one way: this file uses every other file; the route files use [`extract`] and
//! [`openapi`]; [`extract`] uses `shape`; `shape`, [`extract`] and [`openapi`] use neither
//! [`openapi`] nor any route file, and no file imports this one.

mod claims;
mod events;
pub mod extract;
mod hosts;
mod leases;
pub mod openapi;
mod ops;
mod pools;
mod principals;
mod shape;

use std::sync::LazyLock;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::request_id::{MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::app::AppState;
use extract::MAX_BODY_BYTES;

/// This document. No token needed.
#[utoipa::path(
    get, path = "/openapi.json", tag = "operations", operation_id = "openapi",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", body = Object))
)]
async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document_json()).into_response()
}

/// The OpenAPI document: on the pools function (which also owns `/healthz` and `/metrics`
/// behind API Gateway) and on [`router`].
fn openapi_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(openapi_json))
}

/// The document of every route, built once from [`api_routes`].
pub fn document() -> &'static utoipa::openapi::OpenApi {
    static DOC: LazyLock<utoipa::openapi::OpenApi> = LazyLock::new(|| openapi::build(api_routes()));
    &DOC
}

/// [`document`] as the JSON served at `/openapi.json`.
pub fn document_json() -> &'static str {
    static JSON: LazyLock<String> =
        LazyLock::new(|| serde_json::to_string(document()).expect("the OpenAPI document serializes"));
    &JSON
}

/// Writes the request's metrics as EMF lines once it is answered (on Lambda; a no-op with
/// Prometheus only).
async fn flush_metrics(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    state.metrics.flush();
    resp
}

/// Runs the request with its `x-request-id` in [`crate::error::REQUEST_ID`], so an error body
/// names it.
async fn scope_request_id(req: Request, next: Next) -> Response {
    let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    crate::error::REQUEST_ID.scope(id, next.run(req)).await
}

/// A request without `x-request-id` gets a random UUID ([`crate::domain::random_uuid`]: no
/// system call per request, unlike tower-http's `MakeRequestUuid`).
#[derive(Clone, Copy)]
struct RandomRequestId;

impl MakeRequestId for RandomRequestId {
    fn make_request_id<B>(&mut self, _: &http::Request<B>) -> Option<RequestId> {
        let id = crate::domain::random_uuid().to_string();
        http::HeaderValue::from_str(&id).ok().map(RequestId::new)
    }
}

/// Wraps routes with what every function shares: health and metrics, JSON 404s and 405s,
/// the body limit, request ids, request logs and the EMF metrics flush.
fn finish(routes: OpenApiRouter<AppState>, state: AppState) -> Router {
    let (routes, _doc) = routes.merge(ops::routes()).split_for_parts();
    routes
        .fallback(ops::no_route)
        // After every route: it replaces the 405 fallback of the routes present.
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), flush_metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(scope_request_id))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
        }))
        .layer(SetRequestIdLayer::x_request_id(RandomRequestId))
        .with_state(state)
}

/// The claims function.
pub fn claims_router(state: AppState) -> Router {
    finish(claims::routes(), state)
}

/// The leases function.
pub fn leases_router(state: AppState) -> Router {
    finish(leases::routes(), state)
}

/// The pools function (and the OpenAPI document).
pub fn pools_router(state: AppState) -> Router {
    finish(pools::routes().merge(openapi_routes()), state)
}

/// The hosts function (hosts and VMs).
pub fn hosts_router(state: AppState) -> Router {
    finish(hosts::routes().merge(principals::routes()), state)
}

/// The events function.
pub fn events_router(state: AppState) -> Router {
    finish(events::routes(), state)
}

/// The route table of the whole API: every function's routes, health, metrics and the
/// OpenAPI document. [`router`] serves it and [`document`] documents it.
pub fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .merge(claims::routes())
        .merge(leases::routes())
        .merge(pools::routes())
        .merge(hosts::routes())
        .merge(principals::routes())
        .merge(events::routes())
        .merge(ops::routes())
        .merge(openapi_routes())
}

/// Every route on one Router: `poolmgr-local` and the tests.
pub fn router(state: AppState) -> Router {
    // `finish` merges the ops routes itself.
    finish(
        claims::routes()
            .merge(leases::routes())
            .merge(pools::routes())
            .merge(hosts::routes())
            .merge(principals::routes())
            .merge(events::routes())
            .merge(openapi_routes()),
        state,
    )
}
