//! The `claims` HTTP function: `poolmgr_core::http::claims_router` on AWS Lambda, built by the
//! first request (`poolmgr_core::app::LazyRouter`).

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    poolmgr_core::telemetry::init();
    lambda_http::run(poolmgr_core::app::LazyRouter::new(poolmgr_core::http::claims_router)).await
}
