//! The orphan scan: microVMs in this deployment's flintlock namespaces that no row accounts
//! for are deleted, one host per scan lease, each host at most once per pass.
//!
//! Never deletes a microVM it cannot attribute to this deployment: only those in a
//! namespace of this deployment (`<prefix><deployment id>-<pool namespace>`, see
//! [`crate::deployment`]) are looked at, so another deployment sharing the host, poolmgr's
//! namespaces from before deployment ids and anyone else's VMs are left alone. Never
//! deletes a microVM whose row is still being resolved (a row without a uid); flintlock is
//! listed *before* the rows are read, so a VM created meanwhile (its row committed first)
//! is never taken for an orphan. Never deletes a microVM whose uid a row on another host
//! carries: that is one flintlockd registered under two addresses, not an orphan.

use std::collections::HashMap;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use serde_json::json;

use super::conn::StepConn;
use super::{Pass, PassReport, ReconcileError};
use crate::domain::{EventType, PoolRef};
use crate::store::{self, HostRow};

/// The pool a managed VM belongs to, from its pool namespace and id (for events about
/// orphans, which have no row).
fn pool_of_orphan(pool_namespace: &str, id: &str) -> PoolRef {
    // Strip "-<26-char ULID>".
    let name = if id.len() > 27 && id.as_bytes()[id.len() - 27] == b'-' { &id[..id.len() - 27] } else { id };
    PoolRef { namespace: pool_namespace.to_owned(), name: name.to_owned() }
}

/// Deletes microVMs in this deployment's namespaces that no row accounts for: no row with
/// that id, a row on another host, or a row with another uid. Rows without a uid are still
/// being resolved and their VMs are left alone. flintlock is listed *before* the rows are
/// read, so a VM created meanwhile (its row committed first) is never mistaken for an orphan.
pub(super) async fn scan_orphans(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    let state = pass.state;
    let mut db = StepConn::new(&state.db);
    let interval = state.config.reconcile.orphan_scan_interval.as_secs_f64();
    while !pass.past_cleanup_deadline() {
        let host = match db.client().await {
            Ok(c) => store::host_take_scan(c, interval, pass.started_db).await.map_err(ReconcileError::from),
            Err(e) => Err(e),
        };
        let host = match host {
            Ok(Some(h)) => h,
            Ok(None) => break,
            Err(e) => {
                report.errors.push(format!("taking a host scan: {e}"));
                break;
            }
        };
        if let Err(e) = scan_host(pass, &mut db, &host, &mut report).await {
            report.errors.push(format!("orphan scan of {}: {e}", host.name));
        }
    }
    report
}

