//! The reconcile pass: keeps every pool at the size its strategy asks for, through flintlock.
//!
//! One call of [`run_pass`] is one pass; the `reconcile` Lambda and the `poolmgr-local`
//! ticker run passes back to back while there is work ([`run_loop`], started by the schedule
//! or by a wake), and the tests call it directly. A pass is idempotent and resumable: it
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
//! - `mod.rs` (here): [`run_pass`], [`PassReport`], the pool workers with their
//!   reconcile-lease handling, and a pool's step in order (`reconcile_pool`).
//! - `pass`: the pass's shared state (`Pass`: sick hosts, the per-host bound on flintlock
//!   calls, the selected and leased pools, the per-host statistics).
//! - [`driver`]: the reconcile loop ([`run_loop`]): passes while there is work, one looper
//!   at a time, hand-offs; [`scale`]: the sizing step of a pass (autoscaled pools);
//!   [`sizing`]: its pure arithmetic (Erlang B, the stabilization window, hints).
//! - [`strategy`]: the pure arithmetic: [`desired_new`], [`surplus`] of a pool's `VmCounts`.
//! - `provision`: new VMs (placement, CreateMicroVM), adopting a VM whose create reply was
//!   lost, polling PROVISIONING VMs until flintlock says CREATED.
//! - `hooks`: create-hook steps (guest agent wait, one command per step), and the pool's
//!   failure policy for a VM that did not become ready.
//! - `sweeps`: lease expiry and expiring-soon warnings, claims abandoned mid-hook, finishing
//!   DELETING VMs (through [`crate::teardown`]), stragglers of deleted pools, surplus VMs.
//! - `orphans`: the orphan scan of each host.
//! - `retention`: deleting events older than `POOLMGR_EVENTS_RETENTION`, in batches.
//! - `reseal`: hosts' secrets brought under the current credentials key (`crate::credentials`).
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
//! its gRPC call (a step gives its own back first), the VM steps and create hooks of a pool,
//! which run side by side, each check one out for their own writes, and so do a pool's
//! replenishment and the cross-pool work (deleted pools, orphan scans).
//!
//! # Hosts that stop answering
//!
//! Every flintlock call waits at most the flintlock timeout (10 s), and a host that stopped
//! answering makes every call to it wait that long. So: a call that fails because the host
//! could not be reached marks the host *sick* for the rest of the pass (`Pass::on_host`),
//! and every later step that would call it is skipped (`PassReport::skipped`), in every
//! pool; a pass has at most `POOLMGR_RECONCILE_HOST_CONCURRENCY` MicroVM calls in flight per
//! host, so the calls queued behind the first failure are skipped rather than each waiting
//! out its timeout; a pool's VMs are stepped side by side (each host's bounded), and its
//! replenishment runs beside them, placing only on hosts not (yet) sick. A dead host costs
//! a pass about one timeout, not one per VM, and never keeps a pool from being topped up on
//! its healthy hosts.

pub mod batches;
mod conn;
pub mod driver;
mod error;
mod hooks;
mod orphans;
mod pass;
use pass::Pass;
mod provision;
mod reseal;
mod retention;
mod rollout;
pub mod scale;
pub mod select;
pub mod sizing;
pub mod strategy;
mod sweeps;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::Serialize;

use crate::app::AppState;
use crate::domain::{Phase, PoolRef};
use crate::store::{self, HostRow, PoolRow, VmRow};
use conn::StepConn;

pub use driver::{LoopReport, Start, Stop, pass_room, run_loop, run_loop_from, run_ticker};
pub use error::ReconcileError;
pub use provision::new_vm_id;
pub use select::{needs_step, pools_with_work};
pub use strategy::{desired_new, surplus};

/// How many pools a pass leases (and sweeps: expiry, warnings, abandoned claims) in one go.
/// A few per worker: enough that the batch statements replace many per-pool round trips,
/// few enough that a pass leaves the rest of a long selection to an overlapping pass.
const LEASE_BATCH: usize = 32;

