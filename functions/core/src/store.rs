//! Every SQL statement poolmgr runs, and the one mapping of each table's rows.
//!
//! Rows are read as `to_jsonb(<table alias>)` and decoded into the `*Row` structs below, so a
//! table's columns are defined once, by the table, and every statement that returns a row of
//! it (SELECT, INSERT … RETURNING, a CTE) maps it the same way. Statements are named
//! `entity_verb`. Each function takes any client — a pooled connection or a transaction — so
//! callers compose them into larger transactions.
//!
//! Statements go through `query_typed` (the unnamed statement, parameter types given here):
//! no named prepared statements and no session state, so a transaction-mode pooler (RDS
//! Proxy, PgBouncer) can move the connection between transactions freely. Database errors are
//! translated into `StoreError` in exactly one place, [`interpret`].
//!
//! Every statement is issued through [`Timed`] (`timed_query`, `timed_query_one`, …), which
//! bounds it by the client-side statement timeout: a server-side `statement_timeout` would
//! need session state or a startup parameter that transaction poolers drop or refuse.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Row, Statement};

use crate::domain::{EventType, HookFailurePolicy, Phase, PoolRef, PoolSpec, Replenishment, Strategy};
use crate::template::MicroVmTemplate;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached or dropped the connection: a retry may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    #[error("database error: {0}")]
    Db(String),
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
// Statement timeout
// ---------------------------------------------------------------------------------------

/// The client-side statement timeout in milliseconds, 0 for none. Process-wide: a process
/// serves one configuration, and [`crate::db::connect_pool`] sets it from that.
static STATEMENT_TIMEOUT_MS: AtomicU64 = AtomicU64::new(0);
/// Whether a timed-out statement gets a cancel request.
static CANCEL_ON_TIMEOUT: AtomicBool = AtomicBool::new(true);

/// Sets the limit [`Timed`] applies to every statement (`None`: no limit), and whether a
/// statement past it is cancelled on the server. Turn cancelling off in front of PgBouncer
/// older than 1.19: it can crash on the cancel request of a client that closes the cancel
/// socket right away, as tokio-postgres does (PgBouncer issue #801).
pub fn set_statement_timeout(limit: Option<Duration>, cancel: bool) {
    let ms = limit.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
    STATEMENT_TIMEOUT_MS.store(ms, Ordering::Relaxed);
    CANCEL_ON_TIMEOUT.store(cancel, Ordering::Relaxed);
}

/// The current limit of [`Timed`] statements.
pub fn statement_timeout() -> Option<Duration> {
    match STATEMENT_TIMEOUT_MS.load(Ordering::Relaxed) {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    }
}

/// Runs one statement under the statement timeout. Past it the statement's future is
/// dropped (tokio-postgres discards the late answer), a cancel request is sent so the server
/// stops working on it (poolers forward cancels; see [`set_statement_timeout`]), and the
/// caller gets `Unavailable`: the request answers 503 and a transaction it was part of
/// rolls back.
async fn timed<C: GenericClient + ?Sized, T>(
    c: &C,
    statement: impl Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    let Some(limit) = statement_timeout() else {
        return statement.await.map_err(interpret);
    };
    match tokio::time::timeout(limit, statement).await {
        Ok(r) => r.map_err(interpret),
        Err(_) => {
            let cancel = c.client().cancel_token();
            tokio::spawn(async move {
                if !CANCEL_ON_TIMEOUT.load(Ordering::Relaxed) {
                    return;
                }
                if let Err(e) = cancel.cancel_query(tokio_postgres::NoTls).await {
                    tracing::debug!(error = %e, "cancel request after a statement timeout failed");
                }
            });
            Err(StoreError::Unavailable(format!(
                "statement timed out after {} ms (POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS)",
                limit.as_millis()
            )))
        }
    }
}

type Params<'a> = &'a [(&'a (dyn ToSql + Sync), Type)];

/// `query_typed` and friends under the statement timeout, answering in `StoreError`.
pub trait Timed: GenericClient {
    fn timed_query<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Vec<Row>>> + 'a
    where
        Self: Sized,
    {
        timed(self, self.query_typed(sql, params))
    }

    fn timed_query_one<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Row>> + 'a
    where
        Self: Sized,
    {
        timed(self, self.query_typed_one(sql, params))
    }

    fn timed_query_opt<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<Option<Row>>> + 'a
    where
        Self: Sized,
    {
        timed(self, self.query_typed_opt(sql, params))
    }

    fn timed_execute<'a>(&'a self, sql: &'a str, params: Params<'a>) -> impl Future<Output = Result<u64>> + 'a
    where
        Self: Sized,
    {
        timed(self, self.execute_typed(sql, params))
    }
}

impl<C: GenericClient> Timed for C {}

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

// ---------------------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------------------

/// A `pools` row.
#[derive(Debug, Clone, Deserialize)]
pub struct PoolRow {
    pub namespace: String,
    pub name: String,
    pub size: i32,
    pub flintlock_hosts: Vec<String>,
    pub strategy: Strategy,
    pub min_size: Option<i32>,
    pub microvm_template: MicroVmTemplate,
    pub create_commands: Vec<String>,
    pub pre_lease_commands: Vec<String>,
    pub hook_failure_policy: HookFailurePolicy,
    pub heartbeat_interval_seconds: i32,
    pub heartbeat_expiry_seconds: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl PoolRow {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.namespace.clone(), name: self.name.clone() }
    }

    pub fn spec(&self) -> PoolSpec {
        PoolSpec {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            size: self.size,
            flintlock_hosts: self.flintlock_hosts.clone(),
            replenishment: Replenishment { strategy: self.strategy, min_size: self.min_size },
            microvm_template: self.microvm_template.clone(),
            create_commands: self.create_commands.clone(),
            pre_lease_commands: self.pre_lease_commands.clone(),
            hook_failure_policy: self.hook_failure_policy,
            heartbeat_interval_seconds: self.heartbeat_interval_seconds,
            heartbeat_expiry_seconds: self.heartbeat_expiry_seconds,
        }
    }
}

/// Live VM counts of a pool, computed from `vms` and `leases`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct PoolStatus {
    pub available: i64,
    /// PRE_LEASE_HOOK_RUNNING, or LEASED without a committed lease row.
    pub claiming: i64,
    pub leased: i64,
    pub provisioning: i64,
    pub quarantined: i64,
    pub deleting: i64,
}

/// A `hosts` row, secrets included; the API view drops them.
#[derive(Debug, Clone, Deserialize)]
pub struct HostRow {
    pub name: String,
    pub address: String,
    pub tls_insecure: bool,
    pub ca_pem: Option<String>,
    pub cert_pem: Option<String>,
    pub key_pem: Option<String>,
    pub basic_auth_token: Option<String>,
    pub cordoned: bool,
    pub cordoned_reason: Option<String>,
    pub cordoned_at: Option<DateTime<Utc>>,
    pub flintlock_version: Option<String>,
    pub exec_unavailable_reason: Option<String>,
    pub checked_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A `vms` row.
#[derive(Debug, Clone, Deserialize)]
pub struct VmRow {
    pub id: String,
    pub uid: Option<String>,
    pub pool_namespace: String,
    pub pool_name: String,
    pub flintlock_host: String,
    pub phase: Phase,
    pub lease_id: Option<String>,
    pub network_interfaces: serde_json::Value,
    pub attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub hook_step: i32,
    pub hook_started_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl VmRow {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.pool_namespace.clone(), name: self.pool_name.clone() }
    }
}

/// A `leases` row.
#[derive(Debug, Clone, Deserialize)]
pub struct LeaseRow {
    pub lease_id: String,
    pub vm_id: String,
    pub pool_namespace: String,
    pub pool_name: String,
    pub claimed_at: DateTime<Utc>,
    pub last_heartbeat_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub request_id: Option<String>,
    pub principal: String,
}

