//! Sweeps: the steps that end things. Lease expiry and the expiring-soon warnings, claims
//! abandoned mid pre-lease hook, finishing DELETING VMs (through [`crate::teardown`]), the
//! stragglers of deleted pools, and the AVAILABLE VMs a shrunk pool no longer keeps.
//!
//! Never deletes a microVM whose row is not DELETING, and never removes a row before
//! flintlock confirmed its microVM gone: a VM whose delete fails stays DELETING and backs off.

use chrono::Utc;

use super::conn::StepConn;
use super::strategy::surplus;
use super::{Pass, PassReport, ReconcileError, hosts_by_name};
use crate::domain::PoolRef;
use crate::domain::VmCounts;
use crate::store::{self, HostRow, PoolRow, VmFinish, VmRow};
use crate::teardown;

/// The sweeps of a batch of pools whose reconcile leases this pass just took, each in one
/// statement for the whole batch: leases past expires_at go and their VMs become DELETING
/// (deleted later in each pool's step); leases about to expire get their VM_EXPIRING_SOON
/// event; claims whose function died mid-hook have their VMs deleted, never handed out.
pub(super) async fn sweep_batch(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pools: &[PoolRef],
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let now_param = state.clock.now_param();
    let expired = {
        let conn = db.client_mut().await?;
        let tx = conn.transaction().await?;
        let expired = store::lease_expire_for_pools(&tx, pools, now_param).await?;
        tx.commit().await?;
        expired
    };
    let now = Utc::now();
    for l in &expired {
        let pref = l.pool_ref();
        state.metrics.release(&pref, "expiry", Some((now - l.claimed_at).as_seconds_f64()));
        tracing::info!(pool = %pref, lease = %l.lease_id, vm = %l.vm_id, "lease expired");
    }
    report.expired += expired.len();
    let window = state.config.reconcile.warning_window.as_secs_f64();
    report.expiry_warnings +=
        store::lease_warn_expiring_for_pools(db.client().await?, pools, window, now_param).await?;

    let after = state.config.hooks.claim_abandon_after.as_secs_f64();
    for vm in store::vm_recover_abandoned_claims(db.client().await?, pools, after, now_param).await? {
        tracing::warn!(pool = %vm.pool_ref(), vm = %vm.id, "claim abandoned mid pre-lease hook; deleting the VM");
    }
    Ok(())
}

/// Deletes a DELETING VM in flintlock and removes its rows; on failure it stays DELETING
/// and backs off.
pub(super) async fn delete_vm(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    // The teardown checks out its own connection once flintlock answered.
    let teardown = teardown::finish_vm_delete(&state.flintlock, &state.db, vm, host);
    let Some(finished) = db.released(pass.on_host(&vm.flintlock_host, teardown)).await else {
        report.skipped += 1;
        return Ok(());
    };
    match finished {
        Ok(VmFinish::Removed { lease, .. }) => {
            report.deleted += 1;
            if let Some(l) = lease {
                // A release whose flintlock delete failed earlier, finished here.
                let held = (Utc::now() - l.claimed_at).as_seconds_f64();
                state.metrics.release(&l.pool_ref(), "api", Some(held));
            }
            Ok(())
        }
        Ok(VmFinish::Gone) => Ok(()),
        Err(e) => {
            // An unreachable host was marked sick by `on_host`.
            tracing::warn!(vm = %vm.id, error = %e, "delete failed; backing off");
            pass.backoff(db, &vm.id).await
        }
    }
}

/// A pool whose size went down: its AVAILABLE VMs beyond what the strategy keeps become
/// DELETING (deleted in flintlock by the next pass). `allowance`: VMs a rollout keeps above
/// the target meanwhile (its surge), which are not surplus.
pub(super) async fn shed_surplus(
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    counts: VmCounts,
    allowance: i64,
) -> Result<(), ReconcileError> {
    let size = i32::try_from(i64::from(pool.target_size()) + allowance).unwrap_or(i32::MAX);
    let extra = surplus(pool.strategy, size, counts);
    if extra > 0 {
        let pref = pool.pool_ref();
        let n = store::vm_mark_surplus(db.client().await?, &pref, extra).await?;
        tracing::info!(pool = %pref, n, size = pool.target_size(), "pool shrank: surplus VMs marked DELETING");
    }
    Ok(())
}

/// How many stragglers of deleted pools one statement takes: each is deferred 30 s when
/// taken, so a batch is never larger than the cleanup gets through (it took 500 and, past the
/// deadline, deleted none of them, every pass: issue 23 finding 4).
const STRAGGLER_BATCH: i64 = 32;

/// DELETING VMs of pools that no longer exist: nobody holds their pool lease, so they are
/// taken in small batches with SKIP LOCKED, and each batch deleted side by side (each host's
/// calls bounded by its slots, `Pass::on_host`), until none is left or the cleanup's budget
/// is spent.
pub(super) async fn finish_deleted_pools(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    let mut db = StepConn::new(&pass.state.db);
    let mut hosts = None;
    while !pass.past_cleanup_deadline() {
        let batch = match db.client().await {
            Ok(c) => store::vm_take_orphaned_deletions(c, STRAGGLER_BATCH).await.map_err(ReconcileError::from),
            Err(e) => Err(e),
        };
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                report.errors.push(format!("taking deletions: {e}"));
                return report;
            }
        };
        if batch.is_empty() {
            return report;
        }
        // Taken, they wait 30 s for a retry (`vm_take_orphaned_deletions`) if this fails.
        if hosts.is_none() {
            match hosts_by_name(&mut db).await {
                Ok(h) => hosts = Some(h),
                Err(e) => {
                    report.errors.push(format!("loading hosts: {e}"));
                    return report;
                }
            }
        }
        let hosts = hosts.as_ref().expect("loaded above");
        db.release();
        let mut deletes = Vec::with_capacity(batch.len());
        for vm in &batch {
            deletes.push(async {
                let mut db = StepConn::new(&pass.state.db);
                let mut r = PassReport::default();
                if let Err(e) = delete_vm(pass, &mut db, vm, hosts.get(&vm.flintlock_host), &mut r).await {
                    r.errors.push(format!("{}: {e}", vm.id));
                }
                r
            });
        }
        for r in futures::future::join_all(deletes).await {
            report.merge(r);
        }
        if batch.len() < STRAGGLER_BATCH as usize {
            return report;
        }
    }
    report.deadline_reached = true;
    report
}
