//! Client scopes and quotas through the admin routes (`/v1/principals`): list, get, set,
//! remove. Each change is logged with the admin who made it, and reaches every instance
//! within `POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS` ([`crate::limits`]).

use crate::api::{PrincipalLimits, PrincipalLimitsList};
use crate::app::AppState;
use crate::domain::EventType;
use crate::error::ApiError;
use crate::store;

fn not_found(principal: &str) -> ApiError {
    ApiError::NotFound(format!("principal {principal} has no limits (it may claim from every pool, without a quota)"))
}

pub async fn list(state: &AppState) -> Result<PrincipalLimitsList, ApiError> {
    let conn = state.conn().await?;
    let rows = store::principal_limits_list(&conn).await?;
    Ok(PrincipalLimitsList { principals: rows.iter().map(|(r, live)| PrincipalLimits::new(r, *live)).collect() })
}

pub async fn get(state: &AppState, principal: &str) -> Result<PrincipalLimits, ApiError> {
    let conn = state.conn().await?;
    match store::principal_limits_get(&conn, principal).await? {
        Some((row, live)) => Ok(PrincipalLimits::new(&row, live)),
        None => Err(not_found(principal)),
    }
}

/// Sets a principal's limits; `true` if it had none before.
pub async fn set(
    state: &AppState,
    principal: &str,
    pools: Option<Vec<String>>,
    max_live_leases: Option<i32>,
    by: &str,
) -> Result<(PrincipalLimits, bool), ApiError> {
    crate::limits::validate(principal, pools.as_deref(), max_live_leases)?;
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    let (row, live, created) =
        store::principal_limits_put(&tx, principal, pools.as_deref(), max_live_leases, by).await?;
    let payload = serde_json::json!({"pools": row.pools, "max_live_leases": row.max_live_leases});
    super::audit_fleet(&tx, EventType::PrincipalLimitsSet, ("principal", principal), by, payload).await?;
    tx.commit().await?;
    state.limits.invalidate().await;
    tracing::info!(principal, pools = ?row.pools, max_live_leases = ?row.max_live_leases, by, "principal limits set");
    Ok((PrincipalLimits::new(&row, live), created))
}

pub async fn remove(state: &AppState, principal: &str, by: &str) -> Result<(), ApiError> {
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    if !store::principal_limits_delete(&tx, principal).await? {
        return Err(not_found(principal));
    }
    super::audit_fleet(&tx, EventType::PrincipalLimitsRemoved, ("principal", principal), by, serde_json::json!({}))
        .await?;
    tx.commit().await?;
    state.limits.invalidate().await;
    tracing::info!(principal, by, "principal limits removed");
    Ok(())
}