/// What one pass did, for logs, the Lambda's answer and tests.
#[derive(Debug, Default, Clone, Serialize)]
pub struct PassReport {
    /// Pools the selection found work in (`select`); the others cost the pass nothing.
    pub selected: usize,
    /// Pools stepped (their reconcile lease taken by this pass).
    pub pools: usize,
    pub created: usize,
    pub adopted: usize,
    pub available: usize,
    pub deleted: usize,
    pub expired: usize,
    pub expiry_warnings: u64,
    pub failed: usize,
    pub orphans_deleted: usize,
    /// Rows removed because their microVM was gone from flintlock (VM_LOST).
    pub lost: usize,
    /// Events deleted because they were older than the retention.
    pub events_pruned: u64,
    /// Hosts whose secrets this pass sealed under the current credentials key (`reseal`).
    pub credentials_resealed: usize,
    /// Hosts found unreachable and not judged dead yet (`POOLMGR_HOST_DEAD_SECONDS`): a
    /// reconcile loop keeps passing until they are judged, so a pool on a host that died is
    /// topped up on its other hosts then, not at the next scheduled invocation.
    pub hosts_awaiting_judgement: usize,
    /// Autoscaled pools whose desired size this pass changed.
    pub scaled: usize,
    /// VM steps taken (a delete, a create or adoption, a poll of a booting VM, a create-hook
    /// step): what keeps a reconcile loop passing while VMs boot.
    pub stepped: usize,
    /// Steps not taken because their host failed a call earlier in this pass (the next pass
    /// tries again).
    pub skipped: usize,
    /// Steps that failed and will be retried by a later pass.
    pub errors: Vec<String>,
    /// The deadline stopped the pass before every pool was visited.
    pub deadline_reached: bool,
    pub duration_ms: u128,
    /// Per flintlock host: the MicroVM calls this pass made to it and how fast it created.
    pub hosts: BTreeMap<String, HostPassStats>,
}

/// One host's share of a pass: what a filling pass is limited by once the database is not.
#[derive(Debug, Default, Clone, Serialize)]
pub struct HostPassStats {
    /// MicroVM calls made (create, get, list, delete), and how many of them failed.
    pub calls: usize,
    pub failed: usize,
    /// VMs created (CreateMicroVM answered with a uid).
    pub created: usize,
    /// Time spent in calls to this host, summed over the calls in flight side by side.
    pub busy_ms: u128,
    /// `created` over the pass's duration.
    pub creates_per_s: f64,
}

impl PassReport {
    fn merge(&mut self, o: PassReport) {
        self.selected += o.selected;
        self.pools += o.pools;
        self.created += o.created;
        self.adopted += o.adopted;
        self.available += o.available;
        self.deleted += o.deleted;
        self.expired += o.expired;
        self.expiry_warnings += o.expiry_warnings;
        self.failed += o.failed;
        self.orphans_deleted += o.orphans_deleted;
        self.lost += o.lost;
        self.events_pruned += o.events_pruned;
        self.credentials_resealed += o.credentials_resealed;
        self.hosts_awaiting_judgement = self.hosts_awaiting_judgement.max(o.hosts_awaiting_judgement);
        self.scaled += o.scaled;
        self.stepped += o.stepped;
        self.skipped += o.skipped;
        self.errors.extend(o.errors);
        self.deadline_reached |= o.deadline_reached;
        for (host, h) in o.hosts {
            let mine = self.hosts.entry(host).or_default();
            mine.calls += h.calls;
            mine.failed += h.failed;
            mine.created += h.created;
            mine.busy_ms += h.busy_ms;
        }
    }
}

