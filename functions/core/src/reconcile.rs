//! The reconcile pass: keeps every pool at the size its strategy asks for, through flintlock.
//!
//! One call of [`run_pass`] is one pass; the `reconcile` Lambda (EventBridge schedule), the
//! `poolmgr-local` ticker and the tests all call it. A pass is idempotent and resumable: it
//! advances every VM at most one step and never waits for a VM to boot, so the next pass
//! picks up where it stopped. Overlapping passes are safe: a pass works on a pool only while
//! it holds that pool's reconcile lease (a row, never an advisory lock).
//!
//! Never orphan a microVM: the VM row (PROVISIONING, our id, no uid) is committed *before*
//! CreateMicroVM, so every microVM poolmgr creates has a row naming it; a row whose create
//! reply was lost is resolved by listing flintlock by id (adopt) before creating again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use chrono::{DateTime, Utc};
use flintlock_proto::types::micro_vm_status::MicroVmState;
use serde::Serialize;
use serde_json::json;

use crate::app::AppState;
use crate::domain::{EventType, HookFailurePolicy, Phase, PoolRef, Strategy};
use crate::error::ApiError;
use crate::flintlock::FlintlockError;
use crate::store::{self, HostRow, PoolRow, StoreError, VmFinish, VmRow};

/// What one pass did, for logs, the Lambda's answer and tests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct PassReport {
    pub pools: usize,
    pub created: usize,
    pub adopted: usize,
    pub available: usize,
    pub deleted: usize,
    pub expired: usize,
    pub expiry_warnings: u64,
    pub failed: usize,
    pub orphans_deleted: usize,
    /// Steps that failed and will be retried by a later pass.
    pub errors: Vec<String>,
    /// The deadline stopped the pass before every pool was visited.
    pub deadline_reached: bool,
    pub duration_ms: u128,
}

impl PassReport {
    fn merge(&mut self, o: PassReport) {
        self.pools += o.pools;
        self.created += o.created;
        self.adopted += o.adopted;
        self.available += o.available;
        self.deleted += o.deleted;
        self.expired += o.expired;
        self.expiry_warnings += o.expiry_warnings;
        self.failed += o.failed;
        self.orphans_deleted += o.orphans_deleted;
        self.errors.extend(o.errors);
        self.deadline_reached |= o.deadline_reached;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// The database could not be reached: retrying the pass later can help.
    #[error("reconcile pass could not start (retry later): {0}")]
    Retryable(String),
}

/// VM counts of a pool, as the strategies count them (reference-behaviour §4.2).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub available: i64,
    /// PRE_LEASE_HOOK_RUNNING, and LEASED without a committed lease row.
    pub claiming: i64,
    pub leased: i64,
    /// PROVISIONING and CREATE_HOOK_RUNNING.
    pub provisioning: i64,
    pub quarantined: i64,
    /// Every row in any phase.
    pub rows: i64,
}

impl Counts {
    pub fn of(vms: &[(VmRow, bool)]) -> Counts {
        let mut c = Counts { rows: vms.len() as i64, ..Counts::default() };
        for (vm, has_lease) in vms {
            match vm.phase {
                Phase::Available => c.available += 1,
                Phase::PreLeaseHookRunning => c.claiming += 1,
                Phase::Leased if !has_lease => c.claiming += 1,
                Phase::Leased => c.leased += 1,
                Phase::Provisioning | Phase::CreateHookRunning => c.provisioning += 1,
                Phase::Quarantined => c.quarantined += 1,
                Phase::Deleting | Phase::Failed => {}
            }
        }
        c
    }
}

/// How many VMs a pool needs now. DELETING, FAILED and QUARANTINED VMs never count, so a
/// replacement starts before an old VM's delete finishes. A fresh pool is topped up to
/// `size` by every strategy (MIN_SIZE_THRESHOLD: because 0 available is below min_size).
pub fn desired_new(strategy: Strategy, size: i32, min_size: Option<i32>, c: Counts) -> i64 {
    let size = i64::from(size);
    match strategy {
        // Leased VMs are extra: the pool keeps `size` ready or coming.
        Strategy::ImmediateOnLease => (size - (c.available + c.claiming + c.provisioning)).max(0),
        Strategy::MinSizeThreshold => {
            if c.available >= i64::from(min_size.unwrap_or(1)) {
                0
            } else {
                (size - (c.available + c.claiming + c.leased + c.provisioning)).max(0)
            }
        }
        // Leased VMs count: a VM is replaced only once it is gone.
        Strategy::ReplaceOnDelete => (size - (c.available + c.claiming + c.leased + c.provisioning)).max(0),
    }
}

