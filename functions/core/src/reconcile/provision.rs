//! Provisioning steps: placing and creating new VMs, adopting a VM whose create reply was
//! lost, and polling PROVISIONING VMs until flintlock says CREATED.
//!
//! Never CreateMicroVM without a committed row naming the VM (the placement inserts it
//! first), and never create again for a row without a uid before listing flintlock by its id.
//! How many VMs to create is [`super::strategy`]'s answer, not decided here.

use std::collections::HashMap;

use chrono::Utc;
use flintlock_proto::types::micro_vm_status::MicroVmState;
use serde_json::json;

use super::conn::StepConn;
use super::hooks::fail_vm;
use super::strategy::{quarantine_full, strategy_wants, wants_within};
use super::{Pass, PassReport, ReconcileError};
use crate::domain::VmCounts;
use crate::domain::{EventType, Phase};
use crate::flintlock::FlintlockError;
use crate::store::{self, HostRow, PoolRow, VmRow};

/// A new VM id: `<pool name>-<lowercase ULID>`, unique across pools and time.
pub fn new_vm_id(pool: &str) -> String {
    format!("{pool}-{}", ulid::Ulid::generate().to_string().to_lowercase())
}

fn nics_json(vm: &flintlock_proto::types::MicroVm) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    if let Some(status) = &vm.status {
        let mut keys: Vec<_> = status.network_interfaces.keys().collect();
        keys.sort();
        for k in keys {
            let n = &status.network_interfaces[k];
            out.insert(
                k.clone(),
                json!({"host_device_name": n.host_device_name, "index": n.index, "mac_address": n.mac_address}),
            );
        }
    }
    serde_json::Value::Object(out)
}

/// Why a pool's quarantined VMs stop its replenishment (`POOL_SIZE_BELOW_TARGET`'s reason).
pub(super) const BELOW_TARGET_QUARANTINE_FULL: &str = "quarantined VMs fill the pool (quarantined >= size): \
     replenishment stopped until they are discarded (DELETE /v1/vms/{id}, poolmgrctl vm delete) or the size is raised";
/// Why a pool gets no new VM while every host it names is cordoned, unregistered or failing.
const BELOW_TARGET_NO_HOST: &str = "no eligible flintlock host";

/// Records why the pool is held below its target (`None`: nothing holds it back); the store
/// writes POOL_SIZE_BELOW_TARGET only when the reason changes, not on every pass.
async fn below_target(
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    reason: Option<&str>,
    counts: VmCounts,
) -> Result<(), ReconcileError> {
    if pool.below_target_reason.as_deref() == reason {
        return Ok(()); // As recorded (read with the pool's lease): spare the round trip.
    }
    let payload = json!({"size": pool.target_size(), "available": counts.available, "quarantined": counts.quarantined});
    if store::pool_set_below_target(db.client().await?, &pool.pool_ref(), reason, &payload).await? {
        tracing::warn!(pool = %pool.pool_ref(), reason, "pool held below its target size");
    }
    Ok(())
}

