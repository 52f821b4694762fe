//! The `hosts` table: [`HostRow`] (secrets included: the API view drops them) and the
//! `host_*` statements: registration, cordon, removal, the orphan-scan lease and what a
//! ServerInfo probe said.
//!
//! Never talks to flintlock: the probe's answer is handed in.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::{Executor, Result, Timed, json_req};
use crate::domain::HostExec;

/// A `hosts` row, secrets included; the API view drops them.
#[derive(Debug, Clone, Deserialize)]
pub struct HostRow {
    pub name: String,
    pub address: String,
    pub tls_insecure: bool,
    pub ca_pem: Option<String>,
    pub cert_pem: Option<String>,
    /// Sealed when `credentials_key_id` is set ([`crate::credentials`], V24), as is the token.
    pub key_pem: Option<String>,
    pub basic_auth_token: Option<String>,
    /// The key-encryption key's id and the wrapped data key of the sealed secrets (V24);
    /// `None`: stored before encryption, in plaintext (a pass seals them once a key is set).
    #[serde(default)]
    pub credentials_key_id: Option<String>,
    #[serde(default)]
    pub credentials_dek: Option<String>,
    pub cordoned: bool,
    pub cordoned_reason: Option<String>,
    pub cordoned_at: Option<DateTime<Utc>>,
    /// What the exec gate believes: ServerInfo (`auto`) or an admin's declaration.
    pub exec: HostExec,
    pub flintlock_version: Option<String>,
    pub exec_unavailable_reason: Option<String>,
    pub checked_at: Option<DateTime<Utc>>,
    /// A reconcile pass could not reach it: no new VMs on it until then (V9).
    #[serde(default)]
    pub unreachable_until: Option<DateTime<Utc>>,
    /// Since when calls have found it unreachable, without one reaching it (V16): judged dead
    /// past `POOLMGR_HOST_DEAD_SECONDS`.
    #[serde(default)]
    pub unreachable_since: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl HostRow {
    /// What the flintlock client needs to reach this host.
    pub fn endpoint(&self) -> crate::flintlock::Endpoint {
        crate::flintlock::Endpoint {
            name: self.name.clone(),
            address: self.address.clone(),
            tls_insecure: self.tls_insecure,
            ca_pem: self.ca_pem.clone(),
            cert_pem: self.cert_pem.clone(),
            key_pem: self.key_pem.clone(),
            basic_auth_token: self.basic_auth_token.clone(),
            credentials_key_id: self.credentials_key_id.clone(),
            credentials_dek: self.credentials_dek.clone(),
        }
    }

    /// The secrets as the row stores them ([`crate::credentials::Keyring::open`] reads them).
    pub fn stored_credentials(&self) -> crate::credentials::Stored {
        crate::credentials::Stored {
            key_pem: self.key_pem.clone(),
            basic_auth_token: self.basic_auth_token.clone(),
            key_id: self.credentials_key_id.clone(),
            dek: self.credentials_dek.clone(),
        }
    }
}

/// Registered hosts among `names` that are missing, locking the present ones against a
/// concurrent RemoveHost until the caller's transaction ends.
pub async fn host_missing_for_pool(c: &impl Executor, names: &[String]) -> Result<Vec<String>> {
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

/// The writable fields of a host; its secrets as they are to be stored (sealed by
/// [`crate::credentials::Keyring::seal`]: this layer never sees them in plaintext).
pub struct HostWrite<'a> {
    pub name: &'a str,
    pub address: &'a str,
    pub tls_insecure: bool,
    pub ca_pem: Option<&'a str>,
    pub cert_pem: Option<&'a str>,
    pub secrets: &'a crate::credentials::Stored,
    pub exec: HostExec,
}

const HOST_VM_COUNT: &str = "(SELECT count(*) FROM vms v WHERE v.flintlock_host = h.name) AS vm_count";

fn host_with_count(row: &Row) -> Result<(HostRow, i64)> {
    Ok((json_req(row, "host")?, row.try_get("vm_count")?))
}

/// The unique index on `lower(address)` (V9): one host record per flintlockd. A host insert
/// or update that would repeat an address fails with [`super::StoreError::UniqueViolation`] naming it.
pub const HOSTS_ADDRESS_KEY: &str = "hosts_address_key";

/// The name of the host registered at `address` (compared without case), if any.
pub async fn host_name_by_address(c: &impl Executor, address: &str) -> Result<Option<String>> {
    let row =
        c.timed_query_opt("SELECT name FROM hosts WHERE lower(address) = lower($1)", &[(&address, Type::TEXT)]).await?;
    Ok(row.map(|r| r.get(0)))
}

/// Inserts a host, uncordoned; `None` if the name is taken. An address another host has
/// fails with [`super::StoreError::UniqueViolation`] on [`HOSTS_ADDRESS_KEY`].
pub async fn host_insert(c: &impl Executor, h: &HostWrite<'_>) -> Result<Option<(HostRow, i64)>> {
    let row = c
        .timed_query_opt(
            "INSERT INTO hosts AS h (name, address, tls_insecure, ca_pem, cert_pem, key_pem, basic_auth_token, exec,
                                     credentials_key_id, credentials_dek)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
             ON CONFLICT (name) DO NOTHING
             RETURNING to_jsonb(h) AS host, 0::bigint AS vm_count",
            &[
                (&h.name, Type::TEXT),
                (&h.address, Type::TEXT),
                (&h.tls_insecure, Type::BOOL),
                (&h.ca_pem, Type::TEXT),
                (&h.cert_pem, Type::TEXT),
                (&h.secrets.key_pem, Type::TEXT),
                (&h.secrets.basic_auth_token, Type::TEXT),
                (&h.exec.as_str(), Type::TEXT),
                (&h.secrets.key_id, Type::TEXT),
                (&h.secrets.dek, Type::TEXT),
            ],
        )
        .await?;
    row.as_ref().map(host_with_count).transpose()
}