/// Runs one reconcile pass: selects the pools with work in one statement, steps each of them
/// whose lease it can take (leased and swept in batches), then the cross-pool work
/// (stragglers of deleted pools, orphan scans). Fails only when the pass cannot start (the
/// database's clock cannot be read); per-pool failures are in the report.
pub async fn run_pass(state: &AppState) -> Result<PassReport, ReconcileError> {
    let t0 = Instant::now();
    let rc = &state.config.reconcile;
    let (started_db, horizon, hosts) = {
        let conn = state.db.get().await?;
        let (now, horizon) = store::selection_horizon(&conn).await?;
        (now, horizon, store::host_rows(&conn).await?)
    };
    // Hosts a call found unreachable and none has reached since: the first call of this pass
    // that reaches one clears that (`Pass::on_host`).
    let marked_unreachable = hosts
        .iter()
        .filter(|h| h.unreachable_since.is_some() || h.unreachable_until.is_some_and(|t| t > started_db))
        .map(|h| h.name.clone())
        .collect();
    let dead_hosts = pass::judge_dead_hosts(state, &hosts, started_db).await;
    let cfg = &state.config;
    let pass = Arc::new(Pass {
        state,
        owner: format!("pass-{}", ulid::Ulid::generate()),
        started_db,
        started: t0,
        deadline: t0 + rc.deadline.mul_f64(1.0 - pass::CLEANUP_SHARE),
        cleanup_deadline: std::sync::OnceLock::new(),
        full_deadline: t0 + rc.deadline,
        deployment: state.deployment().await?,
        sick_hosts: Mutex::default(),
        host_slots: Mutex::default(),
        marked_unreachable: Mutex::new(marked_unreachable),
        dead_hosts,
        lease_secs: rc.deadline.as_secs_f64() + cfg.hooks.command_timeout.as_secs_f64() + 30.0,
        pending: Mutex::default(),
        leased: Mutex::default(),
        taking: tokio::sync::Mutex::new(()),
        lease_failed: Mutex::new(false),
        host_stats: Mutex::default(),
    });

    let mut report = PassReport::default();
    for (host, why) in reseal::unreadable_hosts(state, &hosts) {
        pass.sick(&host);
        tracing::warn!(host, "{why}; skipping the host in this pass");
        report.errors.push(why);
    }
    // Sizes first: a desired size that went up is filled by this very pass.
    match scale::scale_pools(state, None).await {
        Ok(s) => report.scaled = s.scaled.len(),
        Err(e) => report.errors.push(format!("sizing the autoscaled pools: {e}")),
    }
    let checked = match select::select(state, started_db).await {
        Ok(selection) => {
            report.selected = selection.pools.len();
            *pass.pending.lock().expect("pending pools") = selection.pools.into();
            Some(selection.checked)
        }
        Err(e) => {
            report.errors.push(format!("selecting the pools with work: {e}"));
            None
        }
    };
    let workers = (0..rc.concurrency).map(|_| pool_worker(&pass));
    for r in futures::future::join_all(workers).await {
        report.merge(r);
    }
    release_unstepped(&pass, &mut report).await;
    if let Some(checked) = checked {
        advance_selection(&pass, horizon, checked.as_ref(), &mut report).await;
    }
    // The cleanup's own budget (issue 23 finding 4): the rest of the deadline, at least
    // `CLEANUP_MIN`, however long the pools took.
    pass.start_cleanup();
    report.merge(sweeps::finish_deleted_pools(&pass).await);
    report.merge(orphans::scan_orphans(&pass).await);
    report.merge(retention::prune_events(&pass).await);
    report.merge(reseal::reseal_credentials(state, &hosts).await);
    // Selected pools left unleased (the pools' share of the deadline ran out first), or a
    // cleanup cut short by its own budget.
    report.deadline_reached |= !pass.pending.lock().expect("pending pools").is_empty() || pass.past_cleanup_deadline();
    report.hosts_awaiting_judgement = {
        let marked = pass.marked_unreachable.lock().expect("marked hosts");
        marked.iter().filter(|h| !pass.dead_hosts.contains(*h)).count()
    };
    let elapsed = t0.elapsed();
    report.duration_ms = elapsed.as_millis();
    for (host, mut h) in std::mem::take(&mut *pass.host_stats.lock().expect("host stats")) {
        h.creates_per_s = h.created as f64 / elapsed.as_secs_f64().max(1e-3);
        report.hosts.insert(host, h);
    }
    // A pass succeeded when it visited every pool and no step failed; only then does
    // `poolmgr_reconcile_last_success_timestamp_seconds` move (wall-clock time, for alerts).
    let succeeded = report.errors.is_empty() && !report.deadline_reached;
    let end = Utc::now().timestamp_millis() as f64 / 1000.0;
    state.metrics.reconcile_pass(elapsed.as_secs_f64(), succeeded, end);
    tracing::info!(
        selected = report.selected,
        pools = report.pools,
        created = report.created,
        available = report.available,
        deleted = report.deleted,
        expired = report.expired,
        skipped = report.skipped,
        errors = report.errors.len(),
        duration_ms = report.duration_ms as u64,
        "reconcile pass done"
    );
    Ok(report)
}