/// How many AVAILABLE VMs a pool has beyond what its strategy keeps (after its size went
/// down). Only AVAILABLE VMs are ever removed for this; leased ones wind down by release.
pub fn surplus(strategy: Strategy, size: i32, c: Counts) -> i64 {
    let kept = match strategy {
        Strategy::ImmediateOnLease => c.available + c.claiming + c.provisioning,
        Strategy::MinSizeThreshold | Strategy::ReplaceOnDelete => c.available + c.claiming + c.leased + c.provisioning,
    };
    (kept - i64::from(size)).clamp(0, c.available)
}

/// A new VM id: `<pool name>-<lowercase ULID>`, unique across pools and time.
pub fn new_vm_id(pool: &str) -> String {
    format!("{pool}-{}", ulid::Ulid::new().to_string().to_lowercase())
}

/// The pool a managed VM belongs to, from its flintlock namespace and id (for events about
/// orphans, which have no row).
fn pool_of_orphan(prefix: &str, namespace: &str, id: &str) -> PoolRef {
    let ns = namespace.strip_prefix(prefix).unwrap_or(namespace);
    // Strip "-<26-char ULID>".
    let name = if id.len() > 27 && id.as_bytes()[id.len() - 27] == b'-' { &id[..id.len() - 27] } else { id };
    PoolRef { namespace: ns.to_owned(), name: name.to_owned() }
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

struct Pass<'a> {
    state: &'a AppState,
    owner: String,
    started_db: DateTime<Utc>,
    deadline: Instant,
    /// Hosts that failed a call during this pass: no new placements on them this pass.
    sick_hosts: Mutex<HashSet<String>>,
}

impl Pass<'_> {
    fn past_deadline(&self) -> bool {
        Instant::now() >= self.deadline
    }

    fn sick(&self, host: &str) {
        self.sick_hosts.lock().expect("sick hosts").insert(host.to_owned());
    }

    fn sick_list(&self) -> Vec<String> {
        self.sick_hosts.lock().expect("sick hosts").iter().cloned().collect()
    }

    async fn backoff(&self, vm_id: &str) -> Result<(), StoreError> {
        let rc = &self.state.config.reconcile;
        let conn = self.state.db.get().await?;
        store::vm_backoff(&**conn, vm_id, rc.backoff_base.as_secs_f64(), rc.backoff_cap.as_secs_f64()).await
    }
}

/// Runs one reconcile pass over every pool whose lease it can take, then the cross-pool
/// work (stragglers of deleted pools, orphan scans).
pub async fn run_pass(state: &AppState) -> Result<PassReport, PassError> {
    let t0 = Instant::now();
    let rc = &state.config.reconcile;
    let started_db: DateTime<Utc> = {
        let conn = state.db.get().await.map_err(|e| PassError::Retryable(e.to_string()))?;
        // query_typed: an unnamed statement, safe through a transaction-mode pooler.
        conn.query_typed_one("SELECT now()", &[]).await.map_err(|e| PassError::Retryable(e.to_string()))?.get(0)
    };
    let pass = Arc::new(Pass {
        state,
        owner: format!("pass-{}", ulid::Ulid::new()),
        started_db,
        deadline: t0 + rc.deadline,
        sick_hosts: Mutex::default(),
    });

    let workers = (0..rc.concurrency).map(|_| pool_worker(&pass));
    let mut report = PassReport::default();
    for r in futures::future::join_all(workers).await {
        report.merge(r);
    }
    report.merge(finish_deleted_pools(&pass).await);
    report.merge(scan_orphans(&pass).await);
    report.deadline_reached |= pass.past_deadline();
    report.duration_ms = t0.elapsed().as_millis();
    tracing::info!(
        pools = report.pools,
        created = report.created,
        available = report.available,
        deleted = report.deleted,
        expired = report.expired,
        errors = report.errors.len(),
        duration_ms = report.duration_ms as u64,
        "reconcile pass done"
    );
    Ok(report)
}