/// Replaces address, TLS, token and exec declaration; keeps the cordon state and what the
/// last ServerInfo probe said. `None` if unknown. An address another host has fails with
/// [`super::StoreError::UniqueViolation`] on [`HOSTS_ADDRESS_KEY`].
/// Replaces a host's settings; `None` when there is no such host *or* it has VM rows and the
/// address would change (the caller tells which with [`host_get`]).
pub async fn host_update(c: &impl Executor, h: &HostWrite<'_>) -> Result<Option<(HostRow, i64)>> {
    let sql = format!(
        "UPDATE hosts AS h SET address = $2, tls_insecure = $3, ca_pem = $4, cert_pem = $5,
             key_pem = $6, basic_auth_token = $7, exec = $8, credentials_key_id = $9, credentials_dek = $10,
             updated_at = now()
         WHERE name = $1
           -- A new address only while no VM row names the host: its microVMs are at the old
           -- one (issue 23 finding 5). Refused rows: `host_update`'s caller tells why.
           AND (lower(h.address) = lower($2) OR NOT EXISTS (SELECT 1 FROM vms v WHERE v.flintlock_host = h.name))
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
                (&h.secrets.key_pem, Type::TEXT),
                (&h.secrets.basic_auth_token, Type::TEXT),
                (&h.exec.as_str(), Type::TEXT),
                (&h.secrets.key_id, Type::TEXT),
                (&h.secrets.dek, Type::TEXT),
            ],
        )
        .await?;
    row.as_ref().map(host_with_count).transpose()
}

pub async fn host_get(c: &impl Executor, name: &str) -> Result<Option<(HostRow, i64)>> {
    let sql = format!("SELECT to_jsonb(h) AS host, {HOST_VM_COUNT} FROM hosts h WHERE h.name = $1");
    let row = c.timed_query_opt(&sql, &[(&name, Type::TEXT)]).await?;
    row.as_ref().map(host_with_count).transpose()
}

/// Every host row, without its VM count: what the reconcile pass needs (placement, sick
/// hosts), at the cost of reading `hosts` alone. [`host_list`]'s count reads every VM row
/// (10 to 25 ms at 100,000 VMs), which a pass paid at its start and again per pool it stepped.
pub async fn host_rows(c: &impl Executor) -> Result<Vec<HostRow>> {
    let rows = c.timed_query("SELECT to_jsonb(h) AS host FROM hosts h ORDER BY h.name", &[]).await?;
    rows.iter().map(|r| json_req(r, "host")).collect()
}

pub async fn host_list(c: &impl Executor) -> Result<Vec<(HostRow, i64)>> {
    let sql = format!("SELECT to_jsonb(h) AS host, {HOST_VM_COUNT} FROM hosts h ORDER BY h.name");
    let rows = c.timed_query(&sql, &[]).await?;
    rows.iter().map(host_with_count).collect()
}

/// One page of hosts by name, after `after` (a page's last name; `""`: from the first), at
/// most `limit`, with their VM counts.
pub async fn host_list_page(c: &impl Executor, after: &str, limit: i64) -> Result<Vec<(HostRow, i64)>> {
    let sql =
        format!("SELECT to_jsonb(h) AS host, {HOST_VM_COUNT} FROM hosts h WHERE h.name > $1 ORDER BY h.name LIMIT $2");
    let rows = c.timed_query(&sql, &[(&after, Type::TEXT), (&limit, Type::INT8)]).await?;
    rows.iter().map(host_with_count).collect()
}