/// Tops the pool up: as many new VMs as its strategy asks for (`counts` taken before this
/// pass's VM steps, which run beside this), at most `max_creates_per_pool`: all placed first
/// (one statement each, so each placement sees the last), then created side by side, each
/// waiting for a slot of its host (`Pass::on_host`), so a pool filling on several hosts is
/// limited by the hosts, not by one create after another. Nothing while its quarantined VMs
/// fill it (the bound of [`quarantine_full`]).
/// Placement skips the hosts that are sick in this pass and those an earlier pass found
/// unreachable a moment ago (`hosts.unreachable_until`), since this runs before the VM steps
/// could find out.
pub(super) async fn replenish(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    counts: VmCounts,
    rollout_extra: i64,
    hosts: &HashMap<String, HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let pref = pool.pool_ref();
    // The ceiling counts every VM of the pool, whatever the strategy, a rollout's surge too.
    let ceiling = pool.autoscaling.as_ref().map(|a| a.max);
    let wants = strategy_wants(pool.strategy, pool.target_size(), pool.min_size, counts) + rollout_extra;
    let mut want = wants_within(wants, ceiling, counts);
    if want > 0 && quarantine_full(pool.target_size(), counts) {
        tracing::debug!(pool = %pref, quarantined = counts.quarantined, "replenishment held back by quarantined VMs");
        return below_target(db, pool, Some(BELOW_TARGET_QUARANTINE_FULL), counts).await;
    }
    if want > 0
        && let Err(why) = pass.state.config.spec_policy.check(&pool.microvm_template)
    {
        // Stored before the policy was tightened: no VM of it is created until the spec or
        // the policy changes (the refusal is the pool's POOL_SIZE_BELOW_TARGET reason).
        tracing::warn!(pool = %pref, refused = %why, "no VM created: the pool's spec is outside the spec policy");
        return below_target(db, pool, Some(&why), counts).await;
    }
    if pool.microvm_template.has_static_network() {
        // A static MAC or address may exist once: only when the pool has no VM row at all.
        want = if counts.rows == 0 { want.min(1) } else { 0 };
    }
    let want = want.min(pass.state.config.reconcile.max_creates_per_pool as i64);
    let mut placed = Vec::new();
    let mut held_back = None;
    for _ in 0..want {
        if pass.past_deadline() {
            report.deadline_reached = true;
            break;
        }
        let id = new_vm_id(&pool.name);
        match store::vm_place_and_insert(db.client().await?, &pref, &id, &pass.sick_list()).await? {
            Some(vm) => placed.push(vm),
            None => {
                tracing::info!(pool = %pref, "no eligible flintlock host: every host is cordoned, unregistered or failing");
                held_back = Some(BELOW_TARGET_NO_HOST);
                break;
            }
        }
    }
    // Only what was placed: a pass that could place nothing (no eligible host) writes no
    // POOL_REPLENISHING, every pass, only POOL_SIZE_BELOW_TARGET once (issue 23 finding 5).
    if !placed.is_empty() {
        store::event_insert(
            db.client().await?,
            EventType::PoolReplenishing,
            &pref,
            None,
            None,
            &json!({"creating": placed.len(), "available": counts.available, "size": pool.target_size()}),
        )
        .await?;
    }
    // Each create checks out its own connection once flintlock answered.
    db.release();
    let mut creates = Vec::with_capacity(placed.len());
    for vm in &placed {
        creates.push(create_placed(pass, pool, vm, hosts.get(&vm.flintlock_host)));
    }
    let mut result = Ok(());
    for (r, res) in futures::future::join_all(creates).await {
        report.merge(r);
        result = result.and(res);
    }
    result?;
    if report.deadline_reached && held_back.is_none() {
        return Ok(()); // The next pass goes on; what held the pool back is unknown yet.
    }
    // Placed what it wanted (or wanted nothing): nothing holds the pool back now.
    below_target(db, pool, held_back, counts).await
}

/// [`create_vm`] on a connection of its own, for the creates of a pool running side by side.
async fn create_placed(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
) -> (PassReport, Result<(), ReconcileError>) {
    let mut report = PassReport::default();
    let mut db = StepConn::new(&pass.state.db);
    let res = create_vm(pass, &mut db, pool, vm, host, &mut report).await;
    (report, res)
}

/// A failed call for one VM, reported; an unreachable host was marked sick by `Pass::on_host`.
fn flintlock_failed(report: &mut PassReport, vm: &VmRow, what: &str, e: &FlintlockError) {
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, error = %e, "{what} failed; backing off");
    report.errors.push(format!("{}: {what}: {e}", vm.id));
}

