//! Every SQL statement poolmgr runs, and the one mapping of each table's rows.
//!
//! Rows are read as `to_jsonb(<table alias>)` and decoded into the `*Row` structs, so a
//! table's columns are defined once, by the table, and every statement that returns a row of
//! it (SELECT, INSERT … RETURNING, a CTE) maps it the same way. Statements are named
//! `entity_verb`. Each function takes any [`Executor`] — a pooled connection or a transaction
//! of a [`crate::db::Db`] — so callers compose them into larger transactions.
//!
//! Statements go through `query_typed` (the unnamed statement, parameter types given here):
//! no named prepared statements and no session state, so a transaction-mode pooler (RDS
//! Proxy, PgBouncer) can move the connection between transactions freely. The one exception
//! is the claim, which [`lease_claim`] prepares once per connection when
//! `POOLMGR_DB_PREPARE_CLAIM` is on (default on, off on Lambda; to be set off behind a
//! transaction pooler); the plans that matter are made inside its server-side function and
//! kept per server connection either way. Database errors are translated into `StoreError`
//! in exactly one place, [`interpret`].
//!
//! Every statement is issued through [`Timed`] (`timed_query`, `timed_query_one`, …), which
//! bounds it by the client-side statement timeout of the executor's database handle
//! ([`Limits`]): a server-side `statement_timeout` would need session state or a startup
//! parameter that transaction poolers drop or refuse. A connection whose statement was
//! abandoned at that timeout is discarded; a statement that is its own transaction runs once
//! more after a deadlock or serialization failure ([`timed`]), and [`retry_once`] does that
//! for a caller's whole transaction.
//!
//! The store never decides what a result means to a client (404 or 409, retry or not: that
//! is `service`'s and `reconcile`'s), and never lets a `tokio_postgres` error out untranslated.
//!
//! # Layout
//!
//! One file per table: its row type and every statement named after it, whoever calls the
//! statement (`vm_*` is in `vm.rs`, whether the HTTP API or the reconciler runs it). A
//! statement that touches several tables lives with the entity it is named after
//! (`pool_delete_and_mark_vms` in `pool.rs`, `lease_expire_for_pools` in `lease.rs`).
//!
//! - `pool.rs`: `pools`. [`PoolRow`], [`PoolStatus`]; create, update, get, list, delete.
//!   `pool_work.rs`, its second room: the pass's selection of the pools that may need a step
//!   ([`pool_list_with_work`]), the reconcile lease a pass takes on a pool, and why the pass
//!   holds it below its target.
//! - `host.rs`: `hosts`. [`HostRow`]; register, update, cordon, remove; the orphan-scan lease
//!   and the ServerInfo probe result.
//! - `vm.rs`: `vms`. [`VmRow`]; the one SQL definition of a pool's VM counts
//!   by phase (the pool status, the gauges and `poolmgr-check` read it); get, list, insert,
//!   placement, phase transitions, backoff, hook progress, surplus, an operator's discard and
//!   teardown.
//! - `lease.rs`: `leases`. [`LeaseView`] (a lease with its VM and host); get, heartbeat, list,
//!   release, expiry and its warning.
//! - `event.rs`: `events`. [`EventRow`]; insert, the feed (its horizon and list) and the
//!   retention prune.
//! - `demand.rs`: `pool_refused_claims`, what the sizing step reads of a pool's demand and
//!   writes back (desired size, state, POOL_SCALED), and announced demand (`…/expect`).
//! - `deployment.rs`: `deployment`, the one row with this deployment's id.
//! - `selection.rs`: `reconcile_selection`, the one row saying what the reconcile passes have
//!   seen (the watermark the selection starts from, the cursor of its full checks).
//! - `reconcile_loop.rs`: `reconcile_loop`, the one row whose lease says which reconcile
//!   invocation is looping and until when somebody asked for passes (`reconcile::driver`).
//! - `claim.rs`: the claim statements, which write `leases`, `vms` and `events` at once:
//!   [`LEASE_CLAIM_SQL`] and [`lease_claim`], and the two-phase claim of pools with pre-lease
//!   hooks ([`vm_claim_for_hook`], [`lease_insert_after_hook`]); what a duplicate of a claim
//!   in flight reads and waits on ([`claim_get_by_request_id`], [`vm_wait_for_claimers`]).
//! - `rows.rs`: [`LeaseRow`], kept below `vm.rs` and `lease.rs` because each of those returns
//!   the other's row (no import circle).
//! - this file: [`StoreError`] and [`interpret`], [`Executor`], [`Limits`], [`Timed`] and
//!   [`retry_once`], the jsonb row decoding, [`ping`], and [`schema_latest_applied`]
//!   (refinery's history table, which `db` owns, read for the readiness check).

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row};

