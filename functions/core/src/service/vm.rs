//! VMs: list and get, read-only. VMs are created, claimed and deleted by the claim, lease,
//! pool and reconcile paths, never here.

use crate::api::VmRecord;
use crate::app::AppState;
use crate::domain::Phase;
use crate::error::ApiError;
use crate::store;

/// VMs, optionally filtered by pool namespace, pool name and phase (`None`: any).
pub async fn list(
    state: &AppState,
    namespace: Option<&str>,
    pool: Option<&str>,
    phase: Option<Phase>,
) -> Result<Vec<VmRecord>, ApiError> {
    let conn = state.conn().await?;
    let vms = store::vm_list(&conn, namespace, pool, phase).await?;
    Ok(vms.iter().map(Into::into).collect())
}

pub async fn get(state: &AppState, id: &str) -> Result<VmRecord, ApiError> {
    let conn = state.conn().await?;
    let vm = store::vm_get(&conn, id).await?.ok_or_else(|| ApiError::NotFound(format!("vm {id} not found")))?;
    Ok(VmRecord::from(&vm))
}
