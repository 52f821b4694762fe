//! Connections and schema: the deadpool pool, refinery migrations, and the version check
//! that refuses a database a newer binary has migrated.
//!
//! No connection carries session state (no `SET`, no advisory locks, no named prepared
//! statements from the store), so everything here works through RDS Proxy or PgBouncer in
//! transaction mode (`scripts/test-pgbouncer.sh` checks). Migrations are the exception:
//! refinery prepares named statements, so the migrate step should connect to PostgreSQL
//! directly (through RDS Proxy it works, pinned to one connection).
//!
//! Lambda: the pool opens connections lazily and replaces ones that died while idle (see
//! [`connect_pool`]); `Config` sizes it to one connection per execution environment.
//!
//! TLS: every connection here (pool, [`connect_one`]) takes its `sslmode` from the URL and its
//! trust anchors from a [`DbTls`] ([`crate::db_tls`] says what each mode checks).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::{
    ClientWrapper, Hook, HookError, Manager, ManagerConfig, Metrics, Pool, QueueMode, RecyclingMethod, Runtime,
    Timeouts,
};
use refinery::Target;

use crate::config::Config;
pub use crate::db_tls::{DbTls, SslMode};
use crate::store::{Executor, Limits, StoreError};

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
    #[error("cannot connect to PostgreSQL over TLS (sslmode={mode}): {cause}; {hint}")]
    Tls { mode: &'static str, cause: String, hint: &'static str },
    #[error(
        "the database schema is at version {database}, but this binary only knows versions up to {binary}: \
         a newer poolmgr migrated it. Deploy the newer binaries (or restore a backup taken before that migration)"
    )]
    SchemaTooNew { database: i32, binary: i32 },
    #[error("the database schema is at version {database}, this binary needs {binary}: run the migrate step first")]
    SchemaTooOld { database: i32, binary: i32 },
    #[error(
        "the database's newest migration V{version} is {database:?}, but this binary's V{version} is {binary:?}: \
         a different build of poolmgr migrated it. Deploy the binaries that match the database"
    )]
    SchemaDiverged { version: i32, database: String, binary: String },
    #[error("migration failed: {0}")]
    Migrate(String),
}

/// The newest schema version this binary carries.
pub fn latest_version() -> i32 {
    embedded::migrations::runner().get_migrations().iter().map(|m| m.version()).max().unwrap_or(0)
}

/// The newest migration this binary embeds: version, name and checksum as refinery records
/// them in `refinery_schema_history`.
pub fn latest_migration() -> Option<(i32, String, String)> {
    embedded::migrations::runner()
        .get_migrations()
        .iter()
        .max_by_key(|m| m.version())
        .map(|m| (m.version(), m.name().to_owned(), m.checksum().to_string()))
}

/// Whether a database whose newest applied migration is `applied`
/// ([`crate::store::schema_latest_applied`]) has the schema this binary was built for: the
/// same newest migration, by version, name and checksum. The readiness check (`/readyz`).
pub fn schema_current(applied: Option<(i32, String, String)>) -> Result<(), DbError> {
    let binary = latest_migration();
    let (database_version, binary_version) = (applied.as_ref().map_or(0, |a| a.0), binary.as_ref().map_or(0, |b| b.0));
    schema_matches(database_version, binary_version)?;
    match (applied, binary) {
        (Some((version, db_name, db_sum)), Some((_, bin_name, bin_sum)))
            if (&db_name, &db_sum) != (&bin_name, &bin_sum) =>
        {
            Err(DbError::SchemaDiverged {
                version,
                database: format!("{db_name} (checksum {db_sum})"),
                binary: format!("{bin_name} (checksum {bin_sum})"),
            })
        }
        _ => Ok(()),
    }
}

/// How [`connect_pool`] builds a pool; [`PoolOptions::from_config`] reads it from `Config`.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub size: usize,
    /// Limit of opening a connection and of waiting for a free one.
    pub connect_timeout: Duration,
    /// A connection idle at least this long is pinged before it is handed out.
    pub check_idle: Duration,
    /// Client-side limit of each store statement (see [`crate::store::Limits`]).
    pub statement_timeout: Option<Duration>,
    /// Send a cancel request for a statement past `statement_timeout`.
    pub cancel_on_timeout: bool,
    /// Trust anchors and the `sslmode` of a URL that names none.
    pub tls: DbTls,
}