async fn scan_host(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    host: &HostRow,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    // A host found unreachable (or judged dead) is first asked for its ServerInfo within the
    // connect timeout: a hung host held every pass for the call's whole timeout each time its
    // scan came due, and with the pass the refill of its pools (issue 23 finding 2). One that
    // answers is then listed with the whole timeout, however slowly it lists.
    let marked = pass.is_marked_unreachable(&host.name);
    let list = async {
        if marked {
            let limit = state.config.flintlock_timeout.min(crate::flintlock::CONNECT_TIMEOUT);
            match tokio::time::timeout(limit, state.flintlock.server_info(&host.endpoint())).await {
                Ok(Err(e)) if e.is_transport() => return Err(e),
                Err(_) => {
                    return Err(crate::flintlock::FlintlockError::Unavailable {
                        host: host.name.clone(),
                        message: format!("a host found unreachable did not answer within {} ms", limit.as_millis()),
                    });
                }
                _ => {}
            }
        }
        state.flintlock.list(&host.endpoint(), "", None).await
    };
    let Some(listed) = db.released(pass.on_host_scan(&host.name, list)).await else {
        // It failed a call earlier in this pass; its next scan is due after the interval.
        report.skipped += 1;
        return Ok(());
    };
    let all = listed.map_err(|e| ReconcileError::flintlock("list", e))?;
    // Every live microVM's uid, whatever its namespace: a row's uid is unique.
    let present: Vec<String> = all
        .iter()
        .filter(|m| m.status.as_ref().is_none_or(|s| s.state != MicroVmState::Deleting as i32))
        .filter_map(|m| m.spec.as_ref().and_then(|s| s.uid.clone()))
        .collect();
    forget_lost_rows(pass, db, host, &present, report).await?;
    let managed: Vec<_> = all
        .into_iter()
        .filter_map(|m| {
            let spec = m.spec?;
            let deleting = m.status.as_ref().is_some_and(|s| s.state == MicroVmState::Deleting as i32);
            let pool_namespace = pass.deployment.pool_namespace(&spec.namespace)?.to_owned();
            (!deleting).then_some((spec, pool_namespace))
        })
        .collect();
    if managed.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = managed.iter().map(|(s, _)| s.id.clone()).collect();
    let rows: HashMap<String, (String, Option<String>)> =
        store::vm_identities(db.client().await?, &ids).await?.into_iter().map(|(id, h, uid)| (id, (h, uid))).collect();
    for (spec, pool_namespace) in managed {
        let uid = spec.uid.clone().unwrap_or_default();
        let orphan = match rows.get(&spec.id) {
            None => true,
            // The same microVM (a uid is unique) seen through another host record: one
            // flintlockd registered under two addresses. Deleting it would take the other
            // record's VM (issue 25 item 11); say so instead.
            Some((row_host, Some(row_uid))) if *row_host != host.name && *row_uid == uid => {
                tracing::warn!(
                    host = %host.name, other_host = %row_host, id = %spec.id, %uid,
                    "hosts {} and {row_host} list the same microVM: they are one flintlockd under two addresses; \
                     cordon one, drain it and remove it (one record per flintlockd)",
                    host.name
                );
                false
            }
            // Still being resolved on the other host: looked at again once it has a uid.
            Some((row_host, None)) if *row_host != host.name => false,
            Some((row_host, _)) if *row_host != host.name => true,
            Some((_, Some(row_uid))) => *row_uid != uid,
            Some((_, None)) => false,
        };
        if !orphan || uid.is_empty() {
            continue;
        }
        // The list may be stale by now: a VM released normally meanwhile (its microVM
        // deleted, then its row) looks like an orphan. Ask again (issue 23 finding 5).
        match db.released(pass.on_host_scan(&host.name, state.flintlock.get(&host.endpoint(), &uid))).await {
            Some(Ok(Some(m))) if m.status.as_ref().is_none_or(|s| s.state != MicroVmState::Deleting as i32) => {}
            Some(Ok(_)) => continue, // Gone or being deleted: somebody else's delete.
            Some(Err(e)) => {
                report.errors.push(format!("checking orphan {uid} on {}: {e}", host.name));
                continue;
            }
            None => {
                report.skipped += 1;
                continue;
            }
        }
        match db.released(pass.on_host_scan(&host.name, state.flintlock.delete(&host.endpoint(), &uid))).await {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                report.errors.push(format!("deleting orphan {uid} on {}: {e}", host.name));
                continue;
            }
            None => {
                report.skipped += 1;
                continue;
            }
        }
        let pool = pool_of_orphan(&pool_namespace, &spec.id);
        state.metrics.orphan(&pool.namespace, &pool.name, "deleted");
        report.orphans_deleted += 1;
        tracing::warn!(host = %host.name, id = %spec.id, %uid, "deleted an orphaned microVM");
        store::event_insert(
            db.client().await?,
            EventType::VmOrphanDeleted,
            &pool,
            Some(&spec.id),
            None,
            &json!({"uid": uid, "host": host.name, "flintlock_namespace": spec.namespace}),
        )
        .await?;
    }
    Ok(())
}

/// Rows without microVMs (issue 23 finding 1): a VM deleted outside poolmgr, or lost with
/// its host's reboot, must never be handed out. The rows on `host` that must name a live
/// microVM ([`store::PHASES_CHECKED_FOR_LOSS`]) and whose uid the list did not show are each
/// confirmed by a GetMicroVM (made after the rows were read, so a VM created or booted after
/// the list was taken is found) and, when flintlock does not know the uid or is deleting it,
/// removed with VM_LOST; the pool's replenishment replaces them in its next step (the event
/// makes the selection look at the pool).
async fn forget_lost_rows(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    host: &HostRow,
    present: &[String],
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let missing = store::vm_missing_on_host(db.client().await?, &host.name, present).await?;
    for (id, uid, phase) in missing {
        let Some(got) = db.released(pass.on_host_scan(&host.name, state.flintlock.get(&host.endpoint(), &uid))).await
        else {
            report.skipped += 1;
            return Ok(());
        };
        let gone = match got {
            Ok(None) => "flintlock does not know its uid",
            Ok(Some(m)) if m.status.as_ref().is_some_and(|s| s.state == MicroVmState::Deleting as i32) => {
                "flintlock is deleting it"
            }
            Ok(Some(_)) => continue, // Created or booted after the list was taken.
            Err(e) => {
                report.errors.push(format!("checking {id} ({uid}) on {}: {e}", host.name));
                continue;
            }
        };
        super::provision::forget_lost(db, &id, &host.name, &uid, phase, gone, report).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::new_vm_id;

    #[test]
    fn orphan_pool_is_derived_from_namespace_and_id() {
        let id = new_vm_id("ci-large");
        assert_eq!(pool_of_orphan("team", &id), PoolRef { namespace: "team".into(), name: "ci-large".into() });
    }
}
