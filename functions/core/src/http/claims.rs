//! The claims function's route: `POST /v1/claims` (ClaimVM).
//!
//! The handler reconciles the `Idempotency-Key` header with the body's `request_id`, parses
//! both, calls `service::claim` and maps the answer (with `Idempotent-Replayed` on a replay).
//! It must never touch the store or decide anything about the claim itself.

use std::time::Instant;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::{ApiJson, Consumer, pool_ref};
use super::openapi::{ClaimErrors, Common, ConsumerOnly};
use crate::api;
use crate::app::AppState;
use crate::domain::{PoolRef, RequestId};
use crate::error::ApiError;
use crate::rules::{IdempotencyKey, RequestIdText};
use crate::service::claim;

/// ClaimVM's request.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ClaimVMRequest, example = json!({"pool": {"namespace": "default", "name": "ci"}, "request_id": "job-42"}))]
struct ClaimBody {
    pool: PoolRef,
    #[serde(default)]
    #[schema(value_type = Option<RequestIdText>)]
    request_id: Option<String>,
}

/// ClaimVM: one AVAILABLE VM of the pool, or the lease this `request_id` already holds.
#[utoipa::path(
    post, path = "/v1/claims", tag = "claims", operation_id = "claim_vm",
    security(("bearer" = [])),
    params(("Idempotency-Key" = inline(Option<IdempotencyKey>), Header, description = "The same as the body's request_id (if both are given they must be equal)")),
    request_body = ClaimBody,
    responses(
        (status = 200, description = "The lease and its VM, fresh or replayed", body = api::ClaimResponse,
         headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        Common, ConsumerOnly, ClaimErrors,
    )
)]
async fn claim_vm(
    State(state): State<AppState>,
    Consumer(p): Consumer,
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
    let started = Instant::now();
    let resp = claim::claim(&state, &p, claim::ClaimRequest { pool: pool.clone(), request_id }).await?;
    let replayed = resp.replayed;
    state.metrics.claim_duration(&pool, replayed, started.elapsed().as_secs_f64());
    let mut r = Json(resp).into_response();
    if replayed {
        r.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(r)
}

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(claim_vm))
}