impl PoolOptions {
    pub fn from_config(cfg: &Config) -> PoolOptions {
        PoolOptions {
            size: cfg.db_pool_size,
            connect_timeout: cfg.db_connect_timeout,
            check_idle: cfg.db_check_idle,
            statement_timeout: cfg.db_statement_timeout,
            cancel_on_timeout: cfg.db_cancel_on_timeout,
            tls: cfg.db_tls.clone(),
        }
    }
}

/// Longest the liveness ping of an idle connection may take before the connection is
/// replaced. Short: a healthy database answers an empty query in milliseconds, and a dead
/// socket after a Lambda thaw must not eat the request's budget.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// Builds the connection pool. Connections are opened lazily, on first use, so a function
/// starts (and answers 503) while the database is unreachable.
///
/// Stale connections: every checkout drops a connection whose socket is known closed, and a
/// connection idle for `check_idle` or longer is first pinged (an empty simple query, one
/// round trip); a dead one is discarded and the checkout transparently takes or opens
/// another. Idle is what a Lambda freeze looks like from here, so the first request after a
/// thaw never runs on a socket that died meanwhile; back-to-back requests pay nothing.
///
/// Schema check: the first connection the pool opens checks the schema version (once per
/// pool, until it passes). A mismatch fails the checkout (503, logged) instead of the start.
pub fn connect_pool(url: &str, opts: &PoolOptions) -> Result<Db, DbError> {
    let (mut pg, tls, _) = opts.tls.connect_config(url).map_err(DbError::BadUrl)?;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(opts.connect_timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("poolmgr");
    }
    let limits = Limits { statement_timeout: opts.statement_timeout, cancel_on_timeout: opts.cancel_on_timeout };
    // `Fast` recycling only checks the socket is open; the pre-recycle hook adds the ping.
    let mgr = Manager::from_config(pg, tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    let check_idle = opts.check_idle;
    let schema_ok = Arc::new(AtomicBool::new(false));
    let pool = Pool::builder(mgr)
        .max_size(opts.size)
        // The connection returned last goes out first: a few hot server processes serve light
        // load instead of every connection taking turns (deadpool's default is FIFO).
        .queue_mode(QueueMode::Lifo)
        .runtime(Runtime::Tokio1)
        .timeouts(Timeouts {
            wait: Some(opts.connect_timeout),
            create: Some(opts.connect_timeout),
            recycle: Some(opts.connect_timeout),
        })
        .pre_recycle(Hook::async_fn(move |client: &mut ClientWrapper, metrics: &Metrics| {
            Box::pin(async move { check_alive(client, metrics.last_used(), check_idle).await })
        }))
        .post_create(Hook::async_fn(move |client: &mut ClientWrapper, _: &Metrics| {
            let schema_ok = schema_ok.clone();
            Box::pin(async move {
                if schema_ok.load(Ordering::Acquire) {
                    return Ok(());
                }
                let binary = latest_version();
                let database = schema_version_of(client).await.map_err(HookError::Backend)?;
                schema_matches(database, binary).map_err(|e| {
                    tracing::error!(error = %e, "schema version check failed; requests answer 503 until it passes");
                    HookError::message(e.to_string())
                })?;
                schema_ok.store(true, Ordering::Release);
                Ok(())
            })
        }))
        .build()
        .map_err(|e| DbError::Pool(e.to_string()))?;
    Ok(Db { pool, limits })
}

/// The pre-recycle check: `Err` discards the connection and the checkout moves on.
async fn check_alive(client: &ClientWrapper, idle: Duration, check_idle: Duration) -> Result<(), HookError> {
    if client.is_closed() {
        tracing::info!("discarding a closed database connection");
        return Err(HookError::message("connection closed"));
    }
    if idle < check_idle {
        return Ok(());
    }
    match tokio::time::timeout(PING_TIMEOUT, client.simple_query("")).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => {
            tracing::info!(idle_ms = idle.as_millis() as u64, error = %e, "idle database connection is dead; reconnecting");
            Err(HookError::Backend(e))
        }
        Err(_) => {
            tracing::info!(
                idle_ms = idle.as_millis() as u64,
                "idle database connection did not answer a ping; reconnecting"
            );
            Err(HookError::message("liveness ping timed out"))
        }
    }
}

