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
//! Never answers HTTP: no `service`, `http` or `ApiError` here; failures are
//! [`ReconcileError`]s.
//!
//! # Layout
//!
//! - `mod.rs` (here): [`run_pass`], [`PassReport`], the pass's shared state (`Pass`), the
//!   pool workers with their reconcile-lease handling, and a pool's step in order
//!   (`reconcile_pool`).
//! - [`strategy`]: the pure arithmetic: [`desired_new`], [`surplus`] of a pool's `VmCounts`.
//! - `provision`: new VMs (placement, CreateMicroVM), adopting a VM whose create reply was
//!   lost, polling PROVISIONING VMs until flintlock says CREATED.
//! - `hooks`: create-hook steps (guest agent wait, one command per step), and the pool's
//!   failure policy for a VM that did not become ready.
//! - `sweeps`: lease expiry and expiring-soon warnings, claims abandoned mid-hook, finishing
//!   DELETING VMs (through [`crate::teardown`]), stragglers of deleted pools, surplus VMs.
//! - `orphans`: the orphan scan of each host.
//! - `retention`: deleting events older than `POOLMGR_EVENTS_RETENTION`, in batches.
//! - `conn`: the one connection a pool worker steps on; `error`: [`ReconcileError`].
//!
//! # Connections
//!
//! A pool worker works on one connection (`conn::StepConn`): checked out at its first
//! statement and kept for the statements that follow (taking the pool's lease, the sweeps,
//! the VM list, the surplus mark, a placement, …), but given back before every flintlock call
//! and checked out again after it. The rule everything here keeps: **hold a connection only
//! while talking to the database; never wait for anything else (a gRPC call, a sleep, a
//! second connection) while holding one.**
//!
//! Why: on Lambda the pool has one connection (`Config`: `POOLMGR_DB_POOL_SIZE` defaults to 1
//! there) while a pass steps `POOLMGR_RECONCILE_CONCURRENCY` (8) pools at once and calls
//! flintlock while stepping them. A worker holding the connection through a CreateMicroVM
//! (up to the flintlock timeout) or a create-hook command (up to 30 s) would leave every
//! other worker waiting out the pool's wait timeout and failing its step; a worker waiting
//! for a second connection while holding the only one would deadlock until that timeout.
//! Capping the workers at the pool size instead would step pools one at a time on Lambda,
//! so one slow host would hold up every pool. With the rule, workers on one connection take
//! turns statement group by statement group, and every wait for a connection ends as soon as
//! the holder's statements do. Hence also: the teardown checks out its own connection after
//! its gRPC call (a step gives its own back first), the create hooks of a pool, which run
//! side by side, each check one out for their own writes, and the cross-pool work
//! (deleted pools, orphan scans) has its own.

mod conn;
mod error;
mod hooks;
mod orphans;
mod provision;
mod retention;
pub mod strategy;
mod sweeps;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::app::AppState;
use crate::domain::{Phase, PoolRef};
use crate::store::{self, HostRow, PoolRow, VmRow};
use conn::StepConn;

pub use error::ReconcileError;
pub use provision::new_vm_id;
pub use strategy::{desired_new, surplus};

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
    /// Events deleted because they were older than the retention.
    pub events_pruned: u64,
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
        self.events_pruned += o.events_pruned;
        self.errors.extend(o.errors);
        self.deadline_reached |= o.deadline_reached;
    }
}

/// What the workers of one pass share.
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

    /// Puts a failing VM step off (exponential backoff, in the VM's row).
    async fn backoff(&self, db: &mut StepConn<'_>, vm_id: &str) -> Result<(), ReconcileError> {
        let rc = &self.state.config.reconcile;
        let (base, cap) = (rc.backoff_base.as_secs_f64(), rc.backoff_cap.as_secs_f64());
        Ok(store::vm_backoff(db.client().await?, vm_id, base, cap).await?)
    }
}