/// Steps leased pools one at a time until none is left for this pass or the deadline.
async fn pool_worker(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    let mut db = StepConn::new(&pass.state.db);
    while !pass.past_deadline() {
        let Some(pool) = next_pool(pass, &mut db, &mut report).await else {
            break;
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

/// The next pool this pass leased and has not stepped; when none is left, takes the leases of
/// the next `LEASE_BATCH` selected pools in one statement and sweeps them together
/// (`sweeps::sweep_batch`). `None`: nothing left, the deadline, or the leases could not be
/// taken (in the report).
async fn next_pool(pass: &Pass<'_>, db: &mut StepConn<'_>, report: &mut PassReport) -> Option<PoolRow> {
    // Never wait for the batch lock holding a connection: its holder may need that one
    // (a one-connection pool on Lambda).
    db.release();
    let _taking = pass.taking.lock().await;
    loop {
        if let Some(pool) = pass.leased.lock().expect("leased pools").pop_front() {
            return Some(pool);
        }
        if pass.past_deadline() {
            report.deadline_reached = true;
            return None;
        }
        let batch: Vec<PoolRef> = {
            let mut pending = pass.pending.lock().expect("pending pools");
            let n = LEASE_BATCH.min(pending.len());
            pending.drain(..n).collect()
        };
        if batch.is_empty() {
            return None;
        }
        let taken = match db.client().await {
            Ok(c) => store::pool_take_reconcile_leases(c, &pass.owner, pass.started_db, pass.lease_secs, &batch)
                .await
                .map_err(ReconcileError::from),
            Err(e) => Err(e),
        };
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                *pass.lease_failed.lock().expect("lease failed") = true;
                report.errors.push(format!("taking pool leases: {e}"));
                return None;
            }
        };
        // Pools another pass took since the selection are simply not in `taken`.
        let refs: Vec<PoolRef> = taken.iter().map(PoolRow::pool_ref).collect();
        if !refs.is_empty()
            && let Err(e) = sweeps::sweep_batch(pass, db, &refs, report).await
        {
            tracing::warn!(pools = refs.len(), error = %e, "sweeping a batch of pools failed; the next pass retries");
            report.errors.push(format!("sweeping {} pools: {e}", refs.len()));
        }
        pass.leased.lock().expect("leased pools").extend(taken);
    }
}

/// Moves the selection's watermark to this pass's `horizon` and its full checks' cursor to
/// `checked`, when the pass took the lease of every pool it selected or found it held (a
/// pool another pass holds is released after this pass's horizon, so its step counts as a
/// signal; so does a release by this pass). A pass that left selected pools unleased (the
/// deadline, a failed batch) records nothing: the next pass looks at the same changes again.
async fn advance_selection(
    pass: &Pass<'_>,
    horizon: DateTime<Utc>,
    checked: Option<&PoolRef>,
    report: &mut PassReport,
) {
    let unleased = !pass.pending.lock().expect("pending pools").is_empty();
    if unleased || *pass.lease_failed.lock().expect("lease failed") {
        return;
    }
    let advanced = match pass.state.db.get().await {
        Ok(c) => store::selection_advance(&c, horizon, checked).await.map_err(ReconcileError::from),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = advanced {
        report.errors.push(format!("recording what the selection saw: {e}; the next pass looks again"));
    }
}

/// Gives back, in one statement, the leases of pools this pass took but did not step (the
/// deadline stopped it first), so the next pass need not wait out the lease.
async fn release_unstepped(pass: &Pass<'_>, report: &mut PassReport) {
    let left: Vec<PoolRef> = pass.leased.lock().expect("leased pools").drain(..).map(|p| p.pool_ref()).collect();
    if left.is_empty() {
        return;
    }
    report.deadline_reached = true;
    let released = match pass.state.db.get().await {
        Ok(c) => store::pool_release_reconcile_leases(&c, &left, &pass.owner).await.map_err(ReconcileError::from),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = released {
        report.errors.push(format!("releasing {} unstepped pool leases: {e}; they expire by themselves", left.len()));
    }
}

/// Gives a pool's reconcile lease back, retrying until the pass deadline. A lease left behind
/// keeps every pass away from the pool for the whole lease (deadline + hook timeout + 30 s,
/// close to two minutes by default), so a database blip of a few seconds that failed the
/// pool's step must not also leave the lease: that stalled replenishment long after the
/// database was back (found by scripts/chaos.sh, scenario pg-restart).
async fn release_reconcile_lease(pass: &Pass<'_>, db: &mut StepConn<'_>, pref: &PoolRef, report: &mut PassReport) {
    let mut delay = Duration::from_millis(100);
    loop {
        let released = match db.client().await {
            Ok(c) => store::pool_release_reconcile_leases(c, std::slice::from_ref(pref), &pass.owner)
                .await
                .map_err(ReconcileError::from),
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
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

async fn hosts_by_name(db: &mut StepConn<'_>) -> Result<HashMap<String, HostRow>, ReconcileError> {
    Ok(store::host_rows(db.client().await?).await?.into_iter().map(|h| (h.name.clone(), h)).collect())
}

fn due(vm: &VmRow, now: DateTime<Utc>) -> bool {
    vm.next_attempt_at.is_none_or(|t| t <= now)
}

/// One pool (its expiry and abandoned claims swept with its batch): its VMs stepped (one step
/// each: deletions, provisioning progress, create hooks) and, beside them, new VMs for what
/// is missing.
async fn reconcile_pool(
    pass: &Pass<'_>,
    db: &mut StepConn<'_>,
    pool: &PoolRow,
    report: &mut PassReport,
) -> Result<(), ReconcileError> {
    let pref = pool.pool_ref();
    let hosts = hosts_by_name(db).await?;
    let vms = store::vm_list_for_pool(db.client().await?, &pref).await?;
    // Counted before the VM steps, which run beside the replenishment: a VM that fails in
    // this pass's steps is replaced by the next pass.
    let counts = store::vm_counts_for_pool(db.client().await?, &pref).await?;
    // A rollout's retirements first: the surplus and the replenishment see what it left.
    let plan = rollout::step(db, pool, counts).await?;
    let counts = plan.counts(counts);
    sweeps::shed_surplus(db, pool, counts, plan.allowance).await?;
    // The VM steps and the replenishment each take connections of their own.
    db.release();
    let replenish = async {
        let mut db = StepConn::new(&pass.state.db);
        let mut r = PassReport::default();
        let res = provision::replenish(pass, &mut db, pool, counts, plan.extra, &hosts, &mut r).await;
        (r, res)
    };
    let ((stepped, stepped_res), (replenished, replenished_res)) =
        futures::join!(step_vms(pass, pool, &vms, &hosts), replenish);
    report.merge(stepped);
    report.merge(replenished);
    stepped_res.and(replenished_res)
}

/// One step for each of the pool's VMs that is due: every host's VMs side by side with the
/// other hosts', at most `host_concurrency` of one host's at once, and the create hooks beside
/// them. A VM whose host turned sick is skipped.
async fn step_vms(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vms: &[(VmRow, bool)],
    hosts: &HashMap<String, HostRow>,
) -> (PassReport, Result<(), ReconcileError>) {
    let now = pass.now();
    let mut by_host: BTreeMap<&str, Vec<&VmRow>> = BTreeMap::new();
    let mut hook_vms = vec![];
    for (vm, _) in vms {
        if !due(vm, now) {
            continue;
        }
        match vm.phase {
            Phase::Deleting | Phase::Provisioning => by_host.entry(vm.flintlock_host.as_str()).or_default().push(vm),
            Phase::CreateHookRunning => hook_vms.push(vm),
            _ => {}
        }
    }
    let limit = pass.state.config.reconcile.host_concurrency;
    // Built with loops, not closures: a closure over `&VmRow` kept in the stream makes the
    // pass's future not `Send` (a higher-ranked lifetime rustc cannot prove).
    let mut per_host = vec![];
    for vms in by_host.into_values() {
        let mut steps = vec![];
        for vm in vms {
            steps.push(step_vm(pass, pool, vm, hosts));
        }
        per_host.push(futures::stream::iter(steps).buffer_unordered(limit).collect::<Vec<_>>());
    }
    let hooks = async {
        let mut report = PassReport::default();
        if pass.past_deadline() {
            report.deadline_reached = true;
            return (report, Ok(()));
        }
        let (sick, hook_vms): (Vec<&VmRow>, Vec<&VmRow>) =
            hook_vms.into_iter().partition(|vm| pass.is_sick(&vm.flintlock_host));
        report.skipped += sick.len();
        report.stepped += hook_vms.len();
        let res = hooks::run_create_hooks(pass, pool, hook_vms, hosts, &mut report).await;
        (report, res)
    };
    let (stepped, (mut report, mut result)) = futures::join!(futures::future::join_all(per_host), hooks);
    for (r, res) in stepped.into_iter().flatten() {
        report.merge(r);
        result = result.and(res);
    }
    (report, result)
}

/// One VM's step, on a connection of its own.
async fn step_vm(
    pass: &Pass<'_>,
    pool: &PoolRow,
    vm: &VmRow,
    hosts: &HashMap<String, HostRow>,
) -> (PassReport, Result<(), ReconcileError>) {
    let mut report = PassReport::default();
    if pass.past_deadline() {
        report.deadline_reached = true;
        return (report, Ok(()));
    }
    if pass.is_sick(&vm.flintlock_host) {
        report.skipped += 1;
        return (report, Ok(()));
    }
    let mut db = StepConn::new(&pass.state.db);
    let host = hosts.get(&vm.flintlock_host);
    report.stepped += 1;
    let res = match vm.phase {
        Phase::Deleting => sweeps::delete_vm(pass, &mut db, vm, host, &mut report).await,
        Phase::Provisioning if vm.uid.is_none() => {
            provision::create_or_adopt(pass, &mut db, pool, vm, hosts, &mut report).await
        }
        Phase::Provisioning => provision::poll_provisioning(pass, &mut db, pool, vm, host, &mut report).await,
        _ => Ok(()),
    };
    (report, res)
}
