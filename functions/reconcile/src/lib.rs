//! The scheduled reconcile function: one reconcile pass per EventBridge Scheduler event.
//!
//! EventBridge invokes asynchronously and may retry or overlap invocations; both are safe
//! because a pass only works on pools whose reconcile lease it holds. An error is returned
//! only when the pass could not run at all ([`PassFailed`]); its `errorType` says whether a
//! retry can help (`Retryable`: the database was unreachable or timed out; `NotRetryable`:
//! something an operator must fix first). Per-pool failures are in the report and the next
//! scheduled pass retries them.
//!
//! On Lambda the pass's metrics, and the pool gauges (`poolmgr_pool_available`, …) nobody
//! scrapes there, are written as CloudWatch EMF lines after each pass.

use aws_lambda_events::eventbridge::EventBridgeEvent;
use lambda_runtime::{Diagnostic, LambdaEvent};
use poolmgr_core::AppState;
use poolmgr_core::reconcile::{self, PassReport, ReconcileError};
use poolmgr_core::store::{self, StoreError};
use serde_json::Value;

/// A pass that could not run, as the Lambda reports it.
#[derive(Debug)]
pub struct PassFailed(pub ReconcileError);

impl PassFailed {
    pub fn is_retryable(&self) -> bool {
        self.0.is_retryable()
    }
}

impl std::fmt::Display for PassFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_retryable() {
            write!(f, "reconcile pass could not start (retry later): {}", self.0)
        } else {
            write!(f, "reconcile pass could not start (a retry will not help until this is fixed): {}", self.0)
        }
    }
}

impl std::error::Error for PassFailed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// The Lambda error: `errorType` is `Retryable` or `NotRetryable`, the message says why.
impl From<PassFailed> for Diagnostic {
    fn from(e: PassFailed) -> Diagnostic {
        let error_type = if e.is_retryable() { "Retryable" } else { "NotRetryable" };
        Diagnostic { error_type: error_type.into(), error_message: e.to_string() }
    }
}

pub async fn handle(state: &AppState, event: LambdaEvent<EventBridgeEvent<Value>>) -> Result<PassReport, PassFailed> {
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
    report.map_err(PassFailed)
}

/// Records every pool's gauges for the EMF flush (nothing without EMF).
pub async fn record_pool_gauges(state: &AppState) -> Result<(), StoreError> {
    if !state.metrics.emf_enabled() {
        return Ok(());
    }
    let conn = state.db.get().await?;
    let pools = store::pool_gauges(&conn).await?;
    state.metrics.pool_gauges(&pools);
    Ok(())
}