mod claim;
mod demand;
mod deployment;
mod event;
mod host;
mod lease;
mod pool;
mod pool_work;
mod principal;
mod reconcile_loop;
mod rollout;
mod rows;
mod selection;
mod vm;

pub use claim::*;
pub use demand::*;
pub use deployment::*;
pub use event::*;
pub use host::*;
pub use lease::*;
pub use pool::*;
pub use pool_work::*;
pub use principal::*;
pub use reconcile_loop::*;
pub use rollout::*;
pub use rows::*;
pub use selection::*;
pub use vm::*;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached or dropped the connection: a retry may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The database refused the statement for now, and nothing it did was kept: a deadlock
    /// (40P01) or a serialization failure (40001), where running the statement or its
    /// transaction again is the documented remedy ([`StoreError::retry_at_once`]), or a
    /// cancelled statement (57014) or a lock it could not get (55P03), where the same wait
    /// would likely happen again: the client backs off instead. Answered 503 with Retry-After.
    #[error("database busy ({code}): {message}")]
    Busy { code: String, message: String },
    /// A unique constraint or index refused a row (`23505`): another transaction committed
    /// the same key first. `constraint` names it; what that means is the caller's to say (a
    /// claim's first transaction: a duplicate of its request_id is already running its hook;
    /// a host write: another host has that address).
    #[error("database refused a duplicate ({constraint}): {message}")]
    UniqueViolation { constraint: String, message: String },
    #[error("database error: {0}")]
    Db(String),
}

