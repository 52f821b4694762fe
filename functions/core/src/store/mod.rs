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
//! is the claim, which [`lease_claim_prepare`] prepares once per connection when
//! `POOLMGR_DB_PREPARE_CLAIM` is on (default on, off on Lambda; to be set off behind a
//! transaction pooler). Database errors are translated into `StoreError` in exactly one
//! place, [`interpret`].
//!
//! Every statement is issued through [`Timed`] (`timed_query`, `timed_query_one`, …), which
//! bounds it by the client-side statement timeout of the executor's database handle
//! ([`Limits`]): a server-side `statement_timeout` would need session state or a startup
//! parameter that transaction poolers drop or refuse.
//!
//! The store never decides what a result means to a client (404 or 409, retry or not: that
//! is `service`'s and `reconcile`'s), and never lets a `tokio_postgres` error out untranslated.
//!
//! # Layout
//!
//! One file per table: its row type and every statement named after it, whoever calls the
//! statement (`vm_*` is in `vm.rs`, whether the HTTP API or the reconciler runs it). A
//! statement that touches several tables lives with the entity it is named after
//! (`pool_delete_and_mark_vms` in `pool.rs`, `lease_expire_for_pool` in `lease.rs`).
//!
//! - `pool.rs`: `pools`. [`PoolRow`], [`PoolStatus`]; create, update, get, list, delete; the
//!   reconcile lease a pass takes on a pool, and why the pass holds it below its target.
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
//! - `claim.rs`: the claim statements, which write `leases`, `vms` and `events` at once:
//!   [`LEASE_CLAIM_SQL`] and [`lease_claim`], and the two-phase claim of pools with pre-lease
//!   hooks ([`vm_claim_for_hook`], [`lease_insert_after_hook`]); what a duplicate of a claim
//!   in flight reads and waits on ([`claim_get_by_request_id`], [`vm_wait_for_claimers`]).
//! - `rows.rs`: [`LeaseRow`], kept below `vm.rs` and `lease.rs` because each of those returns
//!   the other's row (no import circle).
//! - this file: [`StoreError`] and [`interpret`], [`Executor`], [`Limits`] and [`Timed`], the
//!   jsonb row decoding, [`ping`], and [`schema_latest_applied`] (refinery's history table,
//!   which `db` owns, read for the readiness check).

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row};

mod claim;
mod event;
mod host;
mod lease;
mod pool;
mod rows;
mod vm;

pub use claim::*;
pub use event::*;
pub use host::*;
pub use lease::*;
pub use pool::*;
pub use rows::*;
pub use vm::*;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached or dropped the connection: a retry may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    #[error("database error: {0}")]
    Db(String),
    /// A unique index refused a row (`23505`): another transaction committed the same key
    /// first. Which key, and what that means, is the caller's to say (a claim's first
    /// transaction: a duplicate of its request_id is already running its hook).
    #[error("unique violation: {0}")]
    UniqueViolation(String),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// The one place database errors are translated into our vocabulary.
pub fn interpret(e: tokio_postgres::Error) -> StoreError {
    use tokio_postgres::error::SqlState;
    if e.is_closed() {
        return StoreError::Unavailable(e.to_string());
    }
    match e.code() {
        // No SQLSTATE: an I/O or protocol failure talking to the server.
        None => StoreError::Unavailable(e.to_string()),
        Some(c)
            if c.code().starts_with("08")
                || *c == SqlState::ADMIN_SHUTDOWN
                || *c == SqlState::CRASH_SHUTDOWN
                || *c == SqlState::CANNOT_CONNECT_NOW
                || *c == SqlState::TOO_MANY_CONNECTIONS =>
        {
            StoreError::Unavailable(e.to_string())
        }
        Some(c) if *c == SqlState::UNIQUE_VIOLATION => StoreError::UniqueViolation(e.to_string()),
        Some(_) => StoreError::Db(e.to_string()),
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
}

/// Runs one statement under `limits`. Past the timeout the statement's future is dropped
/// (tokio-postgres discards the late answer), a cancel request is sent so the server stops
/// working on it (poolers forward cancels; see [`Limits::cancel_on_timeout`]), and the caller
/// gets `Unavailable`: the request answers 503 and a transaction it was part of rolls back.
pub(crate) async fn timed<C: GenericClient + ?Sized, T>(
    limits: Limits,
    c: &C,
    statement: impl Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    let Some(limit) = limits.statement_timeout else {
        return statement.await.map_err(interpret);
    };
    match tokio::time::timeout(limit, statement).await {
        Ok(r) => r.map_err(interpret),
        Err(_) => {
            if limits.cancel_on_timeout {
                let cancel = c.client().cancel_token();
                tokio::spawn(async move {
                    if let Err(e) = cancel.cancel_query(tokio_postgres::NoTls).await {
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

type Params<'a> = &'a [(&'a (dyn ToSql + Sync), Type)];

/// `query_typed` and friends under the executor's limits, answering in `StoreError`.
pub trait Timed: Executor {
    fn timed_query<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Vec<Row>>> + 'a
    where
        Self: Sized,
    {
        timed(self.limits(), self.pg(), self.pg().query_typed(sql, params))
    }

    fn timed_query_one<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Row>> + 'a
    where
        Self: Sized,
    {
        timed(self.limits(), self.pg(), self.pg().query_typed_one(sql, params))
    }

    fn timed_query_opt<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Option<Row>>> + 'a
    where
        Self: Sized,
    {
        timed(self.limits(), self.pg(), self.pg().query_typed_opt(sql, params))
    }

    fn timed_execute<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<u64>> + 'a
    where
        Self: Sized,
    {
        timed(self.limits(), self.pg(), self.pg().execute_typed(sql, params))
    }
}

impl<E: Executor> Timed for E {}

/// Decodes a `to_jsonb(...)` column; NULL (an outer join that found nothing) is `None`.
fn json_col<T: DeserializeOwned>(row: &Row, col: &str) -> Result<Option<T>> {
    let v: Option<serde_json::Value> = row.try_get(col)?;
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v).map(Some).map_err(|e| StoreError::Db(format!("decoding {col}: {e}"))),
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