impl LeaseRow {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.pool_namespace.clone(), name: self.pool_name.clone() }
    }
}

/// An `events` row.
#[derive(Debug, Clone, Deserialize)]
pub struct EventRow {
    pub id: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub pool_namespace: String,
    pub pool_name: String,
    pub vm_id: Option<String>,
    pub lease_id: Option<String>,
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

/// A lease with the VM and host it points at (either may be gone).
#[derive(Debug, Clone)]
pub struct LeaseView {
    pub lease: LeaseRow,
    pub vm: Option<VmRow>,
    pub host: Option<HostRow>,
}

fn lease_view(row: &Row) -> Result<LeaseView> {
    Ok(LeaseView { lease: json_req(row, "lease")?, vm: json_col(row, "vm")?, host: json_col(row, "host")? })
}

// ---------------------------------------------------------------------------------------
// Pools
// ---------------------------------------------------------------------------------------

/// Status counts of pool `p`, as a jsonb column named `status`.
const POOL_STATUS: &str = "
    (SELECT jsonb_build_object(
        'available',    count(*) FILTER (WHERE v.phase = 'AVAILABLE'),
        'claiming',     count(*) FILTER (WHERE v.phase = 'PRE_LEASE_HOOK_RUNNING'
                                            OR (v.phase = 'LEASED' AND l.lease_id IS NULL)),
        'leased',       count(*) FILTER (WHERE v.phase = 'LEASED' AND l.lease_id IS NOT NULL),
        'provisioning', count(*) FILTER (WHERE v.phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING')),
        'quarantined',  count(*) FILTER (WHERE v.phase = 'QUARANTINED'),
        'deleting',     count(*) FILTER (WHERE v.phase = 'DELETING'))
     FROM vms v LEFT JOIN leases l ON l.vm_id = v.id
     WHERE v.pool_namespace = p.namespace AND v.pool_name = p.name) AS status";

fn pool_with_status(row: &Row) -> Result<(PoolRow, PoolStatus)> {
    Ok((json_req(row, "pool")?, json_req(row, "status")?))
}

/// Registered hosts among `names` that are missing, locking the present ones against a
/// concurrent RemoveHost until the caller's transaction ends.
pub async fn host_missing_for_pool(c: &impl GenericClient, names: &[String]) -> Result<Vec<String>> {
    let rows = c
        .timed_query(
            "WITH present AS (
                 SELECT name FROM hosts WHERE name = ANY($1) FOR KEY SHARE
             )
             SELECT n FROM unnest($1::text[]) AS n WHERE n NOT IN (SELECT name FROM present)",
            &[(&names, Type::TEXT_ARRAY)],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Inserts a pool; `None` if one with that key exists.
pub async fn pool_insert(c: &impl GenericClient, spec: &PoolSpec) -> Result<Option<PoolRow>> {
    let template = serde_json::to_value(&spec.microvm_template).map_err(|e| StoreError::Db(e.to_string()))?;
    let row = c
        .timed_query_opt(
            "INSERT INTO pools AS p (namespace, name, size, flintlock_hosts, strategy, min_size,
                 microvm_template, create_commands, pre_lease_commands, hook_failure_policy,
                 heartbeat_interval_seconds, heartbeat_expiry_seconds)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
             ON CONFLICT (namespace, name) DO NOTHING
             RETURNING to_jsonb(p) AS pool",
            &[
                (&spec.namespace, Type::TEXT),
                (&spec.name, Type::TEXT),
                (&spec.size, Type::INT4),
                (&spec.flintlock_hosts, Type::TEXT_ARRAY),
                (&spec.replenishment.strategy.as_str(), Type::TEXT),
                (&spec.replenishment.min_size, Type::INT4),
                (&template, Type::JSONB),
                (&spec.create_commands, Type::TEXT_ARRAY),
                (&spec.pre_lease_commands, Type::TEXT_ARRAY),
                (&spec.hook_failure_policy.as_str(), Type::TEXT),
                (&spec.heartbeat_interval_seconds, Type::INT4),
                (&spec.heartbeat_expiry_seconds, Type::INT4),
            ],
        )
        .await?;
    row.map(|r| json_req(&r, "pool")).transpose()
}

/// Replaces a pool's spec; `false` if the pool does not exist.
pub async fn pool_update(c: &impl GenericClient, spec: &PoolSpec) -> Result<bool> {
    let template = serde_json::to_value(&spec.microvm_template).map_err(|e| StoreError::Db(e.to_string()))?;
    let n = c
        .timed_execute(
            "UPDATE pools SET size = $3, flintlock_hosts = $4, strategy = $5, min_size = $6,
                 microvm_template = $7, create_commands = $8, pre_lease_commands = $9,
                 hook_failure_policy = $10, heartbeat_interval_seconds = $11,
                 heartbeat_expiry_seconds = $12, updated_at = now()
             WHERE namespace = $1 AND name = $2",
            &[
                (&spec.namespace, Type::TEXT),
                (&spec.name, Type::TEXT),
                (&spec.size, Type::INT4),
                (&spec.flintlock_hosts, Type::TEXT_ARRAY),
                (&spec.replenishment.strategy.as_str(), Type::TEXT),
                (&spec.replenishment.min_size, Type::INT4),
                (&template, Type::JSONB),
                (&spec.create_commands, Type::TEXT_ARRAY),
                (&spec.pre_lease_commands, Type::TEXT_ARRAY),
                (&spec.hook_failure_policy.as_str(), Type::TEXT),
                (&spec.heartbeat_interval_seconds, Type::INT4),
                (&spec.heartbeat_expiry_seconds, Type::INT4),
            ],
        )
        .await?;
    Ok(n == 1)
}

pub async fn pool_get(c: &impl GenericClient, pool: &PoolRef) -> Result<Option<(PoolRow, PoolStatus)>> {
    let sql = format!("SELECT to_jsonb(p) AS pool, {POOL_STATUS} FROM pools p WHERE p.namespace = $1 AND p.name = $2");
    let row = c.timed_query_opt(&sql, &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)]).await?;
    row.as_ref().map(pool_with_status).transpose()
}

pub async fn pool_list(c: &impl GenericClient, namespace: Option<&str>) -> Result<Vec<(PoolRow, PoolStatus)>> {
    let sql = format!(
        "SELECT to_jsonb(p) AS pool, {POOL_STATUS} FROM pools p
         WHERE $1::text IS NULL OR p.namespace = $1
         ORDER BY p.namespace, p.name"
    );
    let rows = c.timed_query(&sql, &[(&namespace, Type::TEXT)]).await?;
    rows.iter().map(pool_with_status).collect()
}

pub enum PoolDelete {
    NotFound,
    /// Refused without `force`: this many VMs are leased or being claimed.
    HasLeasedVms(i64),
    /// Every VM of the pool, now DELETING, and the leases that were removed.
    Deleted {
        vms: Vec<VmRow>,
        leases: Vec<LeaseRow>,
    },
}

