//! The `reconcile` function on AWS Lambda (EventBridge Scheduler), also runnable locally
//! with `cargo lambda invoke reconcile --data-file functions/reconcile/events/scheduled.json`
//! (or with no data at all). Its state is built by the first invocation
//! (`poolmgr_core::app::Instance`), never before the runtime asks for an event.

use lambda_runtime::{LambdaEvent, Runtime, layers::TracingLayer, service_fn};
use poolmgr_core::app::Instance;
use reconcile_fn::EmptyPayloadAsNull;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    // `--help` and `--version` answer here, before the Lambda runtime starts.
    poolmgr_core::cli::Args::parse_env_only(
        "reconcile",
        "poolmgr's reconcile function on AWS Lambda (EventBridge Scheduler and wakes): reconcile loops over every \
         pool. Its configuration is read on the first invocation.",
        poolmgr_core::cli::FUNCTION,
    );
    poolmgr_core::telemetry::init();
    let instance = Instance::new(|state| state);
    let instance = &instance;
    // What `lambda_runtime::run` does, plus the layer that reads an empty payload as `null`
    // (a layer added later runs first: tracing, then the payload, then the handler).
    Runtime::new(service_fn(move |ev: LambdaEvent<_>| reconcile_fn::invoke(instance, ev)))
        .layer(EmptyPayloadAsNull)
        .layer(TracingLayer::new())
        .run()
        .await
}
