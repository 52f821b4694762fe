//! The `principal_limits` table (V22): a client principal's pool scope and live-lease quota,
//! and the quota's count and lock.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed, json_req};

/// A `principal_limits` row.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct PrincipalLimitsRow {
    pub principal: String,
    /// Pool patterns (`namespace/*`, `namespace/name`); `None`: every pool.
    pub pools: Option<Vec<String>>,
    /// `None`: no quota.
    pub max_live_leases: Option<i32>,
    pub updated_at: DateTime<Utc>,
    pub updated_by: String,
}

/// What a quota counts for `$1`: its live leases and its claims running a pre-lease hook.
const LIVE_COUNT: &str = "(SELECT count(*) FROM leases l WHERE l.principal = $1 AND l.expires_at > now())
     + (SELECT count(*) FROM vms v WHERE v.claim_principal = $1 AND v.phase = 'PRE_LEASE_HOOK_RUNNING')";

/// Every principal's limits, by name, with what each quota counts now.
pub async fn principal_limits_list(c: &impl Executor) -> Result<Vec<(PrincipalLimitsRow, i64)>> {
    let sql = format!(
        "SELECT to_jsonb(p) AS p, {} AS live FROM principal_limits p ORDER BY principal",
        LIVE_COUNT.replace("$1", "p.principal")
    );
    let rows = c.timed_query(&sql, &[]).await?;
    rows.iter().map(|r| Ok((json_req(r, "p")?, r.try_get("live")?))).collect()
}

/// Every principal's limits (the claim path's cache).
pub async fn principal_limits_all(c: &impl Executor) -> Result<Vec<PrincipalLimitsRow>> {
    let rows = c.timed_query("SELECT to_jsonb(p) AS p FROM principal_limits p ORDER BY principal", &[]).await?;
    rows.iter().map(|r| json_req(r, "p")).collect()
}

/// One principal's limits and what its quota counts now.
pub async fn principal_limits_get(c: &impl Executor, principal: &str) -> Result<Option<(PrincipalLimitsRow, i64)>> {
    let sql = format!("SELECT to_jsonb(p) AS p, {LIVE_COUNT} AS live FROM principal_limits p WHERE principal = $1");
    let row = c.timed_query_opt(&sql, &[(&principal, Type::TEXT)]).await?;
    row.map(|r| Ok((json_req(&r, "p")?, r.try_get("live")?))).transpose()
}

/// Sets a principal's limits (creating its row): the row, what its quota counts now, and
/// `true` if it had none before.
pub async fn principal_limits_put(
    c: &impl Executor,
    principal: &str,
    pools: Option<&[String]>,
    max_live_leases: Option<i32>,
    by: &str,
) -> Result<(PrincipalLimitsRow, i64, bool)> {
    let pools: Option<Vec<String>> = pools.map(<[String]>::to_vec);
    let sql = format!(
        "INSERT INTO principal_limits AS p (principal, pools, max_live_leases, updated_by)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (principal) DO UPDATE
             SET pools = $2, max_live_leases = $3, updated_by = $4, updated_at = now()
         RETURNING to_jsonb(p) AS p, {LIVE_COUNT} AS live, (xmax = 0) AS created"
    );
    let row = c
        .timed_query_one(
            &sql,
            &[(&principal, Type::TEXT), (&pools, Type::TEXT_ARRAY), (&max_live_leases, Type::INT4), (&by, Type::TEXT)],
        )
        .await?;
    Ok((json_req(&row, "p")?, row.try_get("live")?, row.try_get("created")?))
}

/// Removes a principal's limits; `false` if it had none.
pub async fn principal_limits_delete(c: &impl Executor, principal: &str) -> Result<bool> {
    Ok(c.timed_execute("DELETE FROM principal_limits WHERE principal = $1", &[(&principal, Type::TEXT)]).await? == 1)
}

/// Inside the caller's transaction: locks the principal's limits row until it ends (so the
/// principal's claims under a quota run one at a time) and returns its quota and what the
/// quota counts now. `None` without a row or without a quota.
///
/// The lock makes the count exact: a concurrent claim of the same principal waits here until
/// this transaction commits its lease, and its own count (a new snapshot, READ COMMITTED)
/// then sees that lease.
pub async fn principal_quota_lock(c: &impl Executor, principal: &str) -> Result<Option<(i32, i64)>> {
    let row = c
        .timed_query_opt(
            "SELECT max_live_leases FROM principal_limits
             WHERE principal = $1 AND max_live_leases IS NOT NULL FOR UPDATE",
            &[(&principal, Type::TEXT)],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let max: i32 = row.try_get("max_live_leases")?;
    let live: i64 = c
        .timed_query_one(&format!("SELECT {LIVE_COUNT} AS live"), &[(&principal, Type::TEXT)])
        .await?
        .try_get("live")?;
    Ok(Some((max, live)))
}