/// Deletes a pool and marks its VMs DELETING. Must run inside a transaction: the pool row and
/// every VM row are locked first, so a claim cannot slip a lease in between the leased-VM
/// check and the marking.
pub async fn pool_delete_and_mark_vms(c: &impl GenericClient, pool: &PoolRef, force: bool) -> Result<PoolDelete> {
    let p: &[(&(dyn ToSql + Sync), Type)] = &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)];
    let deleted = c.timed_execute("DELETE FROM pools WHERE namespace = $1 AND name = $2", p).await?;
    if deleted == 0 {
        return Ok(PoolDelete::NotFound);
    }
    // FOR UPDATE waits for in-flight claims on these rows (they hold FOR NO KEY UPDATE), so
    // the count below sees every lease that committed.
    let leased: i64 = c
        .timed_query_one(
            "WITH locked AS (
                 SELECT id, phase FROM vms WHERE pool_namespace = $1 AND pool_name = $2 FOR UPDATE
             )
             SELECT count(*) FROM locked WHERE phase IN ('LEASED', 'PRE_LEASE_HOOK_RUNNING')",
            p,
        )
        .await?
        .get(0);
    if leased > 0 && !force {
        return Ok(PoolDelete::HasLeasedVms(leased));
    }
    let row = c
        .timed_query_one(
            "WITH marked AS (
                 UPDATE vms SET phase = 'DELETING', lease_id = NULL, updated_at = now()
                 WHERE pool_namespace = $1 AND pool_name = $2
                 RETURNING *
             ), removed AS (
                 DELETE FROM leases WHERE pool_namespace = $1 AND pool_name = $2 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_DELETED_ON_POOL_DELETE', m.pool_namespace, m.pool_name, m.id, r.lease_id
                 FROM marked m LEFT JOIN removed r ON r.vm_id = m.id
             )
             SELECT (SELECT coalesce(jsonb_agg(to_jsonb(m) ORDER BY m.id), '[]') FROM marked m) AS vms,
                    (SELECT coalesce(jsonb_agg(to_jsonb(r)), '[]') FROM removed r) AS leases",
            p,
        )
        .await?;
    Ok(PoolDelete::Deleted { vms: json_req(&row, "vms")?, leases: json_req(&row, "leases")? })
}

// ---------------------------------------------------------------------------------------
// Hosts
// ---------------------------------------------------------------------------------------

/// The writable fields of a host.
pub struct HostWrite<'a> {
    pub name: &'a str,
    pub address: &'a str,
    pub tls_insecure: bool,
    pub ca_pem: Option<&'a str>,
    pub cert_pem: Option<&'a str>,
    pub key_pem: Option<&'a str>,
    pub basic_auth_token: Option<&'a str>,
}

const HOST_VM_COUNT: &str = "(SELECT count(*) FROM vms v WHERE v.flintlock_host = h.name) AS vm_count";

fn host_with_count(row: &Row) -> Result<(HostRow, i64)> {
    Ok((json_req(row, "host")?, row.try_get("vm_count")?))
}

/// Inserts a host, uncordoned; `None` if the name is taken.
pub async fn host_insert(c: &impl GenericClient, h: &HostWrite<'_>) -> Result<Option<(HostRow, i64)>> {
    let row = c
        .timed_query_opt(
            "INSERT INTO hosts AS h (name, address, tls_insecure, ca_pem, cert_pem, key_pem, basic_auth_token)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (name) DO NOTHING
             RETURNING to_jsonb(h) AS host, 0::bigint AS vm_count",
            &[
                (&h.name, Type::TEXT),
                (&h.address, Type::TEXT),
                (&h.tls_insecure, Type::BOOL),
                (&h.ca_pem, Type::TEXT),
                (&h.cert_pem, Type::TEXT),
                (&h.key_pem, Type::TEXT),
                (&h.basic_auth_token, Type::TEXT),
            ],
        )
        .await?;
    row.as_ref().map(host_with_count).transpose()
}

/// Replaces address, TLS and token; keeps the cordon state. `None` if unknown.
pub async fn host_update(c: &impl GenericClient, h: &HostWrite<'_>) -> Result<Option<(HostRow, i64)>> {
    let sql = format!(
        "UPDATE hosts AS h SET address = $2, tls_insecure = $3, ca_pem = $4, cert_pem = $5,
             key_pem = $6, basic_auth_token = $7, updated_at = now()
         WHERE name = $1
         RETURNING to_jsonb(h) AS host, {HOST_VM_COUNT}"
    );
    let row = c
        .timed_query_opt(
            &sql,
            &[
                (&h.name, Type::TEXT),
                (&h.address, Type::TEXT),
                (&h.tls_insecure, Type::BOOL),
                (&h.ca_pem, Type::TEXT),
                (&h.cert_pem, Type::TEXT),
                (&h.key_pem, Type::TEXT),
                (&h.basic_auth_token, Type::TEXT),
            ],
        )
        .await?;
    row.as_ref().map(host_with_count).transpose()
}

pub async fn host_get(c: &impl GenericClient, name: &str) -> Result<Option<(HostRow, i64)>> {
    let sql = format!("SELECT to_jsonb(h) AS host, {HOST_VM_COUNT} FROM hosts h WHERE h.name = $1");
    let row = c.timed_query_opt(&sql, &[(&name, Type::TEXT)]).await?;
    row.as_ref().map(host_with_count).transpose()
}

pub async fn host_list(c: &impl GenericClient) -> Result<Vec<(HostRow, i64)>> {
    let sql = format!("SELECT to_jsonb(h) AS host, {HOST_VM_COUNT} FROM hosts h ORDER BY h.name");
    let rows = c.timed_query(&sql, &[]).await?;
    rows.iter().map(host_with_count).collect()
}

/// Sets or clears the cordon; `cordoned_at` moves to now on every cordon. `None` if unknown.
pub async fn host_set_cordon(
    c: &impl GenericClient,
    name: &str,
    cordon: Option<&str>,
) -> Result<Option<(HostRow, i64)>> {
    let sql = format!(
        "UPDATE hosts AS h SET cordoned = $2, cordoned_reason = $3,
             cordoned_at = CASE WHEN $2 THEN now() END, updated_at = now()
         WHERE name = $1
         RETURNING to_jsonb(h) AS host, {HOST_VM_COUNT}"
    );
    let cordoned = cordon.is_some();
    let row = c.timed_query_opt(&sql, &[(&name, Type::TEXT), (&cordoned, Type::BOOL), (&cordon, Type::TEXT)]).await?;
    row.as_ref().map(host_with_count).transpose()
}

pub enum HostDelete {
    NotFound,
    InUse { pools: Vec<String>, vm_count: i64 },
    Deleted,
}

/// Locks host `name`'s row (FOR UPDATE) until the transaction ends; a no-op if it is missing.
pub async fn host_lock(c: &impl GenericClient, name: &str) -> Result<()> {
    c.timed_query_opt("SELECT 1 FROM hosts WHERE name = $1 FOR UPDATE", &[(&name, Type::TEXT)]).await?;
    Ok(())
}

/// Removes a host unless a pool names it or a VM row is on it. Must run inside a
/// transaction: the host row is locked first, which conflicts with the KEY SHARE lock a
/// concurrent pool create/update takes on the hosts it names.
pub async fn host_delete(c: &impl GenericClient, name: &str) -> Result<HostDelete> {
    let p: &[(&(dyn ToSql + Sync), Type)] = &[(&name, Type::TEXT)];
    let row = c
        .timed_query_opt(
            "SELECT (SELECT coalesce(array_agg(namespace || '/' || name ORDER BY namespace, name), '{}')
                     FROM pools WHERE $1 = ANY(flintlock_hosts)) AS pools,
                    (SELECT count(*) FROM vms WHERE flintlock_host = $1) AS vm_count
             FROM hosts WHERE name = $1 FOR UPDATE",
            p,
        )
        .await?;
    let Some(row) = row else { return Ok(HostDelete::NotFound) };
    let pools: Vec<String> = row.try_get("pools")?;
    let vm_count: i64 = row.try_get("vm_count")?;
    if !pools.is_empty() || vm_count > 0 {
        return Ok(HostDelete::InUse { pools, vm_count });
    }
    c.timed_execute("DELETE FROM hosts WHERE name = $1", p).await?;
    Ok(HostDelete::Deleted)
}

// ---------------------------------------------------------------------------------------
// VMs
// ---------------------------------------------------------------------------------------