/// CreateMicroVM for a committed intent row, storing the uid it answers with.
async fn create_vm(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let Some(host) = host else {
        return drop_intent(db, vm, "its host is not registered").await;
    };
    let spec = pool.microvm_template.to_spec(&vm.id, &pass.deployment.namespace(&pool.namespace));
    let Some(created) = db.released(pass.on_host(&host.name, state.flintlock.create(&host.endpoint(), spec))).await
    else {
        // The host turned sick since the placement: the row stays without a uid, and a later
        // pass looks the id up before creating.
        report.skipped += 1;
        return Ok(());
    };
    match created {
        Ok(m) => {
            let uid = m.spec.as_ref().and_then(|s| s.uid.clone()).unwrap_or_default();
            if uid.is_empty() {
                report.errors.push(format!("{}: CreateMicroVM answered without a uid", vm.id));
                return pass.backoff(db, &vm.id).await;
            }
            store::vm_set_uid(db.client().await?, &vm.id, &uid, EventType::VmProvisioned, Some(pool.revision)).await?;
            pass.count_create(&host.name);
            report.created += 1;
            Ok(())
        }
        Err(e) => {
            // The create may have reached flintlock (a lost reply): the row stays without a
            // uid and the next pass looks the id up before creating again.
            flintlock_failed(report, vm, "CreateMicroVM", &e);
            give_up_or_backoff(pass, db, vm).await
        }
    }
}

async fn give_up_or_backoff(pass: &Pass<'_>, db: &mut StepConn<'_>, vm: &VmRow) -> Result<(), ReconcileError> {
    if vm.attempts + 1 >= pass.state.config.reconcile.max_create_attempts {
        drop_intent(db, vm, "its host kept failing").await
    } else {
        pass.backoff(db, &vm.id).await
    }
}

async fn drop_intent(db: &mut StepConn<'_>, vm: &VmRow, why: &str) -> Result<(), ReconcileError> {
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, "dropping provisioning intent: {why}; a replacement is placed elsewhere");
    store::vm_delete_intent(db.client().await?, &vm.id).await?;
    Ok(())
}

/// A row without a uid: its create was never answered. Adopt the VM flintlock has under our
/// id, or create it now.
pub(super) async fn create_or_adopt(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    hosts: &HashMap<String, HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let Some(host) = hosts.get(&vm.flintlock_host) else {
        return drop_intent(db, vm, "its host is not registered").await;
    };
    // By id in every namespace: the VM is in this deployment's namespace of the pool, or in
    // the one poolmgr used before deployment ids (a create sent before that upgrade).
    let Some(listed) =
        db.released(pass.on_host(&host.name, state.flintlock.list(&host.endpoint(), "", Some(&vm.id)))).await
    else {
        report.skipped += 1;
        return Ok(());
    };
    match listed {
        Ok(mut found) => {
            found.retain(|m| {
                m.status.as_ref().is_none_or(|s| s.state != MicroVmState::Deleting as i32)
                    && m.spec
                        .as_ref()
                        .is_some_and(|s| s.id == vm.id && pass.deployment.holds(&s.namespace, &pool.namespace))
            });
            // Several (a duplicate create): adopt the oldest uid; the orphan scan deletes the rest.
            found.sort_by_key(|m| m.spec.as_ref().and_then(|s| s.uid.clone()));
            match found.first().and_then(|m| m.spec.as_ref()).and_then(|s| s.uid.clone()) {
                Some(uid) => {
                    if store::vm_set_uid(db.client().await?, &vm.id, &uid, EventType::VmAdopted, None).await? {
                        state.metrics.orphan(&pool.namespace, &pool.name, "adopted");
                        report.adopted += 1;
                        tracing::info!(vm = %vm.id, %uid, "adopted a microVM whose create reply was lost");
                    }
                    Ok(())
                }
                None => create_vm(pass, db, pool, vm, Some(host), report).await,
            }
        }
        Err(e) => {
            flintlock_failed(report, vm, "ListMicroVMs", &e);
            give_up_or_backoff(pass, db, vm).await
        }
    }
}

