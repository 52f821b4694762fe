//! The scheduled reconcile function: one reconcile pass per EventBridge Scheduler event.
//!
//! EventBridge invokes asynchronously and may retry or overlap invocations; both are safe
//! because a pass only works on pools whose reconcile lease it holds. An error is returned
//! only when a retry can help (the database was unreachable); per-pool failures are in the
//! report and the next scheduled pass retries them.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::LambdaEvent;
use poolmgr_core::AppState;
use poolmgr_core::reconcile::{self, PassReport};
use serde_json::Value;

pub async fn handle(
    state: &AppState,
    event: LambdaEvent<EventBridgeEvent<Value>>,
) -> Result<PassReport, lambda_runtime::Error> {
    tracing::info!(
        request_id = %event.context.request_id,
        source = %event.payload.source,
        detail_type = %event.payload.detail_type,
        "scheduled reconcile"
    );
    Ok(reconcile::run_pass(state).await?)
}
