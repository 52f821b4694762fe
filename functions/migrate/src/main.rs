//! Applies the schema migrations in `migrations/` to `DATABASE_URL` (or to the database that
//! `POOLMGR_DATABASE_SECRET_ARN` names, see `poolmgr_core::secrets`).
//!
//! Run it before deploying new function code. As a command it migrates once and exits; on
//! AWS Lambda (`AWS_LAMBDA_RUNTIME_API` set) every invocation migrates: a plain invocation
//! answers with the versions applied, a CloudFormation custom-resource request (the stack's
//! `MigrateOnDeploy`) is answered through its `ResponseURL` ([`custom_resource`]). A database a
//! newer binary migrated is refused.
//!
//! With a runtime login (`POOLMGR_RUNTIME_DATABASE_USER`/`_PASSWORD`, or on AWS the secret
//! `POOLMGR_RUNTIME_DATABASE_SECRET_ARN`) it then creates or updates that role and grants it
//! DML on the tables, nothing more ([`poolmgr_core::db_role`]): the functions log in as it, and
//! the login migrate runs as (the master) is kept for migrations.

mod custom_resource;

use std::time::{Duration, Instant};

use lambda_runtime::{LambdaEvent, service_fn};
use poolmgr_core::db::DbTls;
use serde_json::{Value, json};

/// Connects, retrying for up to `wait`: on a fresh stack RDS Proxy may still be registering its
/// target when CloudFormation first runs the migration.
async fn connect(url: &str, tls: &DbTls, wait: Duration) -> Result<tokio_postgres::Client, String> {
    let deadline = Instant::now() + wait;
    let mut delay = Duration::from_secs(1);
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(15), poolmgr_core::db::connect_one(url, tls)).await;
        let err = match attempt {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "connecting timed out after 15 s".to_owned(),
        };
        if Instant::now() + delay >= deadline {
            return Err(err);
        }
        tracing::warn!(error = %err, retry_in_s = delay.as_secs(), "database not reachable yet");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

async fn run() -> Result<Value, String> {
    let lookup = poolmgr_core::secrets::env_lookup().await.map_err(|e| e.to_string())?;
    let url = lookup("DATABASE_URL")
        .filter(|s| !s.is_empty())
        .ok_or("DATABASE_URL is not set (nor POOLMGR_DATABASE_SECRET_ARN)")?;
    let wait = match lookup("POOLMGR_MIGRATE_CONNECT_WAIT_SECONDS").filter(|s| !s.trim().is_empty()) {
        None => Duration::ZERO,
        Some(s) => Duration::from_secs(
            s.trim().parse().map_err(|_| format!("POOLMGR_MIGRATE_CONNECT_WAIT_SECONDS={s:?} is not a number"))?,
        ),
    };
    let tls = DbTls::from_lookup(&lookup)?;
    let mut client = connect(&url, &tls, wait).await?;
    let runtime = poolmgr_core::db_role::from_lookup(&lookup)?;
    let applied = poolmgr_core::db::migrate(&mut client, None).await.map_err(|e| e.to_string())?;
    // After the migrations, so the grants cover the tables they made.
    let runtime_role = match &runtime {
        Some((user, password)) => {
            poolmgr_core::db_role::ensure(&mut client, user, password).await?;
            tracing::info!(user, "runtime login granted DML on poolmgr's tables");
            Value::String(user.clone())
        }
        None => Value::Null,
    };
    Ok(json!({
        "applied": applied,
        "schema_version": poolmgr_core::db::latest_version(),
        "runtime_role": runtime_role,
    }))
}

async fn handle(event: LambdaEvent<Value>) -> Result<Value, lambda_runtime::Error> {
    match custom_resource::from_event(&event.payload) {
        None => Ok(run().await?),
        Some(Err(e)) => Err(e.into()),
        Some(Ok(req)) => Ok(serde_json::to_value(custom_resource::handle(req, run).await?)?),
    }
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    // `--help` and `--version` answer here, before any connection.
    poolmgr_core::cli::Args::parse_env_only(
        "migrate",
        "Applies poolmgr's schema migrations to DATABASE_URL (or the database POOLMGR_DATABASE_SECRET_ARN names) \
         and exits; on AWS Lambda, migrates on every invocation.",
        poolmgr_core::cli::MIGRATE_BIN,
    );
    poolmgr_core::telemetry::init();
    if std::env::var_os("AWS_LAMBDA_RUNTIME_API").is_some() {
        return lambda_runtime::run(service_fn(handle)).await;
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