/// The applied schema version, through any client (unnamed statements only, so it works
/// through a transaction-mode pooler).
async fn schema_version_of(client: &tokio_postgres::Client) -> Result<i32, tokio_postgres::Error> {
    let exists: bool =
        client.query_typed_one("SELECT to_regclass('refinery_schema_history') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Ok(0);
    }
    let v: Option<i32> = client.query_typed_one("SELECT max(version) FROM refinery_schema_history", &[]).await?.get(0);
    Ok(v.unwrap_or(0))
}

fn schema_matches(database: i32, binary: i32) -> Result<(), DbError> {
    match database.cmp(&binary) {
        std::cmp::Ordering::Greater => Err(DbError::SchemaTooNew { database, binary }),
        std::cmp::Ordering::Less => Err(DbError::SchemaTooOld { database, binary }),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

pub fn pool_from_config(cfg: &Config) -> Result<Db, DbError> {
    connect_pool(&cfg.database_url, &PoolOptions::from_config(cfg))
}

/// The database handle the state carries: the connection pool and the [`Limits`] every
/// statement on its connections runs under. Cheap to clone (one shared pool).
#[derive(Clone)]
pub struct Db {
    pool: Pool,
    limits: Limits,
}

impl Db {
    /// A pooled connection carrying this handle's limits. An unreachable database is
    /// `Unavailable`; a connection that died while idle is replaced (see [`connect_pool`]).
    pub async fn get(&self) -> Result<Conn, StoreError> {
        Ok(Conn { client: Some(self.pool.get().await?), limits: self.limits, discarded: AtomicBool::new(false) })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The pool itself, for tools and tests that run their own SQL: connections from it
    /// carry no limits.
    pub fn raw(&self) -> &Pool {
        &self.pool
    }
}

/// One pooled connection of a [`Db`]; back to the pool when dropped, unless a statement on it
/// was abandoned at the statement timeout ([`Executor::discard`]): then it is taken out of
/// the pool and closed, and the pool opens a fresh one when it needs one. The abandoned
/// statement may still run on the server, and the cancel request sent for it may arrive
/// late: on a connection handed out again it would cancel someone else's statement.
pub struct Conn {
    /// Always `Some` until the drop.
    client: Option<deadpool_postgres::Object>,
    limits: Limits,
    discarded: AtomicBool,
}

impl Conn {
    fn object(&self) -> &deadpool_postgres::Object {
        self.client.as_ref().expect("a connection is held until dropped")
    }

    /// A transaction on this connection, with the same limits. Dropped without
    /// [`Tx::commit`], it rolls back.
    ///
    /// BEGIN is bounded by the statement timeout like every statement (issue 23 finding 5: a
    /// black-holed connection hung a pass, and `poolmgr-local`'s ticker, at its BEGIN); past
    /// it the connection is discarded and the caller gets `Unavailable`.
    pub async fn transaction(&mut self) -> Result<Tx<'_>, StoreError> {
        let limits = self.limits;
        let client = self.client.as_mut().expect("a connection is held until dropped");
        let tx = match limits.statement_timeout {
            None => client.transaction().await?,
            Some(limit) => match tokio::time::timeout(limit, client.transaction()).await {
                Ok(tx) => tx?,
                Err(_) => {
                    self.discarded.store(true, Ordering::Release);
                    return Err(timed_out("BEGIN", limit));
                }
            },
        };
        Ok(Tx { tx, limits, discarded: &self.discarded })
    }

    /// The socket is known closed (the database restarted, the connection was dropped).
    pub fn is_closed(&self) -> bool {
        self.object().is_closed()
    }

    /// A statement on it was abandoned at the timeout: it must not run another one.
    pub fn is_discarded(&self) -> bool {
        self.discarded.load(Ordering::Acquire)
    }

    /// deadpool's wrapper, for its per-connection statement cache.
    pub(crate) fn wrapper(&self) -> &ClientWrapper {
        self.object()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.is_discarded()
            && let Some(object) = self.client.take()
        {
            // Out of the pool for good; dropping the client closes the connection.
            drop(deadpool_postgres::Object::take(object));
            tracing::info!("closed a database connection whose statement timed out");
        }
    }
}

impl Executor for Conn {
    type Client = tokio_postgres::Client;
    fn pg(&self) -> &Self::Client {
        self.object()
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn discard(&self) {
        self.discarded.store(true, Ordering::Release);
    }
}

/// A transaction of a [`Conn`].
pub struct Tx<'a> {
    tx: deadpool_postgres::Transaction<'a>,
    limits: Limits,
    /// The connection's flag: a statement timeout inside the transaction discards it too.
    discarded: &'a AtomicBool,
}

impl Tx<'_> {
    /// COMMIT, bounded by the statement timeout too: past it the outcome is unknown (the
    /// connection is discarded and the caller gets `Unavailable`, which a client retries with
    /// the same request_id: a replay if it did commit).
    pub async fn commit(self) -> Result<(), StoreError> {
        let Some(limit) = self.limits.statement_timeout else {
            return Ok(self.tx.commit().await?);
        };
        let discarded = self.discarded;
        match tokio::time::timeout(limit, self.tx.commit()).await {
            Ok(r) => Ok(r?),
            Err(_) => {
                discarded.store(true, Ordering::Release);
                Err(timed_out("COMMIT", limit))
            }
        }
    }
}

fn timed_out(what: &str, limit: Duration) -> StoreError {
    StoreError::Unavailable(format!(
        "{what} timed out after {} ms (POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS)",
        limit.as_millis()
    ))
}

impl<'a> Executor for Tx<'a> {
    type Client = tokio_postgres::Transaction<'a>;
    fn pg(&self) -> &Self::Client {
        &self.tx
    }
    fn limits(&self) -> Limits {
        self.limits
    }
    fn in_transaction(&self) -> bool {
        true
    }
    fn discard(&self) {
        self.discarded.store(true, Ordering::Release);
    }
}

/// Opens one dedicated connection (migrations need `&mut Client`; tools run their own SQL),
/// with the `sslmode` of `url` and the trust anchors of `tls`.
pub async fn connect_one(url: &str, tls: &DbTls) -> Result<tokio_postgres::Client, DbError> {
    let (pg, connector, mode) = tls.connect_config(url).map_err(DbError::BadUrl)?;
    let (client, conn) = pg.connect(connector).await.map_err(|e| connect_error(e, mode))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "dedicated database connection closed");
        }
    });
    Ok(client)
}