impl StoreError {
    /// A deadlock or serialization failure: PostgreSQL rolled the statement (its whole
    /// transaction) back, and running it again at once is expected to succeed.
    pub fn retry_at_once(&self) -> bool {
        matches!(self, StoreError::Busy { code, .. } if code == "40P01" || code == "40001")
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// The one place database errors are translated into our vocabulary.
pub fn interpret(e: tokio_postgres::Error) -> StoreError {
    use tokio_postgres::error::SqlState;
    if e.is_closed() {
        return StoreError::Unavailable(e.to_string());
    }
    let Some(c) = e.code() else {
        // No SQLSTATE: an I/O, TLS or protocol failure talking to the server. Its source says
        // which (tokio-postgres's own text is only "error performing TLS handshake").
        return StoreError::Unavailable(match std::error::Error::source(&e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        });
    };
    // The server's own text (`e.to_string()` is only "db error" for a server error).
    let message = e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned());
    if c.code().starts_with("08")
        || *c == SqlState::ADMIN_SHUTDOWN
        || *c == SqlState::CRASH_SHUTDOWN
        || *c == SqlState::CANNOT_CONNECT_NOW
        || *c == SqlState::TOO_MANY_CONNECTIONS
    {
        StoreError::Unavailable(message)
    } else if *c == SqlState::T_R_DEADLOCK_DETECTED
        || *c == SqlState::T_R_SERIALIZATION_FAILURE
        || *c == SqlState::QUERY_CANCELED
        || *c == SqlState::LOCK_NOT_AVAILABLE
    {
        StoreError::Busy { code: c.code().to_owned(), message }
    } else if *c == SqlState::UNIQUE_VIOLATION {
        let constraint = e.as_db_error().and_then(|d| d.constraint()).unwrap_or_default().to_owned();
        StoreError::UniqueViolation { constraint, message }
    } else {
        StoreError::Db(format!("{message} (SQLSTATE {})", c.code()))
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        interpret(e)
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => interpret(e),
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Executors and the statement timeout
// ---------------------------------------------------------------------------------------

/// The client-side limits of one database handle ([`crate::db::Db`]), which the store applies
/// to every statement run through that handle's connections. They live in the handle, not in
/// a process global, so two handles in one process (tests, tools) can differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Past this a statement is abandoned and answers `Unavailable` (`None`: no limit). A
    /// server-side `statement_timeout` would need session state or a startup parameter that
    /// transaction poolers drop or refuse.
    pub statement_timeout: Option<Duration>,
    /// Send a cancel request for a statement past the timeout, so the server stops working on
    /// it. Turn it off in front of PgBouncer older than 1.19: it can crash on the cancel
    /// request of a client that closes the cancel socket right away, as tokio-postgres does
    /// (PgBouncer issue #801).
    pub cancel_on_timeout: bool,
}

impl Limits {
    /// No timeout: a plain client that a tool or test opened itself.
    pub const NONE: Limits = Limits { statement_timeout: None, cancel_on_timeout: false };
}

/// What the store runs statements on: a connection or transaction of a [`crate::db::Db`]
/// (with that handle's [`Limits`]), or a plain tokio-postgres client or transaction that a
/// tool or test opened itself (no limits). Every store function takes `&impl Executor`, so
/// one function composes into a caller's larger transaction (River's `Executor`).
pub trait Executor: Send + Sync {
    type Client: GenericClient + Sync;
    /// The client statements are sent on.
    fn pg(&self) -> &Self::Client;
    /// The limits every statement on it runs under.
    fn limits(&self) -> Limits;
    /// Statements run inside an explicit transaction: one that fails has aborted the whole
    /// transaction, so it cannot be run again on its own ([`timed`] retries only statements
    /// that are their own transaction).
    fn in_transaction(&self) -> bool {
        false
    }
    /// A statement on this connection was abandoned at the client-side timeout: the
    /// connection must never run another statement (see [`timed`]). A no-op for clients the
    /// store does not pool.
    fn discard(&self) {}
}

impl Executor for tokio_postgres::Client {
    type Client = tokio_postgres::Client;
    fn pg(&self) -> &Self::Client {
        self
    }
    fn limits(&self) -> Limits {
        Limits::NONE
    }
}

impl<'a> Executor for tokio_postgres::Transaction<'a> {
    type Client = tokio_postgres::Transaction<'a>;
    fn pg(&self) -> &Self::Client {
        self
    }
    fn limits(&self) -> Limits {
        Limits::NONE
    }
    fn in_transaction(&self) -> bool {
        true
    }
}

/// Runs one statement on `e`: `statement` makes its future, and is called a second time when
/// the first run hit a deadlock or serialization failure ([`StoreError::retry_at_once`]) and
/// the statement is its own transaction (not [`Executor::in_transaction`]): PostgreSQL rolled
/// all of it back, so running it again is safe whatever it writes. Inside a larger
/// transaction the error aborted the transaction, and it is the caller's to rerun
/// ([`retry_once`]) or to answer 503.
///
/// Each run is bounded by the executor's statement timeout. Past it the statement's future
/// is dropped (tokio-postgres discards the late answer), a cancel request is sent so the
/// server stops working on it (poolers forward cancels; see [`Limits::cancel_on_timeout`]),
/// the connection is discarded ([`Executor::discard`]: the statement may still be running,
/// and a cancel that arrives late would hit whatever the connection ran next, 57014 on an
/// innocent query), and the caller gets `Unavailable`: the request answers 503 and a
/// transaction it was part of rolls back.
pub(crate) async fn timed<E, T, F, Fut>(e: &E, mut statement: F) -> Result<T>
where
    E: Executor + ?Sized,
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<T, tokio_postgres::Error>>,
{
    match timed_once(e, statement()).await {
        Err(err) if err.retry_at_once() && !e.in_transaction() => {
            tracing::info!(error = %err, "statement rolled back by the database; running it once more");
            timed_once(e, statement()).await
        }
        r => r,
    }
}

async fn timed_once<E: Executor + ?Sized, T>(
    e: &E,
    statement: impl Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    let limits = e.limits();
    let Some(limit) = limits.statement_timeout else {
        return statement.await.map_err(interpret);
    };
    match tokio::time::timeout(limit, statement).await {
        Ok(r) => r.map_err(interpret),
        Err(_) => {
            e.discard();
            if limits.cancel_on_timeout {
                let cancel = e.pg().client().cancel_token();
                tokio::spawn(async move {
                    // Over TLS when the connection is (see `db_tls::cancel_connector`).
                    if let Err(e) = cancel.cancel_query(crate::db_tls::cancel_connector()).await {
                        tracing::debug!(error = %e, "cancel request after a statement timeout failed");
                    }
                });
            }
            Err(StoreError::Unavailable(format!(
                "statement timed out after {} ms (POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS)",
                limit.as_millis()
            )))
        }
    }
}

/// Runs `attempt`, a whole transaction (or a step of several statements that is safe to
/// repeat), and once more when the database rolled it back for a deadlock or a
/// serialization failure. Any other outcome, and the second attempt's, is returned as is.
pub async fn retry_once<T, F, Fut>(mut attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    match attempt().await {
        Err(e) if e.retry_at_once() => {
            tracing::info!(error = %e, "transaction rolled back by the database; running it once more");
            attempt().await
        }
        r => r,
    }
}

type Params<'a> = &'a [(&'a (dyn ToSql + Sync), Type)];

/// `query_typed` and friends under the executor's limits, answering in `StoreError`.
pub trait Timed: Executor {
    fn timed_query<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Vec<Row>>> + 'a
    where
        Self: Sized,
    {
        timed(self, || self.pg().query_typed(sql, params))
    }

    fn timed_query_one<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Row>> + 'a
    where
        Self: Sized,
    {
        timed(self, || self.pg().query_typed_one(sql, params))
    }

    fn timed_query_opt<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Option<Row>>> + 'a
    where
        Self: Sized,
    {
        timed(self, || self.pg().query_typed_opt(sql, params))
    }

    fn timed_execute<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<u64>> + 'a
    where
        Self: Sized,
    {
        timed(self, || self.pg().execute_typed(sql, params))
    }
}

impl<E: Executor> Timed for E {}

/// Decodes a `to_jsonb(...)` column; NULL (an outer join that found nothing) is `None`.
/// Straight from the column's bytes into `T`: no `serde_json::Value` in between (the claim
/// decodes three of these per request).
fn json_col<T: DeserializeOwned>(row: &Row, col: &str) -> Result<Option<T>> {
    match row.try_get::<_, Option<RawJson<'_>>>(col)? {
        None => Ok(None),
        Some(RawJson(bytes)) => {
            serde_json::from_slice::<Option<T>>(bytes).map_err(|e| StoreError::Db(format!("decoding {col}: {e}")))
        }
    }
}

/// A `json` or `jsonb` column's text, borrowed from the row.
struct RawJson<'a>(&'a [u8]);

impl<'a> tokio_postgres::types::FromSql<'a> for RawJson<'a> {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> std::result::Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // jsonb's binary form: a version byte (1), then the JSON text.
            match raw.split_first() {
                Some((1, text)) => Ok(RawJson(text)),
                _ => Err("unsupported jsonb version".into()),
            }
        } else {
            Ok(RawJson(raw))
        }
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB || *ty == Type::JSON
    }
}

fn json_req<T: DeserializeOwned>(row: &Row, col: &str) -> Result<T> {
    json_col(row, col)?.ok_or_else(|| StoreError::Db(format!("{col} is unexpectedly NULL")))
}

/// The database's clock: the one every time comparison in the store uses.
pub async fn database_now(c: &impl Executor) -> Result<chrono::DateTime<chrono::Utc>> {
    Ok(c.timed_query_one("SELECT now()", &[]).await?.get(0))
}

pub async fn ping(c: &impl Executor) -> Result<()> {
    c.timed_query("SELECT 1", &[]).await?;
    Ok(())
}

/// The newest migration applied to the database, as refinery recorded it: version, name and
/// checksum. `None` for a database never migrated (no history table, or an empty one).
pub async fn schema_latest_applied(c: &impl Executor) -> Result<Option<(i32, String, String)>> {
    let exists: bool =
        c.timed_query_one("SELECT to_regclass('refinery_schema_history') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Ok(None);
    }
    let row = c
        .timed_query_opt(
            "SELECT version, name, checksum FROM refinery_schema_history ORDER BY version DESC LIMIT 1",
            &[],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
}