pub async fn vm_get(c: &impl GenericClient, id: &str) -> Result<Option<VmRow>> {
    let row = c.timed_query_opt("SELECT to_jsonb(v) AS vm FROM vms v WHERE v.id = $1", &[(&id, Type::TEXT)]).await?;
    row.as_ref().map(|r| json_req(r, "vm")).transpose()
}

pub async fn vm_list(
    c: &impl GenericClient,
    namespace: Option<&str>,
    pool: Option<&str>,
    phase: Option<Phase>,
) -> Result<Vec<VmRow>> {
    let phase = phase.map(Phase::as_str);
    let rows = c
        .timed_query(
            "SELECT to_jsonb(v) AS vm FROM vms v
             WHERE ($1::text IS NULL OR v.pool_namespace = $1)
               AND ($2::text IS NULL OR v.pool_name = $2)
               AND ($3::text IS NULL OR v.phase = $3)
             ORDER BY v.pool_namespace, v.pool_name, v.id",
            &[(&namespace, Type::TEXT), (&pool, Type::TEXT), (&phase, Type::TEXT)],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "vm")).collect()
}

/// The fields of a new VM row.
pub struct VmInsert<'a> {
    pub id: &'a str,
    pub uid: Option<&'a str>,
    pub pool: &'a PoolRef,
    pub flintlock_host: &'a str,
    pub phase: Phase,
    pub network_interfaces: &'a serde_json::Value,
}

pub async fn vm_insert(c: &impl GenericClient, vm: &VmInsert<'_>) -> Result<VmRow> {
    let phase = vm.phase.as_str();
    let row = c
        .timed_query_one(
            "INSERT INTO vms AS v (id, uid, pool_namespace, pool_name, flintlock_host, phase, network_interfaces)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             RETURNING to_jsonb(v) AS vm",
            &[
                (&vm.id, Type::TEXT),
                (&vm.uid, Type::TEXT),
                (&vm.pool.namespace, Type::TEXT),
                (&vm.pool.name, Type::TEXT),
                (&vm.flintlock_host, Type::TEXT),
                (&phase, Type::TEXT),
                (vm.network_interfaces, Type::JSONB),
            ],
        )
        .await?;
    json_req(&row, "vm")
}

pub enum VmFinish {
    /// The row was already gone (another deleter finished first).
    Gone,
    /// The row is removed, with the lease it still had (a release being finished).
    Removed { vm: Box<VmRow>, lease: Option<Box<LeaseRow>> },
}

/// Removes a DELETING VM's row, and its lease if one is left, once flintlock confirmed the
/// delete. A lease still present means a release is being finished: VM_DELETED_ON_RELEASE is
/// written in the same transaction. Expiry and pool delete wrote their events when they
/// marked the VM.
pub async fn vm_finish_delete(c: &impl GenericClient, vm_id: &str) -> Result<VmFinish> {
    let row = c
        .timed_query_one(
            "WITH v AS (
                 DELETE FROM vms WHERE id = $1 AND phase = 'DELETING' RETURNING *
             ), l AS (
                 DELETE FROM leases WHERE vm_id = (SELECT id FROM v) RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_DELETED_ON_RELEASE', l.pool_namespace, l.pool_name, l.vm_id, l.lease_id FROM l
             )
             SELECT (SELECT to_jsonb(v) FROM v) AS vm, (SELECT to_jsonb(l) FROM l) AS lease",
            &[(&vm_id, Type::TEXT)],
        )
        .await?;
    Ok(match json_col::<VmRow>(&row, "vm")? {
        None => VmFinish::Gone,
        Some(vm) => VmFinish::Removed { vm: Box::new(vm), lease: json_col::<LeaseRow>(&row, "lease")?.map(Box::new) },
    })
}

// ---------------------------------------------------------------------------------------
// Leases and the claim
// ---------------------------------------------------------------------------------------

/// The live lease this principal created with this request_id, on any pool: how a claim that
/// lost a concurrent request_id race finds the winner's lease.
pub async fn lease_get_by_request_id(
    c: &impl GenericClient,
    principal: &str,
    request_id: &str,
) -> Result<Option<LeaseView>> {
    let sql = format!("{LEASE_VIEW_SELECT} WHERE l.principal = $1 AND l.request_id = $2");
    let row = c.timed_query_opt(&sql, &[(&principal, Type::TEXT), (&request_id, Type::TEXT)]).await?;
    row.as_ref().map(lease_view).transpose()
}

pub enum ClaimOutcome {
    PoolNotFound,
    /// The request_id already has a live lease (maybe on another pool): nothing was claimed.
    Existing(Box<LeaseView>),
    NoVmAvailable,
    /// A concurrent claim with the same (principal, request_id) committed its lease first.
    /// Nothing was changed: the VM this claim picked is still AVAILABLE.
    DuplicateRequestId,
    /// The pool runs pre-lease commands: nothing was claimed; use the two-phase claim.
    NeedsPreLeaseHook,
    Claimed(Box<LeaseView>),
}

/// CTEs `slot`, `picked_hi`, `picked_lo` and `picked`: one AVAILABLE VM of pool ($1, $2), row
/// locked, when the CTE `go` has a row. Shared by both claim statements.
///
/// SKIP LOCKED: concurrent claimers each take a different row instead of queueing on the
/// first. NO KEY UPDATE: we never change the key, so the lock is no stronger than needed.
/// Slots (V5): a scan starts at a random `claim_slot` and wraps around, so N concurrent
/// claimers start in different places of `vms_pool_available` instead of all stepping over
/// the same N-1 locked rows at its head; within a slot the oldest VM goes first. The low half
/// is scanned only when the high half had no free row.
macro_rules! pick_available_vm {
    () => {
        "slot AS MATERIALIZED (
         SELECT (floor(random() * 64))::smallint AS s
     ), picked_hi AS (
         SELECT v.id FROM vms v
         WHERE v.pool_namespace = $1 AND v.pool_name = $2 AND v.phase = 'AVAILABLE'
           AND v.claim_slot >= (SELECT s FROM slot) AND EXISTS (SELECT 1 FROM go)
         ORDER BY v.claim_slot, v.created_at
         LIMIT 1
         FOR NO KEY UPDATE SKIP LOCKED
     ), picked_lo AS (
         SELECT v.id FROM vms v
         WHERE v.pool_namespace = $1 AND v.pool_name = $2 AND v.phase = 'AVAILABLE'
           AND v.claim_slot < (SELECT s FROM slot) AND EXISTS (SELECT 1 FROM go)
           AND NOT EXISTS (SELECT 1 FROM picked_hi)
         ORDER BY v.claim_slot, v.created_at
         LIMIT 1
         FOR NO KEY UPDATE SKIP LOCKED
     ), picked AS (
         SELECT id FROM picked_hi UNION ALL SELECT id FROM picked_lo"
    };
}

/// The claim statement prepared on this connection, from deadpool's per-connection cache:
/// planned at most a few times per connection instead of on every claim.
pub async fn lease_claim_prepare(c: &deadpool_postgres::ClientWrapper) -> Result<Statement> {
    timed(&**c, c.prepare_typed_cached(LEASE_CLAIM_SQL, &[Type::TEXT; 5])).await
}

