//! Leases: get, heartbeat, list, release. The VM delete a release ends with is
//! [`crate::teardown`], shared with pool deletion and the reconciler.
//!
//! Owner-scoped: a client token reaches only the leases its own principal claimed, another
//! principal's answering exactly as an unknown id ([`Principal::lease_owner`]); an admin
//! token reaches every lease. Never check ownership apart from the statement that acts.

use chrono::Utc;

use crate::api::LeaseRecord;
use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{LeaseId, PoolRef};
use crate::error::ApiError;
use crate::store::{self, VmFinish};
use crate::teardown::{self, TeardownError};

pub use crate::rules::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE};

fn lease_not_found(id: &LeaseId) -> ApiError {
    ApiError::NotFound(format!("lease {} not found", id.as_str()))
}

pub async fn get(state: &AppState, principal: &Principal, id: &LeaseId) -> Result<LeaseRecord, ApiError> {
    let conn = state.conn().await?;
    let view =
        store::lease_get(&conn, id.as_str(), principal.lease_owner()).await?.ok_or_else(|| lease_not_found(id))?;
    Ok(LeaseRecord::from_view(&view))
}

pub async fn heartbeat(state: &AppState, principal: &Principal, id: &LeaseId) -> Result<LeaseRecord, ApiError> {
    let conn = state.conn().await?;
    match store::lease_heartbeat(&conn, id.as_str(), principal.lease_owner(), state.clock.now_param()).await? {
        Some(view) => Ok(LeaseRecord::from_view(&view)),
        None => Err(ApiError::NotFound(format!(
            "lease {} not found (released, expired, or its pool was deleted): claim a new VM",
            id.as_str()
        ))),
    }
}

/// The lease id a `page_token` says the previous page ended at ([`super::page_key`]).
fn page_after(page_token: Option<&str>) -> Result<Option<LeaseId>, ApiError> {
    super::page_key(page_token, |id| LeaseId::parse(id).ok())
}

pub struct Page {
    pub leases: Vec<LeaseRecord>,
    pub next_page_token: String,
}

/// Lists leases; a client token sees only its own principal's leases.
pub async fn list(
    state: &AppState,
    principal: &Principal,
    pool: Option<&PoolRef>,
    page_size: Option<i64>,
    page_token: Option<&str>,
) -> Result<Page, ApiError> {
    let size = super::page_size(page_size)?;
    let after = page_after(page_token)?;
    let conn = state.conn().await?;
    // One extra row tells whether another page exists.
    let views =
        store::lease_list(&conn, pool, principal.lease_owner(), after.as_ref().map_or("", LeaseId::as_str), size + 1)
            .await?;
    let (views, next_page_token) = super::page_of(views, size, |v| v.lease.lease_id.clone());
    Ok(Page { leases: views.iter().map(LeaseRecord::from_view).collect(), next_page_token })
}

/// A VM teardown's failure in the contract's terms: the release answers 503 and leaves the
/// VM DELETING, so a retry (or the reconciler) finishes it.
fn cleanup_pending(e: TeardownError) -> ApiError {
    let e = match e {
        TeardownError::HostNotRegistered { .. } => ApiError::unavailable("vm cleanup pending, retry later", e),
        TeardownError::Flintlock(e) => {
            ApiError::unavailable("vm cleanup pending: flintlock could not delete the VM, retry later", e)
        }
        TeardownError::Store(e) => return ApiError::from(e),
    };
    e.reason("CLEANUP_PENDING")
}

/// ReleaseVM: VM → DELETING, flintlock delete, then the VM and lease rows go together.
/// Runs detached from the request so a client that disconnects cannot stop it halfway.
pub async fn release(state: &AppState, principal: &Principal, id: &LeaseId) -> Result<(), ApiError> {
    let state = state.clone();
    let id = id.clone();
    let owner = principal.lease_owner().map(str::to_owned);
    super::detached(async move {
        let conn = state.conn().await?;
        let view = store::lease_begin_release(&conn, id.as_str(), owner.as_deref())
            .await?
            .ok_or_else(|| lease_not_found(&id))?;
        drop(conn);
        let Some(vm) = view.vm else {
            // The VM row is gone (a concurrent deleter finished it); only the lease remains.
            let conn = state.conn().await?;
            store::lease_delete(&conn, id.as_str()).await?;
            return Ok(());
        };
        match teardown::finish_vm_delete(&state.flintlock, &state.db, &vm, view.host.as_ref())
            .await
            .map_err(cleanup_pending)?
        {
            VmFinish::Removed { lease: Some(lease), .. } => {
                let held = (Utc::now() - lease.claimed_at).as_seconds_f64();
                state.metrics.release(&lease.pool_ref(), "api", Some(held));
            }
            // Someone else (the reconciler) finished this delete; it records the release.
            VmFinish::Removed { lease: None, .. } | VmFinish::Gone => {}
        }
        // Its VM is gone: a pool that replaces released VMs needs a pass.
        state.wake("release").await;
        Ok(())
    })
    .await
}