/// A created VM: look at its flintlock state and move it one step.
pub(super) async fn poll_provisioning(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let Some(host) = host else {
        return fail_vm(pass, db, pool, vm, "its host is not registered", report).await;
    };
    let uid = vm.uid.as_deref().unwrap_or_default();
    let Some(got) = db.released(pass.on_host(&host.name, state.flintlock.get(&host.endpoint(), uid))).await else {
        report.skipped += 1;
        return Ok(());
    };
    let m = match got {
        Ok(m) => m,
        Err(e) => {
            flintlock_failed(report, vm, "GetMicroVM", &e);
            // A host that answers with errors does not stop the provision timeout (one that
            // cannot be reached is judged dead instead, and its rows retired).
            if !e.is_transport() && past_provision_timeout(pass, vm) {
                let why = format!("the microVM stayed unreadable past the provision timeout: {e}");
                return fail_vm(pass, db, pool, vm, &why, report).await;
            }
            return pass.backoff(db, &vm.id).await;
        }
    };
    let Some(m) = m else {
        // Not the VM failing to boot: its microVM is gone (a host rebooted, a delete behind
        // poolmgr's back). No policy, nothing to quarantine: the row goes, VM_LOST (found by
        // the fault campaign: it quarantined VMs that did not exist).
        let why = "flintlock does not know its uid";
        return forget_lost(db, &vm.id, &vm.flintlock_host, uid, Phase::Provisioning, why, report).await;
    };
    let st = m.status.as_ref().map(|s| s.state).unwrap_or(MicroVmState::Pending as i32);
    if st == MicroVmState::Created as i32 {
        let nics = nics_json(&m);
        let c = db.client().await?;
        if !pool.create_commands.is_empty() {
            // Create hooks run on the next passes, one step at a time.
            store::vm_transition(c, &vm.id, Phase::Provisioning, Phase::CreateHookRunning, Some(&nics), None).await?;
            return Ok(());
        }
        let secs = (Utc::now() - vm.created_at).as_seconds_f64();
        if store::vm_transition(
            c,
            &vm.id,
            Phase::Provisioning,
            Phase::Available,
            Some(&nics),
            // `provision_seconds`: what the autoscaler measures the pool's provisioning by.
            Some((EventType::VmAvailable, &json!({"uid": uid, "provision_seconds": secs, "revision": vm.revision}))),
        )
        .await?
        {
            state.metrics.provisioned(&pool.namespace, &pool.name, secs);
            report.available += 1;
        }
        Ok(())
    } else if st == MicroVmState::Failed as i32 {
        fail_vm(pass, db, pool, vm, "flintlock reports the microVM FAILED", report).await
    } else if st == MicroVmState::Deleting as i32 {
        fail_vm(pass, db, pool, vm, "the microVM is being deleted in flintlock", report).await
    } else if past_provision_timeout(pass, vm) {
        fail_vm(pass, db, pool, vm, "the microVM stayed PENDING past the provision timeout", report).await
    } else {
        Ok(()) // Still booting: the next pass looks again.
    }
}

fn past_provision_timeout(pass: &Pass<'_>, vm: &VmRow) -> bool {
    (pass.now() - vm.created_at).to_std().unwrap_or_default() > pass.state.config.reconcile.provision_timeout
}

/// Removes a VM row whose microVM flintlock no longer has, with VM_LOST (no hook-failure
/// policy: there is nothing left to inspect or delete); the pool's next step replaces it.
pub(super) async fn forget_lost(
    db: &mut StepConn<'_>,
    vm_id: &str,
    host: &str,
    uid: &str,
    phase: Phase,
    why: &str,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    if store::vm_forget_lost(db.client().await?, vm_id, uid, phase, host, why).await? {
        report.lost += 1;
        tracing::warn!(vm = %vm_id, %host, %uid, %phase, "a VM's microVM is gone from flintlock ({why}): row removed, the pool replaces it");
    }
    Ok(())
}