/// The claim: replay lookup, pick, lease insert, VM update and event in one statement.
/// Parameters: $1 namespace, $2 pool name, $3 new lease id, $4 request_id (NULL for none),
/// $5 principal. Public so `poolmgr-bench` can run the very same statement through pgbench.
pub const LEASE_CLAIM_SQL: &str = concat!(
    "WITH pool AS (
         SELECT namespace, name, heartbeat_expiry_seconds,
                cardinality(pre_lease_commands) > 0 AS has_hooks
         FROM pools WHERE namespace = $1 AND name = $2
     ), existing AS (
         -- The lease this principal's request_id already created, on any pool: a
         -- replay. Looked up in the same statement, so a retried claim costs one
         -- round trip like a fresh one.
         SELECT * FROM leases WHERE $4::text IS NOT NULL AND principal = $5 AND request_id = $4
     ), go AS (
         -- Pick only for a fresh claim (no replay) on a pool without pre-lease hooks (those
         -- claim in two phases: vm_claim_for_hook).
         SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM existing) AND NOT (SELECT has_hooks FROM pool)
     ), ",
    pick_available_vm!(),
    "
     ), ins AS (
         INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at,
                             last_heartbeat_at, expires_at, request_id, principal)
         SELECT $3, picked.id, pool.namespace, pool.name, now(), now(),
                now() + make_interval(secs => pool.heartbeat_expiry_seconds), $4, $5
         FROM picked, pool
         -- The conflict target repeats the partial index's predicate so PostgreSQL
         -- infers leases_principal_request_id as the arbiter. A concurrent insert of
         -- the same key makes this wait for that transaction, then do nothing.
         ON CONFLICT (principal, request_id) WHERE request_id IS NOT NULL DO NOTHING
         RETURNING *
     ), upd AS (
         UPDATE vms v SET phase = 'LEASED', lease_id = ins.lease_id, updated_at = now()
         FROM ins WHERE v.id = ins.vm_id
         RETURNING v.*
     ), ev AS (
         INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
         SELECT 'VM_CLAIMED', ins.pool_namespace, ins.pool_name, ins.vm_id, ins.lease_id FROM ins
     )
     SELECT EXISTS (SELECT 1 FROM pool) AS pool_found, picked.id AS picked,
            coalesce((SELECT has_hooks FROM pool), false) AS has_hooks,
            to_jsonb(ins) AS lease, to_jsonb(upd) AS vm, to_jsonb(h) AS host,
            to_jsonb(e) AS existing_lease, to_jsonb(ev_vm) AS existing_vm, to_jsonb(ev_h) AS existing_host
     FROM (SELECT 1) AS one
     LEFT JOIN picked ON true
     LEFT JOIN ins ON true
     LEFT JOIN upd ON true
     LEFT JOIN hosts h ON h.name = upd.flintlock_host
     LEFT JOIN existing e ON true
     LEFT JOIN vms ev_vm ON ev_vm.id = e.vm_id
     LEFT JOIN hosts ev_h ON ev_h.name = ev_vm.flintlock_host"
);

/// The claim: pick one AVAILABLE VM, write its lease and VM_CLAIMED, mark it LEASED — one
/// statement, so one round trip and one implicit transaction.
///
/// The lease INSERT runs before the VM UPDATE and the UPDATE reads the INSERT's RETURNING:
/// when the request_id index rejects the lease (a concurrent duplicate won), the UPDATE and
/// the event see no row and the statement changes nothing — the rollback is built in.
///
/// `prepared` is [`lease_claim_prepare`]'s statement for this connection, or `None` to send
/// the text (one unnamed statement, planned every time: what a transaction pooler needs).
pub async fn lease_claim(
    c: &impl GenericClient,
    prepared: Option<&Statement>,
    pool: &PoolRef,
    lease_id: &str,
    request_id: Option<&str>,
    principal: &str,
) -> Result<ClaimOutcome> {
    let row = match prepared {
        Some(stmt) => {
            timed(c, c.query_one(stmt, &[&pool.namespace, &pool.name, &lease_id, &request_id, &principal])).await?
        }
        None => {
            c.timed_query_one(
                LEASE_CLAIM_SQL,
                &[
                    (&pool.namespace, Type::TEXT),
                    (&pool.name, Type::TEXT),
                    (&lease_id, Type::TEXT),
                    (&request_id, Type::TEXT),
                    (&principal, Type::TEXT),
                ],
            )
            .await?
        }
    };
    if !row.try_get::<_, bool>("pool_found")? {
        return Ok(ClaimOutcome::PoolNotFound);
    }
    if let Some(lease) = json_col::<LeaseRow>(&row, "existing_lease")? {
        let view = LeaseView { lease, vm: json_col(&row, "existing_vm")?, host: json_col(&row, "existing_host")? };
        return Ok(ClaimOutcome::Existing(Box::new(view)));
    }
    if row.try_get::<_, bool>("has_hooks")? {
        return Ok(ClaimOutcome::NeedsPreLeaseHook);
    }
    if row.try_get::<_, Option<String>>("picked")?.is_none() {
        return Ok(ClaimOutcome::NoVmAvailable);
    }
    if json_col::<LeaseRow>(&row, "lease")?.is_none() {
        return Ok(ClaimOutcome::DuplicateRequestId);
    }
    Ok(ClaimOutcome::Claimed(Box::new(lease_view(&row)?)))
}

const LEASE_VIEW_SELECT: &str = "SELECT to_jsonb(l) AS lease, to_jsonb(v) AS vm, to_jsonb(h) AS host
     FROM leases l
     LEFT JOIN vms v ON v.id = l.vm_id
     LEFT JOIN hosts h ON h.name = v.flintlock_host";

pub async fn lease_get(c: &impl GenericClient, lease_id: &str) -> Result<Option<LeaseView>> {
    let sql = format!("{LEASE_VIEW_SELECT} WHERE l.lease_id = $1");
    let row = c.timed_query_opt(&sql, &[(&lease_id, Type::TEXT)]).await?;
    row.as_ref().map(lease_view).transpose()
}

/// Extends a lease by its pool's *current* expiry. `None` if the lease or its pool is gone,
/// or the lease already expired (an expired lease is not revived: the reconciler is about to
/// delete its VM).
pub async fn lease_heartbeat(c: &impl GenericClient, lease_id: &str) -> Result<Option<LeaseView>> {
    let row = c
        .timed_query_opt(
            "WITH l AS (
                 UPDATE leases l
                 SET expires_at = now() + make_interval(secs => p.heartbeat_expiry_seconds),
                     last_heartbeat_at = now()
                 FROM pools p
                 WHERE l.lease_id = $1 AND l.expires_at > now()
                   AND p.namespace = l.pool_namespace AND p.name = l.pool_name
                 RETURNING l.*
             )
             SELECT to_jsonb(l) AS lease, to_jsonb(v) AS vm, to_jsonb(h) AS host
             FROM l
             LEFT JOIN vms v ON v.id = l.vm_id
             LEFT JOIN hosts h ON h.name = v.flintlock_host",
            &[(&lease_id, Type::TEXT)],
        )
        .await?;
    row.as_ref().map(lease_view).transpose()
}