/// Takes pool leases one at a time until none is left for this pass or the deadline.
async fn pool_worker(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    // The lease outlives the deadline plus a hook command started just before it, so a pool
    // is never worked past its lease.
    let cfg = &pass.state.config;
    let lease_secs = cfg.reconcile.deadline.as_secs_f64() + cfg.hooks.command_timeout.as_secs_f64() + 30.0;
    while !pass.past_deadline() {
        let pool = match pass.state.db.get().await {
            Ok(conn) => store::pool_take_reconcile_lease(&**conn, &pass.owner, pass.started_db, lease_secs).await,
            Err(e) => Err(e.into()),
        };
        let pool = match pool {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(e) => {
                report.errors.push(format!("taking a pool lease: {e}"));
                break;
            }
        };
        let pref = pool.pool_ref();
        report.pools += 1;
        if let Err(e) = reconcile_pool(pass, &pool, &mut report).await {
            tracing::warn!(pool = %pref, error = %e, "pool reconcile step failed; the next pass retries");
            report.errors.push(format!("{pref}: {e}"));
        }
        release_reconcile_lease(pass, &pref, &mut report).await;
    }
    report
}

/// Gives a pool's reconcile lease back, retrying until the pass deadline. A lease left behind
/// keeps every pass away from the pool for the whole lease (deadline + hook timeout + 30 s,
/// close to two minutes by default), so a database blip of a few seconds that failed the
/// pool's step must not also leave the lease: that stalled replenishment long after the
/// database was back (found by scripts/chaos.sh, scenario pg-restart).
async fn release_reconcile_lease(pass: &Pass<'_>, pref: &PoolRef, report: &mut PassReport) {
    let mut delay = std::time::Duration::from_millis(100);
    loop {
        let released = match pass.state.db.get().await {
            Ok(conn) => store::pool_release_reconcile_lease(&**conn, pref, &pass.owner).await,
            Err(e) => Err(e.into()),
        };
        match released {
            Ok(()) => return,
            Err(e) if pass.past_deadline() => {
                report.errors.push(format!("{pref}: releasing the reconcile lease: {e}; it expires by itself"));
                return;
            }
            Err(e) => {
                tracing::warn!(pool = %pref, error = %e, retry_in_ms = delay.as_millis() as u64, "cannot release the reconcile lease yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(2));
            }
        }
    }
}

async fn hosts_by_name(state: &AppState) -> Result<HashMap<String, HostRow>, StoreError> {
    let conn = state.db.get().await?;
    Ok(store::host_list(&**conn).await?.into_iter().map(|(h, _)| (h.name.clone(), h)).collect())
}

fn due(vm: &VmRow, now: DateTime<Utc>) -> bool {
    vm.next_attempt_at.is_none_or(|t| t <= now)
}

/// One pool, one step per VM: expiry, deletions, provisioning progress, then new VMs.
async fn reconcile_pool(pass: &Pass<'_>, pool: &PoolRow, report: &mut PassReport) -> Result<(), StoreError> {
    let state = pass.state;
    let pref = pool.pool_ref();
    let rc = &state.config.reconcile;

    // Expiry: leases past expires_at go, their VMs become DELETING (deleted just below).
    {
        let conn = state.db.get().await?;
        let expired = store::lease_expire_for_pool(&**conn, &pref).await?;
        let now = Utc::now();
        for l in &expired {
            state.metrics.release(&pref, "expiry", Some((now - l.claimed_at).as_seconds_f64()));
            tracing::info!(pool = %pref, lease = %l.lease_id, vm = %l.vm_id, "lease expired");
        }
        report.expired += expired.len();
        report.expiry_warnings +=
            store::lease_warn_expiring_for_pool(&**conn, &pref, rc.warning_window.as_secs_f64()).await?;
    }

    // Claims whose function died mid-hook: their VMs are deleted, never handed out.
    {
        let conn = state.db.get().await?;
        let abandoned =
            store::vm_recover_abandoned_claims(&**conn, &pref, state.config.hooks.claim_abandon_after.as_secs_f64())
                .await?;
        for id in &abandoned {
            tracing::warn!(pool = %pref, vm = %id, "claim abandoned mid pre-lease hook; deleting the VM");
        }
    }

    let hosts = hosts_by_name(state).await?;
    let vms = {
        let conn = state.db.get().await?;
        store::vm_list_for_pool(&**conn, &pref).await?
    };
    let now = Utc::now();
    let mut hook_vms = vec![];
    for (vm, _) in &vms {
        if pass.past_deadline() {
            report.deadline_reached = true;
            return Ok(());
        }
        if !due(vm, now) {
            continue;
        }
        match vm.phase {
            Phase::Deleting => delete_vm(pass, vm, hosts.get(&vm.flintlock_host), report).await?,
            Phase::Provisioning if vm.uid.is_none() => create_or_adopt(pass, pool, vm, &hosts, report).await?,
            Phase::Provisioning => poll_provisioning(pass, pool, vm, hosts.get(&vm.flintlock_host), report).await?,
            Phase::CreateHookRunning => hook_vms.push(vm),
            _ => {}
        }
    }
    // Create hooks: one step per VM, the pool's VMs side by side, so a slow VM holds up
    // nobody but itself.
    let steps = hook_vms.into_iter().map(|vm| async {
        let mut r = PassReport::default();
        let res = create_hook_step(pass, pool, vm, hosts.get(&vm.flintlock_host), &mut r).await;
        (r, res)
    });
    for (r, res) in futures::future::join_all(steps).await {
        report.merge(r);
        res?;
    }

    // Replenish, counting what is there after the steps above.
    let vms = {
        let conn = state.db.get().await?;
        store::vm_list_for_pool(&**conn, &pref).await?
    };
    let counts = Counts::of(&vms);
    let extra = surplus(pool.strategy, pool.size, counts);
    if extra > 0 {
        let conn = state.db.get().await?;
        let n = store::vm_mark_surplus(&**conn, &pref, extra).await?;
        tracing::info!(pool = %pref, n, size = pool.size, "pool shrank: surplus VMs marked DELETING");
        // Deleted in flintlock by the next pass.
    }
    let mut want = desired_new(pool.strategy, pool.size, pool.min_size, counts);
    if pool.microvm_template.has_static_network() {
        // A static MAC or address may exist once: only when the pool has no VM row at all.
        want = if counts.rows == 0 { want.min(1) } else { 0 };
    }
    let want = want.min(rc.max_creates_per_pool as i64);
    if want > 0 {
        let conn = state.db.get().await?;
        store::event_insert(
            &**conn,
            EventType::PoolReplenishing,
            &pref,
            None,
            None,
            &json!({"creating": want, "available": counts.available, "size": pool.size}),
        )
        .await?;
    }
    for _ in 0..want {
        if pass.past_deadline() {
            report.deadline_reached = true;
            break;
        }
        let id = new_vm_id(&pool.name);
        let placed = {
            let conn = state.db.get().await?;
            store::vm_place_and_insert(&**conn, &pref, &id, &pass.sick_list()).await?
        };
        let Some(vm) = placed else {
            tracing::info!(pool = %pref, "no eligible flintlock host: every host is cordoned, unregistered or failing");
            let conn = state.db.get().await?;
            store::event_insert(
                &**conn,
                EventType::PoolSizeBelowTarget,
                &pref,
                None,
                None,
                &json!({"reason": "no eligible flintlock host", "size": pool.size}),
            )
            .await?;
            break;
        };
        create_vm(pass, pool, &vm, hosts.get(&vm.flintlock_host), report).await?;
    }
    Ok(())
}

/// Deletes a DELETING VM in flintlock and removes its rows; on failure it stays DELETING
/// and backs off.
async fn delete_vm(
    pass: &Pass<'_>,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    match crate::teardown::finish_vm_delete(&pass.state.flintlock, &pass.state.db, vm, host).await {
        Ok(VmFinish::Removed { lease, .. }) => {
            report.deleted += 1;
            if let Some(l) = lease {
                // A release whose flintlock delete failed earlier, finished here.
                let held = (Utc::now() - l.claimed_at).as_seconds_f64();
                pass.state.metrics.release(&l.pool_ref(), "api", Some(held));
            }
            Ok(())
        }
        Ok(VmFinish::Gone) => Ok(()),
        Err(e) => {
            pass.sick(&vm.flintlock_host);
            tracing::warn!(vm = %vm.id, error = %e, "delete failed; backing off");
            pass.backoff(&vm.id).await
        }
    }
}

