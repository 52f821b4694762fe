//! The `reconcile` function on AWS Lambda (EventBridge Scheduler), also runnable locally
//! with `cargo lambda invoke reconcile --data-file functions/reconcile/events/scheduled.json`.

use lambda_runtime::{LambdaEvent, service_fn};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    let state = poolmgr_core::app::boot_function().await?;
    let state = &state;
    lambda_runtime::run(service_fn(move |ev: LambdaEvent<_>| reconcile_fn::handle(state, ev))).await
}
