//! VM teardown: deleting a DELETING VM's microVM in flintlock, then its rows. One home for
//! the step every deleter shares: lease release and pool deletion ([`crate::service`]), a
//! failed pre-lease hook, and the reconcile pass that finishes whatever they left DELETING.
//!
//! Below both `service` and `reconcile`, so neither reaches into the other. It answers in its
//! own [`TeardownError`]: each caller decides what a failure means to it (a 503 for a
//! release, a backoff for the reconciler). Never marks a VM DELETING itself, and never holds
//! a database connection during the flintlock call.

use crate::db::Db;

use crate::flintlock::{Flintlock, FlintlockError};
use crate::store::{self, HostRow, StoreError, VmFinish, VmRow};

#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    /// The VM has a microVM but its host is no longer registered: nobody can delete it now.
    #[error("host {host} of vm {vm} is not registered")]
    HostNotRegistered { host: String, vm: String },
    /// flintlock could not delete the microVM; the VM stays DELETING.
    #[error(transparent)]
    Flintlock(#[from] FlintlockError),
    /// The microVM is gone but its rows could not be removed; the VM stays DELETING.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Deletes a DELETING VM in flintlock and then removes its row (and any lease left on it).
/// A VM flintlock no longer knows counts as deleted. On a flintlock failure the VM stays
/// DELETING for the reconciler to retry. The connection is checked out only once flintlock
/// answered, so a caller holding none never waits on the database during the gRPC call.
pub async fn finish_vm_delete(
    flintlock: &Flintlock,
    db: &Db,
    vm: &VmRow,
    host: Option<&HostRow>,
) -> Result<VmFinish, TeardownError> {
    if let Some(uid) = &vm.uid {
        let host = host
            .ok_or_else(|| TeardownError::HostNotRegistered { host: vm.flintlock_host.clone(), vm: vm.id.clone() })?;
        flintlock.delete(&host.endpoint(), uid).await?;
    }
    let conn = db.get().await?;
    Ok(store::vm_finish_delete(&conn, &vm.id).await?)
}
