//! The `pools` HTTP function: `poolmgr_core::http::pools_router` on AWS Lambda.

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    let state = poolmgr_core::app::boot_function().await?;
    lambda_http::run(poolmgr_core::http::pools_router(state)).await
}