/// Leases ordered by id, after `after`, at most `limit`; optionally one pool's, optionally
/// one principal's.
pub async fn lease_list(
    c: &impl GenericClient,
    pool: Option<&PoolRef>,
    principal: Option<&str>,
    after: &str,
    limit: i64,
) -> Result<Vec<LeaseView>> {
    let ns = pool.map(|p| p.namespace.as_str());
    let name = pool.map(|p| p.name.as_str());
    let sql = format!(
        "{LEASE_VIEW_SELECT}
         WHERE ($1::text IS NULL OR (l.pool_namespace = $1 AND l.pool_name = $2))
           AND ($3::text IS NULL OR l.principal = $3)
           AND l.lease_id > $4
         ORDER BY l.lease_id
         LIMIT $5"
    );
    let rows = c
        .timed_query(
            &sql,
            &[
                (&ns, Type::TEXT),
                (&name, Type::TEXT),
                (&principal, Type::TEXT),
                (&after, Type::TEXT),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    rows.iter().map(lease_view).collect()
}

/// First step of a release: marks the lease's VM DELETING (terminal), keeping the lease row
/// until flintlock confirms the delete. `None` for an unknown lease.
pub async fn lease_begin_release(c: &impl GenericClient, lease_id: &str) -> Result<Option<LeaseView>> {
    let row = c
        .timed_query_opt(
            "WITH l AS (
                 SELECT * FROM leases WHERE lease_id = $1
             ), v AS (
                 UPDATE vms v SET phase = 'DELETING', updated_at = now()
                 FROM l WHERE v.id = l.vm_id
                 RETURNING v.*
             )
             SELECT to_jsonb(l) AS lease, to_jsonb(v) AS vm, to_jsonb(h) AS host
             FROM l
             LEFT JOIN v ON true
             LEFT JOIN hosts h ON h.name = v.flintlock_host",
            &[(&lease_id, Type::TEXT)],
        )
        .await?;
    row.as_ref().map(lease_view).transpose()
}

/// Removes a lease whose VM row is already gone.
pub async fn lease_delete(c: &impl GenericClient, lease_id: &str) -> Result<Option<LeaseRow>> {
    let row = c
        .timed_query_opt(
            "DELETE FROM leases l WHERE lease_id = $1 RETURNING to_jsonb(l) AS lease",
            &[(&lease_id, Type::TEXT)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "lease")).transpose()
}

// ---------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------

pub async fn event_insert(
    c: &impl GenericClient,
    kind: EventType,
    pool: &PoolRef,
    vm_id: Option<&str>,
    lease_id: Option<&str>,
    payload: &serde_json::Value,
) -> Result<i64> {
    let kind = kind.as_str();
    let row = c
        .timed_query_one(
            "INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id, payload)
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
            &[
                (&kind, Type::TEXT),
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&vm_id, Type::TEXT),
                (&lease_id, Type::TEXT),
                (payload, Type::JSONB),
            ],
        )
        .await?;
    Ok(row.try_get(0)?)
}

pub async fn event_list(
    c: &impl GenericClient,
    after: i64,
    namespace: Option<&str>,
    pool: Option<&str>,
    limit: i64,
) -> Result<Vec<EventRow>> {
    let rows = c
        .timed_query(
            "SELECT to_jsonb(e) AS event FROM events e
             WHERE e.id > $1
               AND ($2::text IS NULL OR e.pool_namespace = $2)
               AND ($3::text IS NULL OR e.pool_name = $3)
             ORDER BY e.id
             LIMIT $4",
            &[(&after, Type::INT8), (&namespace, Type::TEXT), (&pool, Type::TEXT), (&limit, Type::INT8)],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "event")).collect()
}

// ---------------------------------------------------------------------------------------
// Metrics and health
// ---------------------------------------------------------------------------------------

/// Every pool with its size and status, for the scrape-time gauges.
pub async fn pool_gauges(c: &impl GenericClient) -> Result<Vec<(PoolRow, PoolStatus)>> {
    pool_list(c, None).await
}

pub async fn ping(c: &impl GenericClient) -> Result<()> {
    c.timed_query("SELECT 1", &[]).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Reconcile
// ---------------------------------------------------------------------------------------

/// Takes the reconcile lease of one pool this pass has not handled yet (`reconcile_until`
/// before the pass started), oldest first. SKIP LOCKED: overlapping passes take different
/// pools; the row lease then keeps them apart until `lease_seconds` pass.
pub async fn pool_take_reconcile_lease(
    c: &impl GenericClient,
    owner: &str,
    pass_started: DateTime<Utc>,
    lease_seconds: f64,
) -> Result<Option<PoolRow>> {
    let row = c
        .timed_query_opt(
            "UPDATE pools p SET reconcile_owner = $1, reconcile_until = now() + make_interval(secs => $3)
             WHERE (p.namespace, p.name) = (
                 SELECT namespace, name FROM pools
                 WHERE reconcile_until < least(now(), $2)
                 ORDER BY reconcile_until
                 LIMIT 1
                 FOR UPDATE SKIP LOCKED
             )
             RETURNING to_jsonb(p) AS pool",
            &[(&owner, Type::TEXT), (&pass_started, Type::TIMESTAMPTZ), (&lease_seconds, Type::FLOAT8)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "pool")).transpose()
}

/// Gives a pool's reconcile lease back (only if this owner still holds it).
pub async fn pool_release_reconcile_lease(c: &impl GenericClient, pool: &PoolRef, owner: &str) -> Result<()> {
    c.timed_execute(
        "UPDATE pools SET reconcile_owner = NULL, reconcile_until = now()
         WHERE namespace = $1 AND name = $2 AND reconcile_owner = $3",
        &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&owner, Type::TEXT)],
    )
    .await?;
    Ok(())
}

/// Every VM row of a pool with whether it has a committed lease.
pub async fn vm_list_for_pool(c: &impl GenericClient, pool: &PoolRef) -> Result<Vec<(VmRow, bool)>> {
    let rows = c
        .timed_query(
            "SELECT to_jsonb(v) AS vm, EXISTS (SELECT 1 FROM leases l WHERE l.vm_id = v.id) AS has_lease
             FROM vms v WHERE v.pool_namespace = $1 AND v.pool_name = $2 ORDER BY v.created_at, v.id",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    rows.iter().map(|r| Ok((json_req(r, "vm")?, r.try_get("has_lease")?))).collect()
}

/// Expires a pool's leases with `expires_at <= now()`: lease removed, VM → DELETING and
/// VM_DELETED_DUE_TO_EXPIRY, in one statement. A concurrent heartbeat either commits first
/// (and the lease is no longer expired when this re-checks it) or finds the lease gone.
pub async fn lease_expire_for_pool(c: &impl GenericClient, pool: &PoolRef) -> Result<Vec<LeaseRow>> {
    let rows = c
        .timed_query(
            "WITH exp AS (
                 DELETE FROM leases WHERE pool_namespace = $1 AND pool_name = $2 AND expires_at <= now()
                 RETURNING *
             ), v AS (
                 UPDATE vms SET phase = 'DELETING', updated_at = now(), attempts = 0, next_attempt_at = NULL
                 FROM exp WHERE vms.id = exp.vm_id
                 RETURNING vms.id
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_DELETED_DUE_TO_EXPIRY', exp.pool_namespace, exp.pool_name, exp.vm_id, exp.lease_id FROM exp
             )
             SELECT to_jsonb(exp) AS lease FROM exp",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "lease")).collect()
}

/// Writes VM_EXPIRING_SOON once per expiry deadline for leases expiring within `window`.
pub async fn lease_warn_expiring_for_pool(c: &impl GenericClient, pool: &PoolRef, window_seconds: f64) -> Result<u64> {
    c.timed_execute(
        "WITH w AS (
                 UPDATE leases SET warned_expires_at = expires_at
                 WHERE pool_namespace = $1 AND pool_name = $2
                   AND expires_at > now() AND expires_at <= now() + make_interval(secs => $3)
                   AND warned_expires_at IS DISTINCT FROM expires_at
                 RETURNING *
             )
             INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id, payload)
             SELECT 'VM_EXPIRING_SOON', w.pool_namespace, w.pool_name, w.vm_id, w.lease_id,
                    jsonb_build_object('expires_at', w.expires_at)
             FROM w",
        &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&window_seconds, Type::FLOAT8)],
    )
    .await
}

