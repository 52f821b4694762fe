//! The events function's route: `GET /v1/events`, the outbox as a cursor feed with an
//! optional long-poll.
//!
//! The handler checks the cursor, limit and wait, calls `service::event` and maps the
//! answer. It must never touch the store.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{ApiQuery, Reader, optional_name};
use super::openapi::{Common, ReadOnly};
use crate::api;
use crate::app::AppState;
use crate::domain::NameFilter;
use crate::error::ApiError;
use crate::rules::{DEFAULT_EVENTS_LIMIT, EventsLimit, MAX_EVENTS_LIMIT, MAX_EVENTS_WAIT_SECONDS, WaitSeconds};
use crate::service::event;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Events with a greater id (the previous answer's `next_after`).
    #[serde(default)]
    #[param(minimum = 0, default = 0)]
    after: i64,
    /// Only this pool namespace (empty means any).
    #[param(value_type = Option<NameFilter>, inline)]
    namespace: Option<String>,
    /// Only pools of this name (empty means any).
    #[param(value_type = Option<NameFilter>, inline)]
    pool: Option<String>,
    #[param(value_type = Option<EventsLimit>, inline)]
    limit: Option<i64>,
    /// Long-poll: wait up to this long for a first new event.
    #[serde(default)]
    #[param(value_type = Option<WaitSeconds>, inline)]
    wait_seconds: u64,
}

/// The outbox as a cursor feed.
///
/// A consumer that always passes the last `next_after` receives every event exactly once, in
/// id order, even while writers commit concurrently: an id is never handed out while a
/// smaller one may still commit. Events older than the retention (`POOLMGR_EVENTS_RETENTION`,
/// 7 days by default) are pruned.
#[utoipa::path(
    get, path = "/v1/events", tag = "events", operation_id = "list_events",
    security(("bearer" = [])), params(EventsQuery),
    responses((status = 200, description = "Events after the cursor", body = api::EventList), Common, ReadOnly)
)]
async fn list_events(
    State(state): State<AppState>,
    Reader(_): Reader,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(DEFAULT_EVENTS_LIMIT);
    if !(1..=MAX_EVENTS_LIMIT).contains(&limit) {
        return Err(ApiError::InvalidArgument(format!("limit must be between 1 and {MAX_EVENTS_LIMIT}")));
    }
    if q.wait_seconds > MAX_EVENTS_WAIT_SECONDS {
        return Err(ApiError::InvalidArgument(format!("wait_seconds must be at most {MAX_EVENTS_WAIT_SECONDS}")));
    }
    if q.after < 0 {
        return Err(ApiError::InvalidArgument("after must not be negative".into()));
    }
    let ns = optional_name("namespace", q.namespace)?;
    let pool = optional_name("pool", q.pool)?;
    let wait = Duration::from_secs(q.wait_seconds);
    Ok(Json(event::list(&state, q.after, ns.as_deref(), pool.as_deref(), limit, wait).await?).into_response())
}

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_events))
}
