//! Connections and schema: the deadpool pool, refinery migrations, and the version check
//! that refuses a database a newer binary has migrated.
//!
//! No connection carries session state (no `SET`, no advisory locks, no named prepared
//! statements from the store), so everything here works through RDS Proxy or PgBouncer in
//! transaction mode.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Timeouts};
use refinery::Target;

use crate::config::Config;

mod embedded {
    refinery::embed_migrations!("../../migrations");
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid DATABASE_URL: {0}")]
    BadUrl(String),
    #[error("cannot build the connection pool: {0}")]
    Pool(String),
    #[error("cannot reach PostgreSQL: {0}; is it running and is DATABASE_URL right?")]
    Connect(String),
    #[error(
        "the database schema is at version {database}, but this binary only knows versions up to {binary}: \
         a newer poolmgr migrated it. Deploy the newer binaries (or restore a backup taken before that migration)"
    )]
    SchemaTooNew { database: i32, binary: i32 },
    #[error("the database schema is at version {database}, this binary needs {binary}: run the migrate step first")]
    SchemaTooOld { database: i32, binary: i32 },
    #[error("migration failed: {0}")]
    Migrate(String),
}

/// The newest schema version this binary carries.
pub fn latest_version() -> i32 {
    embedded::migrations::runner().get_migrations().iter().map(|m| m.version()).max().unwrap_or(0)
}

/// Builds the connection pool. Connections are opened lazily, on first use.
pub fn connect_pool(url: &str, size: usize, connect_timeout: Duration) -> Result<Pool, DbError> {
    let mut pg: tokio_postgres::Config =
        url.parse().map_err(|e: tokio_postgres::Error| DbError::BadUrl(e.to_string()))?;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(connect_timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("poolmgr");
    }
    // `Fast` recycling checks the socket is open; a dead one is replaced on the next get.
    let mgr =
        Manager::from_config(pg, tokio_postgres::NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    Pool::builder(mgr)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .timeouts(Timeouts {
            wait: Some(connect_timeout),
            create: Some(connect_timeout),
            recycle: Some(connect_timeout),
        })
        .build()
        .map_err(|e| DbError::Pool(e.to_string()))
}

pub fn pool_from_config(cfg: &Config) -> Result<Pool, DbError> {
    connect_pool(&cfg.database_url, cfg.db_pool_size, cfg.db_connect_timeout)
}

/// Opens one dedicated connection (migrations need `&mut Client`).
pub async fn connect_one(url: &str) -> Result<tokio_postgres::Client, DbError> {
    let (client, conn) =
        tokio_postgres::connect(url, tokio_postgres::NoTls).await.map_err(|e| DbError::Connect(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "migration connection closed");
        }
    });
    Ok(client)
}

async fn applied_version(client: &mut tokio_postgres::Client) -> Result<i32, DbError> {
    // A database never migrated has no history table; refinery errors on it.
    let exists: bool = client
        .query_one("SELECT to_regclass('refinery_schema_history') IS NOT NULL", &[])
        .await
        .map_err(|e| DbError::Connect(e.to_string()))?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let last = embedded::migrations::runner()
        .get_last_applied_migration_async(client)
        .await
        .map_err(|e| DbError::Migrate(e.to_string()))?;
    Ok(last.map(|m| m.version()).unwrap_or(0))
}

/// Applies every pending migration (up to `target`, or all), refusing a newer database.
/// Returns the versions applied.
pub async fn migrate(client: &mut tokio_postgres::Client, target: Option<i32>) -> Result<Vec<i32>, DbError> {
    let binary = latest_version();
    let database = applied_version(client).await?;
    if database > binary {
        return Err(DbError::SchemaTooNew { database, binary });
    }
    let runner = embedded::migrations::runner()
        .set_abort_divergent(true)
        .set_abort_missing(true)
        .set_target(target.map_or(Target::Latest, Target::Version));
    let report = runner.run_async(client).await.map_err(|e| DbError::Migrate(e.to_string()))?;
    let applied: Vec<i32> = report.applied_migrations().iter().map(|m| m.version()).collect();
    for m in report.applied_migrations() {
        tracing::info!(version = m.version(), name = m.name(), "migration applied");
    }
    Ok(applied)
}

/// Connects to `url` and migrates to the latest version.
pub async fn migrate_url(url: &str) -> Result<Vec<i32>, DbError> {
    let mut client = connect_one(url).await?;
    migrate(&mut client, None).await
}

/// Checks the database is at exactly the version this binary was built for. Functions that
/// do not migrate call this at start so a version skew fails loudly instead of mid-request.
pub async fn check_schema(url: &str) -> Result<(), DbError> {
    let mut client = connect_one(url).await?;
    let binary = latest_version();
    let database = applied_version(&mut client).await?;
    match database.cmp(&binary) {
        std::cmp::Ordering::Greater => Err(DbError::SchemaTooNew { database, binary }),
        std::cmp::Ordering::Less => Err(DbError::SchemaTooOld { database, binary }),
        std::cmp::Ordering::Equal => Ok(()),
    }
}
