//! VMs: list and get, and an operator's discard of one VM (`DELETE /v1/vms/{id}`). VMs are
//! created, claimed and otherwise deleted by the claim, lease, pool and reconcile paths.
//!
//! Never discards a LEASED VM: its lease is released instead, so a client never loses a VM
//! it holds without hearing of it through its lease.

use crate::api::VmRecord;
use crate::app::AppState;
use crate::domain::Phase;
use crate::error::ApiError;
use crate::store::{self, VmDiscard};
use crate::teardown::{self, TeardownError};

/// VMs, optionally filtered by pool namespace, pool name and phase (`None`: any).
/// One page of VMs by id, and the next page's token (empty on the last).
pub async fn list(
    state: &AppState,
    namespace: Option<&str>,
    pool: Option<&str>,
    phase: Option<Phase>,
    page_size: Option<i64>,
    page_token: Option<&str>,
) -> Result<(Vec<VmRecord>, String), ApiError> {
    let size = super::page_size(page_size)?;
    let after = super::page_key(page_token, |id| {
        // VM ids are `<pool name>-<ulid>`: lowercase letters, digits and `-`.
        let id_like = id.len() <= crate::rules::MAX_PAGE_KEY_CHARS
            && id.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        id_like.then(|| id.to_owned())
    })?;
    let conn = state.conn().await?;
    let vms = store::vm_list(&conn, namespace, pool, phase, after.as_deref().unwrap_or(""), size + 1).await?;
    let (vms, next) = super::page_of(vms, size, |v| v.id.clone());
    Ok((vms.iter().map(Into::into).collect(), next))
}

pub async fn get(state: &AppState, id: &str) -> Result<VmRecord, ApiError> {
    let conn = state.conn().await?;
    let vm = store::vm_get(&conn, id).await?.ok_or_else(|| ApiError::NotFound(format!("vm {id} not found")))?;
    Ok(VmRecord::from(&vm))
}

/// A failed teardown in the contract's terms: 503, the VM stays DELETING and the reconciler
/// (or a retry of the same DELETE) finishes it.
fn delete_pending(id: &str, e: TeardownError) -> ApiError {
    let e = match e {
        TeardownError::HostNotRegistered { .. } => {
            ApiError::unavailable(format!("vm {id} is DELETING; its delete is pending, retry later"), e)
        }
        TeardownError::Flintlock(e) => ApiError::unavailable(
            format!(
                "vm {id} is DELETING but flintlock could not delete it yet; the reconciler retries, or retry later"
            ),
            e,
        ),
        TeardownError::Store(e) => return ApiError::from(e),
    };
    e.reason("CLEANUP_PENDING")
}

/// Discards one VM (typically QUARANTINED, once an operator looked at it): → DELETING with
/// VM_DISCARDED, deleted in flintlock, row removed. A LEASED VM is refused
/// (FAILED_PRECONDITION); a VM already DELETING is finished, so a retry after a 503 is safe.
/// Runs detached from the request, like a release, so a client that disconnects cannot stop
/// it between the mark and the flintlock delete.
pub async fn discard(state: &AppState, id: &str, by: &str) -> Result<(), ApiError> {
    let (state, id, by) = (state.clone(), id.to_owned(), by.to_owned());
    super::detached(async move {
        let found = {
            let conn = state.conn().await?;
            store::vm_begin_discard(&conn, &id, &by).await?
        };
        let (vm, host, from) = match found {
            VmDiscard::NotFound => return Err(ApiError::NotFound(format!("vm {id} not found"))),
            VmDiscard::Leased => {
                return Err(ApiError::FailedPrecondition(format!(
                    "vm {id} is LEASED: release its lease instead (DELETE /v1/leases/{{lease_id}}; GET /v1/vms/{id} names it)"
                )));
            }
            VmDiscard::Deleting { vm, host, from } => (vm, host, from),
        };
        tracing::info!(vm = %id, pool = %vm.pool_ref(), %from, %by, "vm discarded");
        teardown::finish_vm_delete(&state.flintlock, &state.db, &vm, host.as_deref())
            .await
            .map_err(|e| delete_pending(&id, e))?;
        Ok(())
    })
    .await
}