/// Inserts a PROVISIONING intent row on the least-loaded eligible host of the pool, in one
/// statement. Eligible: named by the pool, registered, not cordoned, not in `skip`. Load:
/// this pool's VMs on the host, DELETING and FAILED not counted; ties go to the host listed
/// first. The chosen host row is share-locked, so a cordon committing meanwhile waits for
/// this insert (and the next placement sees it). `None`: no eligible host.
pub async fn vm_place_and_insert(
    c: &impl GenericClient,
    pool: &PoolRef,
    id: &str,
    skip: &[String],
) -> Result<Option<VmRow>> {
    let row = c
        .timed_query_opt(
            "WITH p AS (
                 -- KEY SHARE conflicts with a concurrent pool delete: either the delete waits
                 -- and then marks this new row DELETING too, or this insert waits and finds
                 -- the pool gone. A PROVISIONING row can never outlive its pool.
                 SELECT flintlock_hosts FROM pools WHERE namespace = $1 AND name = $2 FOR KEY SHARE
             ), eligible AS (
                 SELECT h.name, array_position(p.flintlock_hosts, h.name) AS ord
                 FROM hosts h, p
                 WHERE h.name = ANY (p.flintlock_hosts) AND NOT h.cordoned AND NOT (h.name = ANY ($4))
                 FOR SHARE OF h
             ), pick AS (
                 SELECT e.name FROM eligible e
                 ORDER BY (SELECT count(*) FROM vms v
                           WHERE v.flintlock_host = e.name AND v.pool_namespace = $1 AND v.pool_name = $2
                             AND v.phase NOT IN ('DELETING', 'FAILED')),
                          e.ord
                 LIMIT 1
             )
             INSERT INTO vms AS v (id, pool_namespace, pool_name, flintlock_host, phase)
             SELECT $3, $1, $2, pick.name, 'PROVISIONING' FROM pick
             RETURNING to_jsonb(v) AS vm",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&id, Type::TEXT), (&skip, Type::TEXT_ARRAY)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "vm")).transpose()
}

/// Records flintlock's uid on an intent row (after CreateMicroVM, or adoption).
pub async fn vm_set_uid(c: &impl GenericClient, vm_id: &str, uid: &str, event: EventType) -> Result<bool> {
    let kind = event.as_str();
    let n = c
        .timed_execute(
            "WITH v AS (
                 UPDATE vms SET uid = $2, attempts = 0, next_attempt_at = NULL, updated_at = now()
                 WHERE id = $1 AND uid IS NULL AND phase = 'PROVISIONING'
                 RETURNING *
             )
             INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
             SELECT $3, v.pool_namespace, v.pool_name, v.id, jsonb_build_object('uid', v.uid, 'host', v.flintlock_host)
             FROM v",
            &[(&vm_id, Type::TEXT), (&uid, Type::TEXT), (&kind, Type::TEXT)],
        )
        .await?;
    Ok(n == 1)
}

/// Moves a VM from one phase to another (never out of DELETING: the guard is the `from`
/// phase), recording interfaces when given and writing `event` in the same statement.
/// `false` if the VM was not in `from` any more.
pub async fn vm_transition(
    c: &impl GenericClient,
    vm_id: &str,
    from: Phase,
    to: Phase,
    network_interfaces: Option<&serde_json::Value>,
    event: Option<(EventType, &serde_json::Value)>,
) -> Result<bool> {
    let (from, to) = (from.as_str(), to.as_str());
    let (kind, payload) = match event {
        Some((k, p)) => (Some(k.as_str()), Some(p)),
        None => (None, None),
    };
    let row = c
        .timed_query_one(
            "WITH v AS (
                 UPDATE vms SET phase = $3, network_interfaces = coalesce($4, network_interfaces),
                     attempts = 0, next_attempt_at = NULL, updated_at = now(),
                     hook_step = 0,
                     hook_started_at = CASE WHEN $3 IN ('CREATE_HOOK_RUNNING', 'PRE_LEASE_HOOK_RUNNING')
                                            THEN now() END,
                     -- Only a LEASED VM names a lease.
                     lease_id = CASE WHEN $3 = 'LEASED' THEN lease_id END
                 WHERE id = $1 AND phase = $2
                 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT $5, v.pool_namespace, v.pool_name, v.id, coalesce($6, '{}'::jsonb) FROM v WHERE $5 IS NOT NULL
             )
             SELECT count(*) FROM v",
            &[
                (&vm_id, Type::TEXT),
                (&from, Type::TEXT),
                (&to, Type::TEXT),
                (&network_interfaces, Type::JSONB),
                (&kind, Type::TEXT),
                (&payload, Type::JSONB),
            ],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)? == 1)
}

/// Backs a VM off after a failed step: attempts + 1, next try after an exponential delay
/// (`base * 2^attempts`, at most `cap`).
pub async fn vm_backoff(c: &impl GenericClient, vm_id: &str, base_seconds: f64, cap_seconds: f64) -> Result<()> {
    c.timed_execute(
        "UPDATE vms SET attempts = attempts + 1,
             next_attempt_at = now() + make_interval(secs => least($3, $2 * power(2, least(attempts, 20))))
         WHERE id = $1",
        &[(&vm_id, Type::TEXT), (&base_seconds, Type::FLOAT8), (&cap_seconds, Type::FLOAT8)],
    )
    .await?;
    Ok(())
}

/// Removes an intent row that never got a uid (its host stayed unreachable). The orphan scan
/// deletes the microVM should the create have reached flintlock after all.
pub async fn vm_delete_intent(c: &impl GenericClient, vm_id: &str) -> Result<bool> {
    let n = c
        .timed_execute(
            "DELETE FROM vms WHERE id = $1 AND uid IS NULL AND phase = 'PROVISIONING'",
            &[(&vm_id, Type::TEXT)],
        )
        .await?;
    Ok(n == 1)
}

/// DELETING VMs whose pool is gone (a deleted pool's stragglers), due for a retry. Each
/// returned VM's next attempt is pushed back first, so an overlapping pass skips it.
pub async fn vm_take_orphaned_deletions(c: &impl GenericClient, limit: i64) -> Result<Vec<VmRow>> {
    let rows = c
        .timed_query(
            "UPDATE vms v SET next_attempt_at = now() + interval '30 seconds'
             WHERE v.id IN (
                 SELECT id FROM vms x
                 WHERE x.phase = 'DELETING' AND (x.next_attempt_at IS NULL OR x.next_attempt_at <= now())
                   AND NOT EXISTS (SELECT 1 FROM pools p WHERE p.namespace = x.pool_namespace AND p.name = x.pool_name)
                 ORDER BY x.id
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             )
             RETURNING to_jsonb(v) AS vm",
            &[(&limit, Type::INT8)],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "vm")).collect()
}

/// Takes the orphan-scan lease of one host due for a scan; the next scan of that host is
/// due `interval_seconds` later.
pub async fn host_take_scan(
    c: &impl GenericClient,
    interval_seconds: f64,
    pass_started: DateTime<Utc>,
) -> Result<Option<HostRow>> {
    // `scan_until` before the pass started: a pass scans each host at most once.
    let row = c
        .timed_query_opt(
            "UPDATE hosts h SET scan_until = now() + make_interval(secs => $1)
             WHERE h.name = (
                 SELECT name FROM hosts WHERE scan_until < least(now(), $2)
                 ORDER BY scan_until LIMIT 1 FOR UPDATE SKIP LOCKED
             )
             RETURNING to_jsonb(h) AS host",
            &[(&interval_seconds, Type::FLOAT8), (&pass_started, Type::TIMESTAMPTZ)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "host")).transpose()
}

/// The rows of the given VM ids: (id, host, uid).
pub async fn vm_identities(c: &impl GenericClient, ids: &[String]) -> Result<Vec<(String, String, Option<String>)>> {
    let rows = c
        .timed_query("SELECT id, flintlock_host, uid FROM vms WHERE id = ANY ($1)", &[(&ids, Type::TEXT_ARRAY)])
        .await?;
    rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))).collect()
}

// ---------------------------------------------------------------------------------------
// Hooks
// ---------------------------------------------------------------------------------------

/// First transaction of a two-phase claim: one AVAILABLE VM → PRE_LEASE_HOOK_RUNNING (no
/// lease yet). Same pick as [`lease_claim`].
pub struct HookClaim {
    pub pool_found: bool,
    pub vm: Option<VmRow>,
    pub host: Option<HostRow>,
    pub commands: Vec<String>,
}