fn flintlock_failed(pass: &Pass<'_>, report: &mut PassReport, vm: &VmRow, what: &str, e: &FlintlockError) {
    if matches!(e, FlintlockError::Unavailable { .. }) {
        pass.sick(&vm.flintlock_host);
    }
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, error = %e, "{what} failed; backing off");
    report.errors.push(format!("{}: {what}: {e}", vm.id));
}

/// CreateMicroVM for a committed intent row, storing the uid it answers with.
async fn create_vm(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let state = pass.state;
    let Some(host) = host else {
        return drop_intent(pass, vm, "its host is not registered").await;
    };
    let spec = pool.microvm_template.to_spec(&vm.id, &state.flintlock_namespace(&pool.namespace));
    match state.flintlock.create(host, spec).await {
        Ok(m) => {
            let uid = m.spec.as_ref().and_then(|s| s.uid.clone()).unwrap_or_default();
            if uid.is_empty() {
                report.errors.push(format!("{}: CreateMicroVM answered without a uid", vm.id));
                return pass.backoff(&vm.id).await;
            }
            let conn = state.db.get().await?;
            store::vm_set_uid(&**conn, &vm.id, &uid, EventType::VmProvisioned).await?;
            report.created += 1;
            Ok(())
        }
        Err(e) => {
            // The create may have reached flintlock (a lost reply): the row stays without a
            // uid and the next pass looks the id up before creating again.
            flintlock_failed(pass, report, vm, "CreateMicroVM", &e);
            give_up_or_backoff(pass, vm).await
        }
    }
}

