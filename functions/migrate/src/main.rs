//! Applies the schema migrations in `migrations/` to `DATABASE_URL`.
//!
//! Run it before deploying new function code. As a command it migrates once and exits; on
//! AWS Lambda (`AWS_LAMBDA_RUNTIME_API` set) every invocation migrates and answers with the
//! versions applied. A database a newer binary migrated is refused.

use lambda_runtime::{LambdaEvent, service_fn};
use serde_json::{Value, json};

async fn run() -> Result<Value, lambda_runtime::Error> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let applied = poolmgr_core::db::migrate_url(&url).await?;
    Ok(json!({ "applied": applied, "schema_version": poolmgr_core::db::latest_version() }))
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    poolmgr_core::telemetry::init();
    if std::env::var_os("AWS_LAMBDA_RUNTIME_API").is_some() {
        return lambda_runtime::run(service_fn(|_: LambdaEvent<Value>| run())).await;
    }
    match run().await {
        Ok(v) => {
            println!("{v}");
            Ok(())
        }
        Err(e) => {
            eprintln!("migrate: {e}");
            std::process::exit(1);
        }
    }
}
