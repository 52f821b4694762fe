//! Create hooks: one step per CREATE_HOOK_RUNNING VM and pass (wait for the guest agent, or
//! run the next command), and the pool's failure policy for a VM that did not become ready
//! ([`fail_vm`], which provisioning uses too).
//!
//! Never runs a command twice on purpose: progress is stored after each command, so a pass
//! that dies re-runs at most the command it was running. Never hands a VM out whose hook
//! failed: it goes DELETING or QUARANTINED, as the pool says.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::conn::StepConn;
use super::{Pass, PassReport, ReconcileError};
use crate::domain::{EventType, HookFailurePolicy, Phase};
use crate::flintlock;
use crate::store::{self, HostRow, PoolRow, VmRow};

/// One hook step for each of a pool's CREATE_HOOK_RUNNING VMs, side by side, so a slow VM
/// holds up nobody but itself. Each step takes a connection of its own, after its gRPC calls
/// (the caller holds none: see "Connections" in [`super`]).
pub(super) async fn run_create_hooks(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vms: Vec<&VmRow>,
    hosts: &HashMap<String, HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let steps = vms.into_iter().map(|vm| async {
        let mut db = StepConn::new(&pass.state.db);
        let mut r = PassReport::default();
        let res = create_hook_step(pass, &mut db, pool, vm, hosts.get(&vm.flintlock_host), &mut r).await;
        (r, res)
    });
    for (r, res) in futures::future::join_all(steps).await {
        report.merge(r);
        res?;
    }
    Ok(())
}

/// One step of a VM's create hook: wait for the guest agent (bounded overall by the guest
/// agent timeout, one probe per pass), then run the next command. Progress is stored after
/// each command, so a pass that dies re-runs at most the command it was running. The last
/// command's success makes the VM AVAILABLE.
async fn create_hook_step(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let hooks = &state.config.hooks;
    let (Some(host), Some(uid)) = (host, vm.uid.as_deref()) else {
        return fail_vm(pass, db, pool, vm, "its host is not registered", report).await;
    };
    let started = vm.hook_started_at.unwrap_or(vm.updated_at);
    let step = usize::try_from(vm.hook_step).unwrap_or(0);
    if step == 0 {
        let probe = hooks.command_timeout.min(std::time::Duration::from_secs(5));
        match db.released(state.flintlock.wait_ready(&host.endpoint(), uid, probe)).await {
            Ok(true) => {}
            Ok(false) => {
                if (pass.now() - started).to_std().unwrap_or_default() > hooks.guest_agent_timeout {
                    let why = format!("the guest agent did not answer within {:?}", hooks.guest_agent_timeout);
                    return fail_vm(pass, db, pool, vm, &why, report).await;
                }
                return pass.backoff(db, &vm.id).await;
            }
            Err(e) if e.is_transport() => {
                return transport_retry(pass, db, pool, vm, "the guest agent wait", &e, report).await;
            }
            Err(e) if e.is_not_found() => {
                let why = "the guest agent wait found no such VM";
                return super::provision::forget_lost(
                    db,
                    &vm.id,
                    &vm.flintlock_host,
                    uid,
                    Phase::CreateHookRunning,
                    why,
                    report,
                )
                .await;
            }
            Err(e) => return fail_vm(pass, db, pool, vm, &format!("guest agent: {e}"), report).await,
        }
    }
    let Some(cmd) = pool.create_commands.get(step) else {
        return hook_done(pass, db, pool, vm, started, report).await;
    };
    let outcome = db.released(state.flintlock.exec(&host.endpoint(), uid, cmd, hooks.command_timeout)).await;
    if let Err(e) = &outcome
        && e.is_transport()
    {
        return transport_retry(pass, db, pool, vm, &format!("create command {step}"), e, report).await;
    }
    if let Err(e) = &outcome
        && e.is_not_found()
    {
        let why = format!("create command {step} found no such VM");
        return super::provision::forget_lost(
            db,
            &vm.id,
            &vm.flintlock_host,
            uid,
            Phase::CreateHookRunning,
            &why,
            report,
        )
        .await;
    }
    // Sanitised and capped: the output is stored in the VM_HOOK_FAILED event.
    if let Some(why) = flintlock::hook_failure(cmd, &outcome) {
        return fail_vm(pass, db, pool, vm, &format!("create command {step} {why}"), report).await;
    }
    let next = vm.hook_step + 1;
    if usize::try_from(next).unwrap_or(0) >= pool.create_commands.len() {
        return hook_done(pass, db, pool, vm, started, report).await;
    }
    store::vm_set_hook_step(db.client().await?, &vm.id, next).await?;
    Ok(())
}

