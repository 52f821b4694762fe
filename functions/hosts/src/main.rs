//! The `hosts` HTTP function: `poolmgr_core::http::hosts_router` on AWS Lambda, built by the
//! first request (`poolmgr_core::app::LazyRouter`).

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    // `--help` and `--version` answer here, before the Lambda runtime starts.
    poolmgr_core::cli::Args::parse_env_only(
        "hosts",
        "poolmgr's hosts function on AWS Lambda: the host and VM routes. Its configuration is read on the first invocation.",
        poolmgr_core::cli::FUNCTION,
    );
    poolmgr_core::telemetry::init();
    lambda_http::run(poolmgr_core::app::LazyRouter::new(poolmgr_core::http::hosts_router)).await
}
