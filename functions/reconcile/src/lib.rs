//! The scheduled reconcile function: one reconcile pass per EventBridge Scheduler event.
//!
//! EventBridge invokes asynchronously and may retry or overlap invocations; both are safe
//! because a pass only works on pools whose reconcile lease it holds. An error is returned
//! only when a retry can help (the database was unreachable); per-pool failures are in the
//! report and the next scheduled pass retries them.
//!
//! On Lambda the pass's metrics, and the pool gauges (`poolmgr_pool_available`, …) nobody
//! scrapes there, are written as CloudWatch EMF lines after each pass.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::LambdaEvent;
use poolmgr_core::AppState;
use poolmgr_core::reconcile::{self, PassReport};
use poolmgr_core::store::{self, StoreError};
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
    let report = reconcile::run_pass(state).await;
    if report.is_ok()
        && let Err(e) = record_pool_gauges(state).await
    {
        tracing::warn!(error = %e, "cannot read the pool gauges for the metrics");
    }
    state.metrics.flush();
    Ok(report?)
}

/// Records every pool's gauges for the EMF flush (nothing without EMF).
pub async fn record_pool_gauges(state: &AppState) -> Result<(), StoreError> {
    if !state.metrics.emf_enabled() {
        return Ok(());
    }
    let conn = state.db.get().await?;
    let pools = store::pool_gauges(&**conn).await?;
    state.metrics.pool_gauges(&pools);
    Ok(())
}