/// Runs one reconcile pass over every pool whose lease it can take, then the cross-pool
/// work (stragglers of deleted pools, orphan scans). Fails only when the pass cannot start
/// (the database's clock cannot be read); per-pool failures are in the report.
pub async fn run_pass(state: &AppState) -> Result<PassReport, ReconcileError> {
    let t0 = Instant::now();
    let rc = &state.config.reconcile;
    let started_db: DateTime<Utc> = {
        let conn = state.db.get().await?;
        store::database_now(&conn).await?
    };
    let pass = Arc::new(Pass {
        state,
        owner: format!("pass-{}", ulid::Ulid::generate()),
        started_db,
        deadline: t0 + rc.deadline,
        sick_hosts: Mutex::default(),
    });

    let workers = (0..rc.concurrency).map(|_| pool_worker(&pass));
    let mut report = PassReport::default();
    for r in futures::future::join_all(workers).await {
        report.merge(r);
    }
    report.merge(sweeps::finish_deleted_pools(&pass).await);
    report.merge(orphans::scan_orphans(&pass).await);
    report.merge(retention::prune_events(&pass).await);
    report.deadline_reached |= pass.past_deadline();
    report.duration_ms = t0.elapsed().as_millis();
    // A pass succeeded when it visited every pool and no step failed; only then does
    // `poolmgr_reconcile_last_success_timestamp_seconds` move (wall-clock time, for alerts).
    let succeeded = report.errors.is_empty() && !report.deadline_reached;
    let end = Utc::now().timestamp_millis() as f64 / 1000.0;
    state.metrics.reconcile_pass(t0.elapsed().as_secs_f64(), succeeded, end);
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
    let mut db = StepConn::new(&pass.state.db);
    // The lease outlives the deadline plus a hook command started just before it, so a pool
    // is never worked past its lease.
    let cfg = &pass.state.config;
    let lease_secs = cfg.reconcile.deadline.as_secs_f64() + cfg.hooks.command_timeout.as_secs_f64() + 30.0;
    while !pass.past_deadline() {
        let pool = match db.client().await {
            Ok(c) => store::pool_take_reconcile_lease(c, &pass.owner, pass.started_db, lease_secs)
                .await
                .map_err(ReconcileError::from),
            Err(e) => Err(e),
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
        if let Err(e) = reconcile_pool(pass, &mut db, &pool, &mut report).await {
            tracing::warn!(
                pool = %pref,
                error = %e,
                retryable = e.is_retryable(),
                "pool reconcile step failed; the next pass retries"
            );
            report.errors.push(format!("{pref}: {e}"));
        }
        release_reconcile_lease(pass, &mut db, &pref, &mut report).await;
    }
    report
}

/// Gives a pool's reconcile lease back, retrying until the pass deadline. A lease left behind
/// keeps every pass away from the pool for the whole lease (deadline + hook timeout + 30 s,
/// close to two minutes by default), so a database blip of a few seconds that failed the
/// pool's step must not also leave the lease: that stalled replenishment long after the
/// database was back (found by scripts/chaos.sh, scenario pg-restart).
async fn release_reconcile_lease(pass: &Pass<'_>, db: &mut StepConn<'_>, pref: &PoolRef, report: &mut PassReport) {
    let mut delay = std::time::Duration::from_millis(100);
    loop {
        let released = match db.client().await {
            Ok(c) => store::pool_release_reconcile_lease(c, pref, &pass.owner).await.map_err(ReconcileError::from),
            Err(e) => Err(e),
        };
        match released {
            Ok(()) => return,
            Err(e) if pass.past_deadline() => {
                report.errors.push(format!("{pref}: releasing the reconcile lease: {e}; it expires by itself"));
                return;
            }
            Err(e) => {
                tracing::warn!(pool = %pref, error = %e, retry_in_ms = delay.as_millis() as u64, "cannot release the reconcile lease yet");
                // Never sleep on a connection; the next attempt checks out a fresh one.
                db.release();
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(2));
            }
        }
    }
}

async fn hosts_by_name(db: &mut StepConn<'_>) -> Result<HashMap<String, HostRow>, ReconcileError> {
    Ok(store::host_list(db.client().await?).await?.into_iter().map(|(h, _)| (h.name.clone(), h)).collect())
}

fn due(vm: &VmRow, now: DateTime<Utc>) -> bool {
    vm.next_attempt_at.is_none_or(|t| t <= now)
}

/// One pool, one step per VM: expiry, deletions, provisioning progress, then new VMs.
async fn reconcile_pool(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let pref = pool.pool_ref();
    sweeps::expire_leases(pass, db, &pref, report).await?;
    sweeps::recover_abandoned_claims(pass, db, &pref).await?;

    let hosts = hosts_by_name(db).await?;
    let vms = store::vm_list_for_pool(db.client().await?, &pref).await?;
    let now = pass.state.clock.now();
    let mut hook_vms = vec![];
    for (vm, _) in &vms {
        if pass.past_deadline() {
            report.deadline_reached = true;
            return Ok(());
        }
        if !due(vm, now) {
            continue;
        }
        let host = hosts.get(&vm.flintlock_host);
        match vm.phase {
            Phase::Deleting => sweeps::delete_vm(pass, db, vm, host, report).await?,
            Phase::Provisioning if vm.uid.is_none() => {
                provision::create_or_adopt(pass, db, pool, vm, &hosts, report).await?
            }
            Phase::Provisioning => provision::poll_provisioning(pass, db, pool, vm, host, report).await?,
            Phase::CreateHookRunning => hook_vms.push(vm),
            _ => {}
        }
    }
    // The hooks run side by side, each on a connection of its own taken after its gRPC
    // calls: give the step's back first, or with one connection they would wait for it.
    db.release();
    hooks::run_create_hooks(pass, pool, hook_vms, &hosts, report).await?;

    // Replenish, counting what is there after the steps above.
    let counts = store::vm_counts_for_pool(db.client().await?, &pref).await?;
    sweeps::shed_surplus(db, pool, counts).await?;
    provision::replenish(pass, db, pool, counts, &hosts, report).await
}