async fn give_up_or_backoff(pass: &Pass<'_>, vm: &VmRow) -> Result<(), StoreError> {
    if vm.attempts + 1 >= pass.state.config.reconcile.max_create_attempts {
        drop_intent(pass, vm, "its host kept failing").await
    } else {
        pass.backoff(&vm.id).await
    }
}

async fn drop_intent(pass: &Pass<'_>, vm: &VmRow, why: &str) -> Result<(), StoreError> {
    tracing::warn!(vm = %vm.id, host = %vm.flintlock_host, "dropping provisioning intent: {why}; a replacement is placed elsewhere");
    let conn = pass.state.db.get().await?;
    store::vm_delete_intent(&**conn, &vm.id).await?;
    Ok(())
}

/// A row without a uid: its create was never answered. Adopt the VM flintlock has under our
/// id, or create it now.
async fn create_or_adopt(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    hosts: &HashMap<String, HostRow>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let state = pass.state;
    let Some(host) = hosts.get(&vm.flintlock_host) else {
        return drop_intent(pass, vm, "its host is not registered").await;
    };
    let ns = state.flintlock_namespace(&pool.namespace);
    match state.flintlock.list(host, &ns, Some(&vm.id)).await {
        Ok(mut found) => {
            found.retain(|m| {
                m.status.as_ref().is_none_or(|s| s.state != MicroVmState::Deleting as i32)
                    && m.spec.as_ref().is_some_and(|s| s.id == vm.id && s.namespace == ns)
            });
            // Several (a duplicate create): adopt the oldest uid; the orphan scan deletes the rest.
            found.sort_by_key(|m| m.spec.as_ref().and_then(|s| s.uid.clone()));
            match found.first().and_then(|m| m.spec.as_ref()).and_then(|s| s.uid.clone()) {
                Some(uid) => {
                    let conn = state.db.get().await?;
                    if store::vm_set_uid(&**conn, &vm.id, &uid, EventType::VmAdopted).await? {
                        state.metrics.orphan(&pool.namespace, &pool.name, "adopted");
                        report.adopted += 1;
                        tracing::info!(vm = %vm.id, %uid, "adopted a microVM whose create reply was lost");
                    }
                    Ok(())
                }
                None => create_vm(pass, pool, vm, Some(host), report).await,
            }
        }
        Err(e) => {
            flintlock_failed(pass, report, vm, "ListMicroVMs", &e);
            give_up_or_backoff(pass, vm).await
        }
    }
}