/// Replaces a host's stored secrets with `new` (re-wrapped under the current key, or sealed
/// for the first time) only if they are still `old`: a host write in between wins, and the
/// next pass looks again. A plaintext row (`old` without a key id) is sealed only once the
/// upgrade's grace is over (`deployment.seal_host_credentials_from`, V24). Whether it was
/// written.
pub async fn host_reseal_credentials(
    c: &impl Executor,
    name: &str,
    old: &crate::credentials::Stored,
    new: &crate::credentials::Stored,
) -> Result<bool> {
    let n = c
        .timed_execute(
            "UPDATE hosts SET key_pem = $6, basic_auth_token = $7, credentials_key_id = $8, credentials_dek = $9
             WHERE name = $1
               AND key_pem IS NOT DISTINCT FROM $2 AND basic_auth_token IS NOT DISTINCT FROM $3
               AND credentials_key_id IS NOT DISTINCT FROM $4 AND credentials_dek IS NOT DISTINCT FROM $5
               AND ($4::text IS NOT NULL OR now() >= (SELECT seal_host_credentials_from FROM deployment))",
            &[
                (&name, Type::TEXT),
                (&old.key_pem, Type::TEXT),
                (&old.basic_auth_token, Type::TEXT),
                (&old.key_id, Type::TEXT),
                (&old.dek, Type::TEXT),
                (&new.key_pem, Type::TEXT),
                (&new.basic_auth_token, Type::TEXT),
                (&new.key_id, Type::TEXT),
                (&new.dek, Type::TEXT),
            ],
        )
        .await?;
    Ok(n == 1)
}

/// Sets or clears the cordon; `cordoned_at` moves to now on every cordon. `None` if unknown.
pub async fn host_set_cordon(c: &impl Executor, name: &str, cordon: Option<&str>) -> Result<Option<(HostRow, i64)>> {
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
pub async fn host_lock(c: &impl Executor, name: &str) -> Result<()> {
    c.timed_query_opt("SELECT 1 FROM hosts WHERE name = $1 FOR UPDATE", &[(&name, Type::TEXT)]).await?;
    Ok(())
}

/// Removes a host unless a pool names it or a VM row is on it. Must run inside a
/// transaction: the host row is locked first, which conflicts with the KEY SHARE lock a
/// concurrent pool create/update takes on the hosts it names.
pub async fn host_delete(c: &impl Executor, name: &str) -> Result<HostDelete> {
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

/// Takes the orphan-scan lease of one host due for a scan; the next scan of that host is
/// due `interval_seconds` later.
pub async fn host_take_scan(
    c: &impl Executor,
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

/// Records that a call to host `name` found it unreachable: no placements on it for
/// `for_seconds` ([`super::vm_place_and_insert`]).
pub async fn host_mark_unreachable(c: &impl Executor, name: &str, for_seconds: f64) -> Result<()> {
    c.timed_execute(
        "UPDATE hosts SET unreachable_until = now() + make_interval(secs => $2),
             unreachable_since = coalesce(unreachable_since, now())
         WHERE name = $1",
        &[(&name, Type::TEXT), (&for_seconds, Type::FLOAT8)],
    )
    .await?;
    Ok(())
}

/// A claim could not reach host `name`: its orphan scan (which lists it, and so finds out
/// whether it is unreachable, starting the dead-host clock) is due at the next pass.
pub async fn host_scan_now(c: &impl Executor, name: &str) -> Result<()> {
    c.timed_execute("UPDATE hosts SET scan_until = '-infinity' WHERE name = $1", &[(&name, Type::TEXT)]).await?;
    Ok(())
}

/// A call reached host `name` again: placements on it are fine again, and its orphan scan is
/// due at once (rows whose microVMs it lost meanwhile, microVMs whose rows were retired while
/// it was dead).
pub async fn host_clear_unreachable(c: &impl Executor, name: &str) -> Result<()> {
    c.timed_execute(
        "UPDATE hosts SET unreachable_until = NULL, unreachable_since = NULL,
             scan_until = CASE WHEN unreachable_since IS NOT NULL THEN '-infinity' ELSE scan_until END
         WHERE name = $1 AND (unreachable_until IS NOT NULL OR unreachable_since IS NOT NULL)",
        &[(&name, Type::TEXT)],
    )
    .await?;
    Ok(())
}

/// Stores what a ServerInfo probe of a host said.
pub async fn host_record_probe(
    c: &impl Executor,
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