/// A failed connect in words that say what to change: a TLS failure names the knob that
/// governs it.
fn connect_error(e: tokio_postgres::Error, mode: SslMode) -> DbError {
    let cause = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| format!("{e}: {s}"));
    let hint = if cause.contains("not valid for name") || cause.contains("NotValidForName") {
        "the certificate is not issued for the host name in DATABASE_URL: connect by a name the certificate \
         carries (RDS Proxy: its endpoint; your own server: a subjectAltName of its certificate), or re-issue \
         the server's certificate for the name you connect by"
    } else if cause.contains("invalid peer certificate") {
        "the server's certificate does not chain to a trusted root: set POOLMGR_DATABASE_CA_PEM to the CA that \
         signed it (PEM text or a file path)"
    } else if cause.contains("server does not support TLS") {
        "the server has ssl = off: turn TLS on there, or lower sslmode (prefer) where plaintext is acceptable"
    } else if cause.contains("no encryption") {
        "the server accepts this client only over TLS (a hostssl line in pg_hba.conf, or RDS Proxy's RequireTLS): \
         use sslmode=verify-full"
    } else if mode == SslMode::Disable || !(cause.contains("TLS") || cause.contains("tls")) {
        return DbError::Connect(cause);
    } else {
        "check sslmode in DATABASE_URL and POOLMGR_DATABASE_CA_PEM"
    };
    DbError::Tls { mode: mode.as_str(), cause, hint }
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
    let report = runner.run_async(client).await.map_err(|e| DbError::Migrate(with_causes(&e)))?;
    let applied: Vec<i32> = report.applied_migrations().iter().map(|m| m.version()).collect();
    for m in report.applied_migrations() {
        tracing::info!(version = m.version(), name = m.name(), "migration applied");
    }
    Ok(applied)
}

/// An error with its chain of causes: refinery's own text is only "`error applying
/// migration …`, `db error`", and what the operator needs (the server's message, a
/// migration's RAISE with its hint) is in the causes.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Connects to `url` and migrates to the latest version.
pub async fn migrate_url(url: &str, tls: &DbTls) -> Result<Vec<i32>, DbError> {
    let mut client = connect_one(url, tls).await?;
    migrate(&mut client, None).await
}

/// Checks the database is at exactly the version this binary was built for. Functions that
/// do not migrate call this at start so a version skew fails loudly instead of mid-request.
pub async fn check_schema(url: &str, tls: &DbTls) -> Result<(), DbError> {
    let mut client = connect_one(url, tls).await?;
    let binary = latest_version();
    let database = applied_version(&mut client).await?;
    schema_matches(database, binary)
}