/// A created VM: look at its flintlock state and move it one step.
async fn poll_provisioning(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let state = pass.state;
    let Some(host) = host else {
        return fail_vm(pass, pool, vm, "its host is not registered", report).await;
    };
    let uid = vm.uid.as_deref().unwrap_or_default();
    let m = match state.flintlock.get(host, uid).await {
        Ok(m) => m,
        Err(e) => {
            flintlock_failed(pass, report, vm, "GetMicroVM", &e);
            return pass.backoff(&vm.id).await;
        }
    };
    let Some(m) = m else {
        return fail_vm(pass, pool, vm, "the microVM disappeared from flintlock", report).await;
    };
    let st = m.status.as_ref().map(|s| s.state).unwrap_or(MicroVmState::Pending as i32);
    if st == MicroVmState::Created as i32 {
        let nics = nics_json(&m);
        let conn = state.db.get().await?;
        if !pool.create_commands.is_empty() {
            // Create hooks run on the next passes, one step at a time.
            store::vm_transition(&**conn, &vm.id, Phase::Provisioning, Phase::CreateHookRunning, Some(&nics), None)
                .await?;
            return Ok(());
        }
        if store::vm_transition(
            &**conn,
            &vm.id,
            Phase::Provisioning,
            Phase::Available,
            Some(&nics),
            Some((EventType::VmAvailable, &json!({"uid": uid}))),
        )
        .await?
        {
            let secs = (Utc::now() - vm.created_at).as_seconds_f64();
            state.metrics.provisioned(&pool.namespace, &pool.name, secs);
            report.available += 1;
        }
        Ok(())
    } else if st == MicroVmState::Failed as i32 {
        fail_vm(pass, pool, vm, "flintlock reports the microVM FAILED", report).await
    } else if st == MicroVmState::Deleting as i32 {
        fail_vm(pass, pool, vm, "the microVM is being deleted in flintlock", report).await
    } else if (Utc::now() - vm.created_at).to_std().unwrap_or_default() > state.config.reconcile.provision_timeout {
        fail_vm(pass, pool, vm, "the microVM stayed PENDING past the provision timeout", report).await
    } else {
        Ok(()) // Still booting: the next pass looks again.
    }
}

/// One step of a VM's create hook: wait for the guest agent (bounded overall by the guest
/// agent timeout, one probe per pass), then run the next command. Progress is stored after
/// each command, so a pass that dies re-runs at most the command it was running. The last
/// command's success makes the VM AVAILABLE.
async fn create_hook_step(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    host: Option<&HostRow>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let state = pass.state;
    let hooks = &state.config.hooks;
    let (Some(host), Some(uid)) = (host, vm.uid.as_deref()) else {
        return fail_vm(pass, pool, vm, "its host is not registered", report).await;
    };
    let started = vm.hook_started_at.unwrap_or(vm.updated_at);
    let step = usize::try_from(vm.hook_step).unwrap_or(0);
    if step == 0 {
        let probe = hooks.command_timeout.min(std::time::Duration::from_secs(5));
        match state.flintlock.wait_ready(host, uid, probe).await {
            Ok(true) => {}
            Ok(false) => {
                if (Utc::now() - started).to_std().unwrap_or_default() > hooks.guest_agent_timeout {
                    let why = format!("the guest agent did not answer within {:?}", hooks.guest_agent_timeout);
                    return fail_vm(pass, pool, vm, &why, report).await;
                }
                return pass.backoff(&vm.id).await;
            }
            Err(e) => return fail_vm(pass, pool, vm, &format!("guest agent: {e}"), report).await,
        }
    }
    let Some(cmd) = pool.create_commands.get(step) else {
        return hook_done(pass, pool, vm, started, report).await;
    };
    let outcome = state.flintlock.exec(host, uid, cmd, hooks.command_timeout).await;
    let failure = match outcome {
        Ok(o) if o.exit_code == 0 => None,
        Ok(o) => Some(format!("create command {step} `{cmd}` exited with {}: {}", o.exit_code, o.stderr.trim())),
        Err(e) => Some(format!("create command {step} `{cmd}` could not run: {e}")),
    };
    if let Some(why) = failure {
        return fail_vm(pass, pool, vm, &why, report).await;
    }
    let next = vm.hook_step + 1;
    if usize::try_from(next).unwrap_or(0) >= pool.create_commands.len() {
        return hook_done(pass, pool, vm, started, report).await;
    }
    let conn = state.db.get().await?;
    store::vm_set_hook_step(&**conn, &vm.id, next).await?;
    Ok(())
}

