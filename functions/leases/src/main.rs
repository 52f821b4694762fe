//! The `leases` HTTP function: `poolmgr_core::http::leases_router` on AWS Lambda, built by the
//! first request (`poolmgr_core::app::LazyRouter`).

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    // `--help` and `--version` answer here, before the Lambda runtime starts.
    poolmgr_core::cli::Args::parse_env_only(
        "leases",
        "poolmgr's leases function on AWS Lambda: the lease routes. Its configuration is read on the first invocation.",
        poolmgr_core::cli::FUNCTION,
    );
    poolmgr_core::telemetry::init();
    lambda_http::run(poolmgr_core::app::LazyRouter::new(poolmgr_core::http::leases_router)).await
}
