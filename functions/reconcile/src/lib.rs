//! The scheduled reconcile function: one reconcile loop per invocation (passes while there is
//! work, `poolmgr_core::reconcile::run_loop`), whatever the payload
//! (the Scheduler's event, `{}` from `aws lambda invoke`, `null` or nothing at all from
//! `cargo lambda invoke` without data: see [`EmptyPayloadAsNull`]). The payload is only logged.
//!
//! The state (configuration, secrets, pool) is built by the first invocation
//! ([`poolmgr_core::app::Instance`]); until it can be, each invocation answers a
//! [`Diagnostic`] saying whether a retry can help, and the next one tries again.
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

use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lambda_runtime::tower::{Layer, Service};
use lambda_runtime::{Diagnostic, LambdaEvent, LambdaInvocation};
use poolmgr_core::AppState;
use poolmgr_core::app::{BootError, Instance};
use poolmgr_core::reconcile::{self, LoopReport, ReconcileError, Start};
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

/// The Lambda error of an instance whose state could not be built: `errorType` as
/// [`PassFailed`]'s, the message says why and whether to wait or fix something.
pub fn boot_failed(e: &BootError) -> Diagnostic {
    let (error_type, advice) = if e.is_retryable() {
        ("Retryable", "retry later")
    } else {
        ("NotRetryable", "a retry will not help until this is fixed")
    };
    Diagnostic {
        error_type: error_type.into(),
        error_message: format!("the reconcile function could not load its configuration ({advice}): {e}"),
    }
}

/// One invocation: the instance's state (built now if needed), then [`handle`].
pub async fn invoke(instance: &Instance<AppState>, event: LambdaEvent<Value>) -> Result<LoopReport, Diagnostic> {
    let state = instance.get().await.map_err(|e| {
        tracing::error!(error = %e, retryable = e.is_retryable(), "cannot build the function's state; the next invocation tries again");
        boot_failed(&e)
    })?;
    handle(state, event).await.map_err(Diagnostic::from)
}

/// One loop (`reconcile::run_loop`): passes while there is work, within the invocation's
/// deadline less the room of one more pass, then a hand-off to a fresh invocation if work
/// remains. `event` is whatever invoked it; its `source` and `detail-type` (the Scheduler's
/// `aws.scheduler`, `Scheduled Event`; a wake's `poolmgr.wake` and why) are logged.
pub async fn handle(state: &AppState, event: LambdaEvent<Value>) -> Result<LoopReport, PassFailed> {
    let field = |name: &str| event.payload.get(name).and_then(Value::as_str).unwrap_or("-").to_owned();
    tracing::info!(
        request_id = %event.context.request_id,
        source = %field("source"),
        detail_type = %field("detail-type"),
        "reconcile invoked"
    );
    // A wake (a claim, a hand-off) lingers for the wakes debounced after it; the schedule's
    // safety-net pass returns at once when it finds nothing to do.
    let start = if field("source") == poolmgr_core::wake::WAKE_SOURCE { Start::Wake } else { Start::Schedule };
    let report = reconcile::run_loop_from(state, budget(state, event.context.deadline), start).await;
    if report.is_ok()
        && let Err(e) = record_pool_gauges(state).await
    {
        tracing::warn!(error = %e, "cannot read the pool gauges for the metrics");
    }
    state.metrics.flush();
    report.map_err(PassFailed)
}

/// How long this invocation may loop: `POOLMGR_RECONCILE_LOOP_SECONDS`, and never closer to
/// the invocation's deadline (`deadline_ms`, milliseconds since the epoch; 0: none known)
/// than one more pass could run (`run_loop` keeps that room before each pass).
pub fn budget(state: &AppState, deadline_ms: u64) -> Duration {
    let configured = state.config.reconcile.loop_budget;
    if deadline_ms == 0 {
        return configured;
    }
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    configured.min(Duration::from_millis(deadline_ms.saturating_sub(now_ms)))
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

/// Reads an empty invocation payload as `null`: `cargo lambda invoke` without data sends no
/// body at all, which no JSON type accepts (the runtime would answer a deserialization error
/// without calling the handler). A layer over the runtime's own services:
/// `Runtime::new(handler).layer(EmptyPayloadAsNull)`.
#[derive(Clone, Copy, Debug)]
pub struct EmptyPayloadAsNull;

impl<S> Layer<S> for EmptyPayloadAsNull {
    type Service = EmptyPayloadAsNullService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        EmptyPayloadAsNullService(inner)
    }
}

/// The service of [`EmptyPayloadAsNull`].
#[derive(Clone, Debug)]
pub struct EmptyPayloadAsNullService<S>(S);

impl<S: Service<LambdaInvocation>> Service<LambdaInvocation> for EmptyPayloadAsNullService<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut invocation: LambdaInvocation) -> Self::Future {
        if invocation.body.iter().all(u8::is_ascii_whitespace) {
            invocation.body = bytes::Bytes::from_static(b"null");
        }
        self.0.call(invocation)
    }
}