async fn hook_done(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    started: DateTime<Utc>,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let state = pass.state;
    let conn = state.db.get().await?;
    let moved = store::vm_transition(
        &**conn,
        &vm.id,
        Phase::CreateHookRunning,
        Phase::Available,
        None,
        Some((EventType::VmAvailable, &json!({"uid": vm.uid, "create_commands": pool.create_commands.len()}))),
    )
    .await?;
    if moved {
        state.metrics.provisioned(&pool.namespace, &pool.name, (Utc::now() - vm.created_at).as_seconds_f64());
        state.metrics.hook_succeeded(&pool.namespace, &pool.name, "create", (Utc::now() - started).as_seconds_f64());
        report.available += 1;
    }
    Ok(())
}

/// The pool's failure policy for a VM that did not become ready. DELETE_AND_REPLACE goes
/// through DELETING (so a failing flintlock delete cannot orphan the microVM); QUARANTINE
/// keeps it for inspection.
async fn fail_vm(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    reason: &str,
    report: &mut PassReport,
) -> Result<(), StoreError> {
    let state = pass.state;
    let to = match pool.hook_failure_policy {
        HookFailurePolicy::DeleteAndReplace => Phase::Deleting,
        HookFailurePolicy::Quarantine => Phase::Quarantined,
    };
    let payload = json!({"hook": "create", "reason": reason, "policy": pool.hook_failure_policy});
    let moved = {
        let conn = state.db.get().await?;
        store::vm_transition(&**conn, &vm.id, vm.phase, to, None, Some((EventType::VmHookFailed, &payload))).await?
    };
    if !moved {
        return Ok(());
    }
    state.metrics.hook_failed(&pool.namespace, &pool.name, "create");
    report.failed += 1;
    tracing::warn!(vm = %vm.id, %reason, policy = %pool.hook_failure_policy, "VM failed to provision");
    Ok(())
}

/// DELETING VMs of pools that no longer exist: nobody holds their pool lease, so they are
/// taken one by one with SKIP LOCKED.
async fn finish_deleted_pools(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    let hosts = match hosts_by_name(pass.state).await {
        Ok(h) => h,
        Err(e) => {
            report.errors.push(format!("loading hosts: {e}"));
            return report;
        }
    };
    // One batch per pass: a failed delete backs off and waits for a later pass.
    let batch = match pass.state.db.get().await {
        Ok(conn) => store::vm_take_orphaned_deletions(&**conn, 500).await,
        Err(e) => Err(e.into()),
    };
    let batch = match batch {
        Ok(b) => b,
        Err(e) => {
            report.errors.push(format!("taking deletions: {e}"));
            return report;
        }
    };
    for vm in &batch {
        if pass.past_deadline() {
            report.deadline_reached = true;
            break;
        }
        if let Err(e) = delete_vm(pass, vm, hosts.get(&vm.flintlock_host), &mut report).await {
            report.errors.push(format!("{}: {e}", vm.id));
        }
    }
    report
}

/// Deletes microVMs in poolmgr's namespaces that no row accounts for: no row with that id,
/// a row on another host, or a row with another uid. Rows without a uid are still being
/// resolved and their VMs are left alone. flintlock is listed *before* the rows are read, so
/// a VM created meanwhile (its row committed first) is never mistaken for an orphan.
async fn scan_orphans(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    let state = pass.state;
    let prefix = state.config.flintlock_namespace_prefix.clone();
    let interval = state.config.reconcile.orphan_scan_interval.as_secs_f64();
    while !pass.past_deadline() {
        let host = match state.db.get().await {
            Ok(conn) => store::host_take_scan(&**conn, interval, pass.started_db).await,
            Err(e) => Err(e.into()),
        };
        let host = match host {
            Ok(Some(h)) => h,
            Ok(None) => break,
            Err(e) => {
                report.errors.push(format!("taking a host scan: {e}"));
                break;
            }
        };
        if let Err(e) = scan_host(pass, &host, &prefix, &mut report).await {
            report.errors.push(format!("orphan scan of {}: {e}", host.name));
        }
    }
    report
}