pub async fn vm_claim_for_hook(c: &impl GenericClient, pool: &PoolRef) -> Result<HookClaim> {
    let row = c
        .timed_query_one(
            concat!(
                "WITH pool AS (
                 SELECT pre_lease_commands FROM pools WHERE namespace = $1 AND name = $2
             ), go AS (
                 SELECT 1 FROM pool
             ), ",
                pick_available_vm!(),
                "
             ), upd AS (
                 UPDATE vms v SET phase = 'PRE_LEASE_HOOK_RUNNING', hook_started_at = now(), updated_at = now()
                 FROM picked, pool WHERE v.id = picked.id
                 RETURNING v.*
             )
             SELECT EXISTS (SELECT 1 FROM pool) AS pool_found,
                    coalesce((SELECT pre_lease_commands FROM pool), '{}') AS commands,
                    to_jsonb(upd) AS vm, to_jsonb(h) AS host
             FROM (SELECT 1) AS one
             LEFT JOIN upd ON true
             LEFT JOIN hosts h ON h.name = upd.flintlock_host"
            ),
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    Ok(HookClaim {
        pool_found: row.try_get("pool_found")?,
        vm: json_col(&row, "vm")?,
        host: json_col(&row, "host")?,
        commands: row.try_get("commands")?,
    })
}

pub enum HookLease {
    /// The VM is no longer PRE_LEASE_HOOK_RUNNING (DELETING, or its row is gone): a forced
    /// pool delete took it during the hook. Nothing was written.
    VmTaken,
    /// A concurrent claim with the same request_id won; nothing was written and the VM is
    /// still PRE_LEASE_HOOK_RUNNING (the caller gives it back).
    DuplicateRequestId,
    Claimed(Box<LeaseView>),
}

/// Second transaction of a two-phase claim: the lease, the VM → LEASED and VM_CLAIMED, only
/// while the VM is still PRE_LEASE_HOOK_RUNNING (DELETING is terminal). As in
/// [`lease_claim`], the INSERT runs before the UPDATE, so a rejected request_id changes
/// nothing.
pub async fn lease_insert_after_hook(
    c: &impl GenericClient,
    vm_id: &str,
    lease_id: &str,
    request_id: Option<&str>,
    principal: &str,
) -> Result<HookLease> {
    let row = c
        .timed_query_one(
            "WITH vm AS (
                 SELECT v.id, v.pool_namespace, v.pool_name FROM vms v
                 WHERE v.id = $1 AND v.phase = 'PRE_LEASE_HOOK_RUNNING'
                 FOR NO KEY UPDATE
             ), pool AS (
                 SELECT p.heartbeat_expiry_seconds FROM pools p, vm
                 WHERE p.namespace = vm.pool_namespace AND p.name = vm.pool_name
             ), ins AS (
                 INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at,
                                     last_heartbeat_at, expires_at, request_id, principal)
                 SELECT $2, vm.id, vm.pool_namespace, vm.pool_name, now(), now(),
                        now() + make_interval(secs => pool.heartbeat_expiry_seconds), $3, $4
                 FROM vm, pool
                 ON CONFLICT (principal, request_id) WHERE request_id IS NOT NULL DO NOTHING
                 RETURNING *
             ), upd AS (
                 UPDATE vms v SET phase = 'LEASED', lease_id = ins.lease_id, hook_started_at = NULL, updated_at = now()
                 FROM ins WHERE v.id = ins.vm_id
                 RETURNING v.*
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_CLAIMED', ins.pool_namespace, ins.pool_name, ins.vm_id, ins.lease_id FROM ins
             )
             SELECT EXISTS (SELECT 1 FROM vm) AND EXISTS (SELECT 1 FROM pool) AS vm_ok,
                    to_jsonb(ins) AS lease, to_jsonb(upd) AS vm, to_jsonb(h) AS host
             FROM (SELECT 1) AS one
             LEFT JOIN ins ON true
             LEFT JOIN upd ON true
             LEFT JOIN hosts h ON h.name = upd.flintlock_host",
            &[(&vm_id, Type::TEXT), (&lease_id, Type::TEXT), (&request_id, Type::TEXT), (&principal, Type::TEXT)],
        )
        .await?;
    if !row.try_get::<_, bool>("vm_ok")? {
        return Ok(HookLease::VmTaken);
    }
    if json_col::<LeaseRow>(&row, "lease")?.is_none() {
        return Ok(HookLease::DuplicateRequestId);
    }
    Ok(HookLease::Claimed(Box::new(lease_view(&row)?)))
}

/// Records that a CREATE_HOOK_RUNNING VM finished create command `step - 1`.
pub async fn vm_set_hook_step(c: &impl GenericClient, vm_id: &str, step: i32) -> Result<bool> {
    let n = c
        .timed_execute(
            "UPDATE vms SET hook_step = $2, attempts = 0, next_attempt_at = NULL, updated_at = now()
             WHERE id = $1 AND phase = 'CREATE_HOOK_RUNNING'",
            &[(&vm_id, Type::TEXT), (&step, Type::INT4)],
        )
        .await?;
    Ok(n == 1)
}

/// Marks DELETING every VM of the pool stuck in PRE_LEASE_HOOK_RUNNING for longer than
/// `older_than_seconds`: the claim that took it died mid-hook. Never back to AVAILABLE: the
/// hook may have half-run, and the VM must not be handed out in an unknown state.
pub async fn vm_recover_abandoned_claims(
    c: &impl GenericClient,
    pool: &PoolRef,
    older_than_seconds: f64,
) -> Result<Vec<String>> {
    let rows = c
        .timed_query(
            "WITH v AS (
                 UPDATE vms SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now()
                 WHERE pool_namespace = $1 AND pool_name = $2 AND phase = 'PRE_LEASE_HOOK_RUNNING'
                   AND hook_started_at < now() - make_interval(secs => $3)
                 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT 'VM_HOOK_FAILED', v.pool_namespace, v.pool_name, v.id,
                        jsonb_build_object('hook', 'pre_lease', 'reason', 'claim abandoned mid-hook; VM deleted')
                 FROM v
             )
             SELECT id FROM v",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&older_than_seconds, Type::FLOAT8)],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Stores what a ServerInfo probe of a host said.
pub async fn host_record_probe(
    c: &impl GenericClient,
    name: &str,
    version: Option<&str>,
    exec_unavailable: Option<&str>,
) -> Result<()> {
    c.timed_execute(
        "UPDATE hosts SET flintlock_version = $2, exec_unavailable_reason = $3, checked_at = now() WHERE name = $1",
        &[(&name, Type::TEXT), (&version, Type::TEXT), (&exec_unavailable, Type::TEXT)],
    )
    .await?;
    Ok(())
}

/// Shrinks a pool whose size went down: up to `n` AVAILABLE VMs (oldest first) → DELETING,
/// with VM_DELETED_ON_SCALE_DOWN. SKIP LOCKED: a VM being claimed right now is left alone.
pub async fn vm_mark_surplus(c: &impl GenericClient, pool: &PoolRef, n: i64) -> Result<u64> {
    c.timed_execute(
        "WITH picked AS (
                 SELECT id FROM vms
                 WHERE pool_namespace = $1 AND pool_name = $2 AND phase = 'AVAILABLE'
                 ORDER BY created_at
                 LIMIT $3
                 FOR NO KEY UPDATE SKIP LOCKED
             ), v AS (
                 UPDATE vms SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now()
                 FROM picked WHERE vms.id = picked.id
                 RETURNING vms.*
             )
             INSERT INTO events (type, pool_namespace, pool_name, vm_id)
             SELECT 'VM_DELETED_ON_SCALE_DOWN', v.pool_namespace, v.pool_name, v.id FROM v",
        &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&n, Type::INT8)],
    )
    .await
}