/// A hook step whose call failed in transit (issue 23 finding 3): the host could not be
/// reached, the connection broke, the answer did not come. That is not the VM failing its
/// hook, so the step is retried on a later pass (backing off), the command included: a
/// flintlockd restart mid-hook no longer quarantines every VM in its hooks. Bounded: a step
/// that could not reach its host for longer than the guest agent timeout (60 s; a host
/// unreachable that long is judged dead first and its VMs retired, `POOLMGR_HOST_DEAD_SECONDS`)
/// gets the pool's policy after all, so a VM never sits in CREATE_HOOK_RUNNING for ever.
async fn transport_retry(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    what: &str,
    e: &flintlock::FlintlockError,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let hooks = &pass.state.config.hooks;
    // `updated_at`: when this step began (the phase change, or the last command's success).
    let waited = (pass.now() - vm.updated_at).to_std().unwrap_or_default();
    let budget = hooks.guest_agent_timeout.max(hooks.command_timeout);
    if waited > budget {
        let why = format!("{what} could not reach its host for {} s: {e}", waited.as_secs());
        return fail_vm(pass, db, pool, vm, &why, report).await;
    }
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, error = %e, "{what} failed in transit; retrying the step later");
    report.errors.push(format!("{}: {what}: {e} (retried)", vm.id));
    pass.backoff(db, &vm.id).await
}

async fn hook_done(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    started: DateTime<Utc>,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let secs = (Utc::now() - vm.created_at).as_seconds_f64();
    let payload = json!({"uid": vm.uid, "create_commands": pool.create_commands.len(), "provision_seconds": secs, "revision": vm.revision});
    let moved = store::vm_transition(
        db.client().await?,
        &vm.id,
        Phase::CreateHookRunning,
        Phase::Available,
        None,
        Some((EventType::VmAvailable, &payload)),
    )
    .await?;
    if moved {
        state.metrics.provisioned(&pool.namespace, &pool.name, secs);
        state.metrics.hook_succeeded(&pool.namespace, &pool.name, "create", (Utc::now() - started).as_seconds_f64());
        report.available += 1;
    }
    Ok(())
}

/// The pool's failure policy for a VM that did not become ready. DELETE_AND_REPLACE goes
/// through DELETING (so a failing flintlock delete cannot orphan the microVM); QUARANTINE
/// keeps it for inspection.
pub(super) async fn fail_vm(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    reason: &str,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let state = pass.state;
    let to = match pool.hook_failure_policy {
        HookFailurePolicy::DeleteAndReplace => Phase::Deleting,
        HookFailurePolicy::Quarantine => Phase::Quarantined,
    };
    let payload =
        json!({"hook": "create", "reason": reason, "policy": pool.hook_failure_policy, "revision": vm.revision});
    let moved =
        store::vm_transition(db.client().await?, &vm.id, vm.phase, to, None, Some((EventType::VmHookFailed, &payload)))
            .await?;
    if !moved {
        return Ok(());
    }
    state.metrics.hook_failed(&pool.namespace, &pool.name, "create");
    report.failed += 1;
    tracing::warn!(vm = %vm.id, %reason, policy = %pool.hook_failure_policy, "VM failed to provision");
    Ok(())
}