async fn scan_host(pass: &Pass<'_>, host: &HostRow, prefix: &str, report: &mut PassReport) -> Result<(), ApiError> {
    let state = pass.state;
    let all = match state.flintlock.list(host, "", None).await {
        Ok(v) => v,
        Err(e) => {
            pass.sick(&host.name);
            return Err(ApiError::unavailable("flintlock list failed", e));
        }
    };
    let managed: Vec<_> = all
        .into_iter()
        .filter_map(|m| {
            let spec = m.spec?;
            let deleting = m.status.as_ref().is_some_and(|s| s.state == MicroVmState::Deleting as i32);
            (spec.namespace.starts_with(prefix) && !deleting).then_some(spec)
        })
        .collect();
    if managed.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = managed.iter().map(|s| s.id.clone()).collect();
    let rows: HashMap<String, (String, Option<String>)> = {
        let conn = state.conn().await?;
        store::vm_identities(&**conn, &ids).await?.into_iter().map(|(id, h, uid)| (id, (h, uid))).collect()
    };
    for spec in managed {
        let uid = spec.uid.clone().unwrap_or_default();
        let orphan = match rows.get(&spec.id) {
            None => true,
            Some((row_host, _)) if *row_host != host.name => true,
            Some((_, Some(row_uid))) => *row_uid != uid,
            Some((_, None)) => false,
        };
        if !orphan || uid.is_empty() {
            continue;
        }
        if let Err(e) = state.flintlock.delete(host, &uid).await {
            report.errors.push(format!("deleting orphan {uid} on {}: {e}", host.name));
            continue;
        }
        let pool = pool_of_orphan(prefix, &spec.namespace, &spec.id);
        state.metrics.orphan(&pool.namespace, &pool.name, "deleted");
        report.orphans_deleted += 1;
        tracing::warn!(host = %host.name, id = %spec.id, %uid, "deleted an orphaned microVM");
        let conn = state.conn().await?;
        store::event_insert(
            &**conn,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn c(available: i64, claiming: i64, leased: i64, provisioning: i64) -> Counts {
        Counts { available, claiming, leased, provisioning, quarantined: 0, rows: 0 }
    }

    #[test]
    fn immediate_on_lease_keeps_size_ready_and_ignores_leased() {
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(0, 0, 0, 0)), 5);
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(3, 0, 2, 0)), 2);
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(3, 1, 9, 1)), 0);
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(6, 0, 0, 0)), 0);
    }

    #[test]
    fn replace_on_delete_counts_leased_vms() {
        assert_eq!(desired_new(Strategy::ReplaceOnDelete, 5, None, c(0, 0, 0, 0)), 5);
        assert_eq!(desired_new(Strategy::ReplaceOnDelete, 5, None, c(3, 0, 2, 0)), 0);
        assert_eq!(desired_new(Strategy::ReplaceOnDelete, 5, None, c(2, 1, 1, 0)), 1);
    }

    #[test]
    fn min_size_threshold_acts_only_below_min_size() {
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(0, 0, 0, 0)), 5);
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(2, 0, 0, 0)), 0);
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(1, 0, 3, 0)), 1);
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(1, 0, 1, 1)), 2);
    }

    #[test]
    fn surplus_only_counts_available_vms_beyond_size() {
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 1, c(3, 0, 0, 0)), 2);
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 1, c(1, 0, 3, 0)), 1, "leased VMs are never removed");
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 5, c(3, 0, 2, 0)), 0);
        assert_eq!(surplus(Strategy::ImmediateOnLease, 2, c(3, 0, 5, 0)), 1, "leased VMs are extra");
        assert_eq!(surplus(Strategy::MinSizeThreshold, 0, c(2, 1, 0, 1)), 2);
    }

    #[test]
    fn orphan_pool_is_derived_from_namespace_and_id() {
        let id = new_vm_id("ci-large");
        assert_eq!(
            pool_of_orphan("poolmgr-", "poolmgr-team", &id),
            PoolRef { namespace: "team".into(), name: "ci-large".into() }
        );
    }
}
