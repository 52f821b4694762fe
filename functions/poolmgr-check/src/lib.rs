//! `poolmgr-check`: verifies poolmgr's invariants against the database and the flintlock hosts
//! it names, and reports every violation with the row to look at.
//!
//! Two classes of checks:
//!
//! - [`Class::Always`] — must hold in *every* committed database state, so they are read from
//!   one `REPEATABLE READ READ ONLY` snapshot and a single hit is a bug: a LEASED VM without
//!   exactly one lease, a lease whose VM is not LEASED (or DELETING, a release in progress), two
//!   leases on one VM or one `(principal, request_id)`, a lease on another pool than its VM, a
//!   live VM without a uid, a VM on an unregistered host or of a deleted pool, two rows naming
//!   one microVM.
//! - [`Class::Settled`] — hold once the system is quiet (no claim, release or reconcile step in
//!   flight and the reconciler had time to catch up): no row in a transitional phase, every pool
//!   at its size and none above it, no microVM in a managed flintlock namespace without a row
//!   (orphan), no row whose microVM is gone. Checked with `--settled`, or waited for with
//!   `--wait`.
//!
//! It never writes: the database is only read, flintlock only listed (ListMicroVMs over every
//! namespace, filtered by the managed prefix, like the reconciler's orphan scan).
//!
//! # Layout
//!
//! - [`Options`], [`check_once`]: one round of every check, giving an [`Outcome`].
//! - [`run`]: one round, or rounds until settled or a deadline, printing progress; what the
//!   binary calls.
//! - The SQL lives in this crate (read-only queries), next to the check it implements.

pub mod campaign;
pub mod history;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use flintlock_proto::types::micro_vm_status::MicroVmState;
use poolmgr_core::deployment::Deployment;
use poolmgr_core::flintlock::Flintlock;
use poolmgr_core::reconcile::{desired_new, surplus};
use poolmgr_core::store::{self, HostRow};
use serde::Serialize;
use tokio_postgres::IsolationLevel;

/// Where to look and how.
#[derive(Debug, Clone)]
pub struct Options {
    pub database_url: String,
    /// TLS to the database (`POOLMGR_DATABASE_SSLMODE`, `POOLMGR_DATABASE_CA_PEM`).
    pub db_tls: poolmgr_core::db::DbTls,
    /// `(host name, address)`: list this address instead of the one in the hosts table (a host
    /// not in the table is listed too; every managed VM on it is then an orphan).
    pub flintlock_overrides: Vec<(String, String)>,
    /// poolmgr's flintlock namespaces start with this (`POOLMGR_FLINTLOCK_NAMESPACE_PREFIX`).
    pub namespace_prefix: String,
    /// The deployment's id (`POOLMGR_DEPLOYMENT_ID`); `None`: the one in its database. Only
    /// microVMs in this deployment's namespaces are checked, as the orphan scan only deletes
    /// those: another deployment's on a shared host are not orphans of this one.
    pub deployment_id: Option<String>,
    /// Limit of each flintlock call.
    pub flintlock_timeout: Duration,
    /// Opens hosts' sealed secrets (`POOLMGR_CREDENTIALS_KEY`, `_OLD_KEYS`); empty: only
    /// hosts without sealed secrets can be listed.
    pub credentials: std::sync::Arc<poolmgr_core::credentials::Keyring>,
}

/// Whether a check must hold always, or only once the system settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Class {
    Always,
    Settled,
}

/// One violated invariant, about one subject (a row, a pool, a microVM).
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Stable name of the check, e.g. `lease-on-unleased-vm`.
    pub check: &'static str,
    pub class: Class,
    /// What it is about: `vm ci-01j…`, `lease 7f…`, `pool default/ci`.
    pub subject: String,
    pub detail: String,
    /// Where to look next (a query, a command).
    pub look_at: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}: {}\n      look at: {}", self.check, self.subject, self.detail, self.look_at)
    }
}

/// What one round saw.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Stats {
    pub pools: i64,
    pub vms: i64,
    pub leases: i64,
    pub hosts: usize,
    /// Live (not DELETING) microVMs in managed namespaces, over every host listed.
    pub flintlock_vms: usize,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Outcome {
    pub findings: Vec<Finding>,
    pub stats: Stats,
    /// Hosts whose microVMs could not be listed, with the error: the flintlock checks of
    /// those hosts were not made.
    pub unreachable: Vec<String>,
}

impl Outcome {
    /// The findings that count as violations: [`Class::Always`] ones, and with `settled` the
    /// [`Class::Settled`] ones too.
    pub fn violations(&self, settled: bool) -> Vec<&Finding> {
        self.findings.iter().filter(|f| f.class == Class::Always || settled).collect()
    }

    pub fn has(&self, check: &str) -> bool {
        self.findings.iter().any(|f| f.check == check)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("cannot read the database ({0}); check --database-url / DATABASE_URL and that PostgreSQL is up")]
    Db(String),
}

impl From<tokio_postgres::Error> for CheckError {
    fn from(e: tokio_postgres::Error) -> Self {
        CheckError::Db(e.to_string())
    }
}

impl From<store::StoreError> for CheckError {
    fn from(e: store::StoreError) -> Self {
        CheckError::Db(e.to_string())
    }
}

fn sql_vm(id: &str) -> String {
    format!("SELECT * FROM vms WHERE id = '{id}'; SELECT * FROM leases WHERE vm_id = '{id}'")
}

fn sql_lease(lease_id: &str) -> String {
    format!("SELECT * FROM leases WHERE lease_id = '{lease_id}'")
}

/// A live microVM in a managed namespace: (flintlock namespace, id, uid).
type Listed = (String, String, String);

/// Phases whose VM must exist in flintlock once it has a uid.
const LIVE_PHASES: &[&str] =
    &["PROVISIONING", "CREATE_HOOK_RUNNING", "AVAILABLE", "PRE_LEASE_HOOK_RUNNING", "LEASED", "QUARANTINED"];

/// One round of every check. Flintlock is listed first, then the database is read in one
/// snapshot (as the reconciler's orphan scan does, so a VM created meanwhile already has its
/// row).
pub async fn check_once(opts: &Options) -> Result<Outcome, CheckError> {
    let mut out = Outcome::default();
    let mut client = poolmgr_core::db::connect_one(&opts.database_url, &opts.db_tls)
        .await
        .map_err(|e| CheckError::Db(e.to_string()))?;

    let deployment_id = match &opts.deployment_id {
        Some(id) => id.clone(),
        None => store::deployment_get_id(&client).await?,
    };
    let deployment = Deployment::new(&opts.namespace_prefix, &deployment_id).map_err(CheckError::Db)?;

    // ---- flintlock --------------------------------------------------------------------
    let mut hosts: Vec<HostRow> = store::host_list(&client).await?.into_iter().map(|(h, _)| h).collect();
    for (name, addr) in &opts.flintlock_overrides {
        match hosts.iter_mut().find(|h| &h.name == name) {
            Some(h) => h.address = addr.clone(),
            None => {
                let mut h = hosts.first().cloned().unwrap_or_else(|| blank_host(name));
                h.name = name.clone();
                h.address = addr.clone();
                h.tls_insecure = true;
                h.basic_auth_token = None;
                h.credentials_key_id = None;
                h.credentials_dek = None;
                hosts.push(h);
            }
        }
    }
    out.stats.hosts = hosts.len();
    let flintlock = Flintlock::new(opts.flintlock_timeout).with_keyring(opts.credentials.clone());
    // host → its live managed microVMs; None when the host could not be listed.
    let mut listed: HashMap<String, Option<Vec<Listed>>> = HashMap::new();
    for host in &hosts {
        match flintlock.list(&host.endpoint(), "", None).await {
            Ok(vms) => {
                let live: Vec<_> = vms
                    .into_iter()
                    .filter(|m| m.status.as_ref().is_none_or(|s| s.state != MicroVmState::Deleting as i32))
                    .filter_map(|m| m.spec)
                    .filter(|s| deployment.pool_namespace(&s.namespace).is_some())
                    .map(|s| (s.namespace, s.id, s.uid.unwrap_or_default()))
                    .collect();
                out.stats.flintlock_vms += live.len();
                listed.insert(host.name.clone(), Some(live));
            }
            Err(e) => {
                out.unreachable.push(format!("{} ({}): {e}", host.name, host.address));
                listed.insert(host.name.clone(), None);
            }
        }
    }

    // ---- database, one snapshot -------------------------------------------------------
    let tx = client.build_transaction().isolation_level(IsolationLevel::RepeatableRead).read_only(true).start().await?;
    let counts = tx
        .query_one(
            "SELECT (SELECT count(*) FROM pools), (SELECT count(*) FROM vms), (SELECT count(*) FROM leases)",
            &[],
        )
        .await?;
    out.stats.pools = counts.get(0);
    out.stats.vms = counts.get(1);
    out.stats.leases = counts.get(2);
    always_checks(&tx, &mut out.findings).await?;
    settled_db_checks(&tx, &mut out.findings).await?;
    let rows: Vec<(String, String, Option<String>, String)> = tx
        .query("SELECT id, flintlock_host, uid, phase FROM vms", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    tx.commit().await?;

    // ---- flintlock against the rows -----------------------------------------------------
    let by_id: HashMap<&str, (&str, Option<&str>, &str)> =
        rows.iter().map(|(id, h, uid, p)| (id.as_str(), (h.as_str(), uid.as_deref(), p.as_str()))).collect();
    let mut live_uids: HashMap<&str, HashSet<&str>> = HashMap::new();
    for (host, vms) in &listed {
        let Some(vms) = vms else { continue };
        let set = live_uids.entry(host.as_str()).or_default();
        for (ns, id, uid) in vms {
            set.insert(uid.as_str());
            let why = match by_id.get(id.as_str()) {
                None => "no vms row has this id".to_string(),
                Some((row_host, _, _)) if row_host != host => format!("its row is on host {row_host}"),
                Some((_, Some(row_uid), _)) if row_uid != uid => {
                    format!("its row names uid {row_uid} (a duplicate create)")
                }
                _ => continue,
            };
            out.findings.push(Finding {
                check: "orphan-vm",
                class: Class::Settled,
                subject: format!("microVM {ns}/{id} uid {uid} on host {host}"),
                detail: format!("{why}: nothing will ever claim or delete it except the orphan scan"),
                look_at: format!("{}; the reconciler's VM_ORPHAN_DELETED events", sql_vm(id)),
            });
        }
    }
    for (id, host, uid, phase) in &rows {
        let (Some(uid), true) = (uid, LIVE_PHASES.contains(&phase.as_str())) else { continue };
        let Some(set) = live_uids.get(host.as_str()) else { continue };
        if !set.contains(uid.as_str()) {
            out.findings.push(Finding {
                check: "row-without-vm",
                class: Class::Settled,
                subject: format!("vm {id} ({phase}) on host {host}"),
                detail: format!(
                    "flintlock has no live microVM with uid {uid}: a claim would hand out a VM that does not exist"
                ),
                look_at: format!("{}; flintlock GetMicroVM {uid} on {host}", sql_vm(id)),
            });
        }
    }
    for u in &out.unreachable {
        out.findings.push(Finding {
            check: "flintlock-unreachable",
            class: Class::Settled,
            subject: format!("host {}", u.split(' ').next().unwrap_or(u)),
            detail: format!("could not list its microVMs, so orphans and lost VMs were not checked: {u}"),
            look_at: "is the host (flintlock-sim) running at that address? override it with --flintlock NAME=ADDR"
                .into(),
        });
    }
    Ok(out)
}

fn blank_host(name: &str) -> HostRow {
    let now = chrono::Utc::now();
    HostRow {
        name: name.to_string(),
        address: String::new(),
        tls_insecure: true,
        ca_pem: None,
        cert_pem: None,
        key_pem: None,
        basic_auth_token: None,
        credentials_key_id: None,
        credentials_dek: None,
        cordoned: false,
        cordoned_reason: None,
        cordoned_at: None,
        exec: poolmgr_core::domain::HostExec::Auto,
        flintlock_version: None,
        exec_unavailable_reason: None,
        checked_at: None,
        unreachable_until: None,
        unreachable_since: None,
        created_at: now,
        updated_at: now,
    }
}

/// The invariants of every committed state.
async fn always_checks(tx: &tokio_postgres::Transaction<'_>, out: &mut Vec<Finding>) -> Result<(), CheckError> {
    let mut push = |check: &'static str, subject: String, detail: String, look_at: String| {
        out.push(Finding { check, class: Class::Always, subject, detail, look_at });
    };

    for r in tx
        .query(
            "SELECT v.id, v.pool_namespace || '/' || v.pool_name, v.lease_id FROM vms v
             WHERE v.phase = 'LEASED' AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.vm_id = v.id)
             ORDER BY v.id",
            &[],
        )
        .await?
    {
        let (id, pool, lease): (String, String, Option<String>) = (r.get(0), r.get(1), r.get(2));
        push(
            "leased-vm-without-lease",
            format!("vm {id} (pool {pool})"),
            format!(
                "phase LEASED but no lease row names it (vms.lease_id = {}): a lease was lost, its client holds nothing the API knows",
                lease.as_deref().unwrap_or("NULL")
            ),
            sql_vm(&id),
        );
    }

    for r in tx
        .query(
            "SELECT v.id, v.lease_id, l.lease_id FROM vms v JOIN leases l ON l.vm_id = v.id
             WHERE v.phase = 'LEASED' AND v.lease_id IS DISTINCT FROM l.lease_id ORDER BY v.id",
            &[],
        )
        .await?
    {
        let (id, vm_lease, lease): (String, Option<String>, String) = (r.get(0), r.get(1), r.get(2));
        push(
            "leased-vm-lease-mismatch",
            format!("vm {id}"),
            format!("vms.lease_id is {} but lease {lease} names this VM", vm_lease.as_deref().unwrap_or("NULL")),
            sql_vm(&id),
        );
    }

    for r in tx
        .query(
            "SELECT l.lease_id, l.vm_id, l.pool_namespace || '/' || l.pool_name FROM leases l
             WHERE NOT EXISTS (SELECT 1 FROM vms v WHERE v.id = l.vm_id) ORDER BY l.lease_id",
            &[],
        )
        .await?
    {
        let (lease, vm, pool): (String, String, String) = (r.get(0), r.get(1), r.get(2));
        push(
            "lease-without-vm",
            format!("lease {lease} (pool {pool})"),
            format!("its VM {vm} has no row: the client holds a lease on nothing"),
            sql_lease(&lease),
        );
    }

    for r in tx
        .query(
            "SELECT l.lease_id, v.id, v.phase FROM leases l JOIN vms v ON v.id = l.vm_id
             WHERE v.phase NOT IN ('LEASED', 'DELETING') ORDER BY l.lease_id",
            &[],
        )
        .await?
    {
        let (lease, vm, phase): (String, String, String) = (r.get(0), r.get(1), r.get(2));
        push(
            "lease-on-unleased-vm",
            format!("lease {lease}"),
            format!("its VM {vm} is {phase}, not LEASED: the VM can be handed out a second time"),
            sql_vm(&vm),
        );
    }

    for r in tx
        .query(
            "SELECT l.lease_id, l.pool_namespace || '/' || l.pool_name, v.id, v.pool_namespace || '/' || v.pool_name
             FROM leases l JOIN vms v ON v.id = l.vm_id
             WHERE (l.pool_namespace, l.pool_name) IS DISTINCT FROM (v.pool_namespace, v.pool_name)
             ORDER BY l.lease_id",
            &[],
        )
        .await?
    {
        let (lease, lpool, vm, vpool): (String, String, String, String) = (r.get(0), r.get(1), r.get(2), r.get(3));
        push(
            "lease-pool-mismatch",
            format!("lease {lease}"),
            format!("the lease is on pool {lpool} but its VM {vm} belongs to pool {vpool}"),
            sql_vm(&vm),
        );
    }

    for r in tx
        .query(
            "SELECT vm_id, count(*), string_agg(lease_id, ', ' ORDER BY lease_id) FROM leases
             GROUP BY vm_id HAVING count(*) > 1 ORDER BY vm_id",
            &[],
        )
        .await?
    {
        let (vm, n, leases): (String, i64, String) = (r.get(0), r.get(1), r.get(2));
        push(
            "vm-with-several-leases",
            format!("vm {vm}"),
            format!("{n} leases name it ({leases}): one VM handed out {n} times"),
            sql_vm(&vm),
        );
    }

    for r in tx
        .query(
            "SELECT principal, request_id, count(*), string_agg(lease_id, ', ' ORDER BY lease_id) FROM leases
             WHERE request_id IS NOT NULL GROUP BY principal, request_id HAVING count(*) > 1 ORDER BY 1, 2",
            &[],
        )
        .await?
    {
        let (principal, rid, n, leases): (String, String, i64, String) = (r.get(0), r.get(1), r.get(2), r.get(3));
        push(
            "request-id-with-several-leases",
            format!("request_id {rid:?} of principal {principal:?}"),
            format!(
                "{n} live leases ({leases}): a retried claim created a second lease instead of replaying the first"
            ),
            format!("SELECT * FROM leases WHERE principal = '{principal}' AND request_id = '{rid}'"),
        );
    }

    for r in tx
        .query(
            "SELECT id, phase FROM vms
             WHERE uid IS NULL AND phase IN ('CREATE_HOOK_RUNNING', 'AVAILABLE', 'PRE_LEASE_HOOK_RUNNING', 'LEASED')
             ORDER BY id",
            &[],
        )
        .await?
    {
        let (id, phase): (String, String) = (r.get(0), r.get(1));
        push(
            "live-vm-without-uid",
            format!("vm {id}"),
            format!("phase {phase} but no flintlock uid: it was never confirmed created, yet it can be claimed"),
            sql_vm(&id),
        );
    }

    for r in tx
        .query(
            "SELECT v.id, v.flintlock_host FROM vms v
             WHERE NOT EXISTS (SELECT 1 FROM hosts h WHERE h.name = v.flintlock_host) ORDER BY v.id",
            &[],
        )
        .await?
    {
        let (id, host): (String, String) = (r.get(0), r.get(1));
        push(
            "vm-on-unknown-host",
            format!("vm {id}"),
            format!("its host {host} is not registered: nobody can reach its microVM to delete it"),
            format!("{}; SELECT * FROM hosts", sql_vm(&id)),
        );
    }

    for r in tx
        .query(
            "SELECT v.id, v.phase, v.pool_namespace || '/' || v.pool_name FROM vms v
             WHERE v.phase <> 'DELETING'
               AND NOT EXISTS (SELECT 1 FROM pools p WHERE p.namespace = v.pool_namespace AND p.name = v.pool_name)
             ORDER BY v.id",
            &[],
        )
        .await?
    {
        let (id, phase, pool): (String, String, String) = (r.get(0), r.get(1), r.get(2));
        push(
            "vm-of-deleted-pool",
            format!("vm {id}"),
            format!("phase {phase} but its pool {pool} is gone: a pool delete marks every VM DELETING"),
            sql_vm(&id),
        );
    }

    for r in tx
        .query(
            "SELECT flintlock_host, uid, string_agg(id, ', ' ORDER BY id) FROM vms WHERE uid IS NOT NULL
             GROUP BY flintlock_host, uid HAVING count(*) > 1 ORDER BY 1, 2",
            &[],
        )
        .await?
    {
        let (host, uid, ids): (String, String, String) = (r.get(0), r.get(1), r.get(2));
        push(
            "microvm-with-several-rows",
            format!("microVM {uid} on host {host}"),
            format!("rows {ids} all name it: it may be leased twice"),
            format!("SELECT * FROM vms WHERE uid = '{uid}'"),
        );
    }
    Ok(())
}

/// The database half of the settled checks: nothing in flight, every pool at size.
async fn settled_db_checks(tx: &tokio_postgres::Transaction<'_>, out: &mut Vec<Finding>) -> Result<(), CheckError> {
    for r in tx
        .query(
            "SELECT id, phase, pool_namespace || '/' || pool_name, attempts FROM vms
             WHERE phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING', 'PRE_LEASE_HOOK_RUNNING', 'DELETING')
             ORDER BY id",
            &[],
        )
        .await?
    {
        let (id, phase, pool, attempts): (String, String, String, i32) = (r.get(0), r.get(1), r.get(2), r.get(3));
        out.push(Finding {
            check: "vm-in-transition",
            class: Class::Settled,
            subject: format!("vm {id} (pool {pool})"),
            detail: format!("still {phase} ({attempts} failed attempts): the reconciler has not finished with it"),
            look_at: format!("{}; the reconciler's logs for {id}", sql_vm(&id)),
        });
    }

    // Counted as the reconciler counts them: the store's one definition of the phase counts.
    for (p, n) in store::pool_list_with_counts(tx, None).await? {
        let pool = format!("{}/{}", p.namespace, p.name);
        let strategy = p.strategy;
        let strategy_s = strategy.as_str();
        // An autoscaled pool works towards its desired size, not its spec's.
        let (size, min_size) = (p.target_size(), p.min_size);
        let c = n;
        if let Some(a) = &p.autoscaling {
            // Leases that outlive a lowered max may hold the pool above it; VMs that are not
            // leased never may.
            let live = c.available + c.claiming + c.leased + c.provisioning;
            if live > i64::from(a.max) && c.available + c.provisioning > 0 {
                out.push(Finding {
                    check: "pool-above-ceiling",
                    class: Class::Settled,
                    subject: format!("pool {pool}"),
                    detail: format!(
                        "autoscaling.max is {} but the pool has {live} VMs (available {}, claiming {}, leased {}, provisioning {}); only leases outliving a lowered max may hold it there, and these are not all leased",
                        a.max, c.available, c.claiming, c.leased, c.provisioning
                    ),
                    look_at: look_at_pool(&pool),
                });
            }
        }
        let look_at = look_at_pool(&pool);
        let ceiling = p.autoscaling.as_ref().map(|a| a.max);
        let missing =
            poolmgr_core::reconcile::strategy::wants_within(desired_new(strategy, size, min_size, c), ceiling, c);
        if missing > 0 {
            out.push(Finding {
                check: "pool-below-size",
                class: Class::Settled,
                subject: format!("pool {pool}"),
                detail: format!(
                    "size {size} ({strategy_s}) but {missing} more VMs are wanted (available {}, leased {}, provisioning {})",
                    c.available, c.leased, c.provisioning
                ),
                look_at: look_at.clone(),
            });
        }
        let extra = surplus(strategy, size, c);
        if extra > 0 {
            out.push(Finding {
                check: "pool-above-size",
                class: Class::Settled,
                subject: format!("pool {pool}"),
                detail: format!(
                    "size {size} ({strategy_s}) but {extra} AVAILABLE VMs too many (available {}, leased {}, provisioning {})",
                    c.available, c.leased, c.provisioning
                ),
                look_at,
            });
        }
    }
    Ok(())
}

fn look_at_pool(pool: &str) -> String {
    format!(
        "poolmgrctl pool status {pool}; SELECT phase, count(*) FROM vms WHERE pool_namespace || '/' || pool_name = '{pool}' GROUP BY 1"
    )
}

/// How [`run`] goes about it.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// One round; settled checks are reported as notes only.
    Once,
    /// One round; settled checks are violations too.
    Settled,
    /// Rounds until the settled checks pass (or an always-check fails), at most this long;
    /// then as [`Mode::Settled`].
    WaitSettled(Duration),
}

/// The verdict of [`run`], mapped to the exit code by the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Clean,
    Violations,
    CouldNotCheck,
}

impl Verdict {
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Clean => 0,
            Verdict::Violations => 1,
            Verdict::CouldNotCheck => 2,
        }
    }
}

/// Runs the checks as `mode` says, printing progress on stderr and the findings and a
/// summary line (`poolmgr-check: …`) on stdout.
pub async fn run(opts: &Options, mode: Mode) -> (Verdict, Option<Outcome>) {
    let t0 = Instant::now();
    let settled = !matches!(mode, Mode::Once);
    let mut last_progress = Instant::now();
    let outcome = loop {
        let round = check_once(opts).await;
        let wait = match mode {
            Mode::WaitSettled(d) => Some(d),
            _ => None,
        };
        let ready = match &round {
            Ok(o) => o.violations(true).is_empty() || o.findings.iter().any(|f| f.class == Class::Always),
            Err(_) => false,
        };
        match wait {
            Some(limit) if !ready && t0.elapsed() < limit => {
                if last_progress.elapsed() >= Duration::from_secs(2) {
                    last_progress = Instant::now();
                    let what = match &round {
                        Ok(o) => summarize_kinds(&o.violations(true)),
                        Err(e) => e.to_string(),
                    };
                    eprintln!(
                        "poolmgr-check: waiting to settle ({:.0}s of {:.0}s): {what}",
                        t0.elapsed().as_secs_f64(),
                        limit.as_secs_f64()
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            _ => break round,
        }
    };
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => {
            println!("poolmgr-check: could not check: {e}");
            return (Verdict::CouldNotCheck, None);
        }
    };
    let violations = outcome.violations(settled);
    for v in &violations {
        println!("VIOLATION {v}");
    }
    if !settled {
        for f in outcome.findings.iter().filter(|f| f.class == Class::Settled) {
            println!("note (not settled yet; checked with --settled) {f}");
        }
    }
    let s = &outcome.stats;
    let verdict = if !violations.is_empty() {
        if violations.iter().all(|v| v.check == "flintlock-unreachable") {
            Verdict::CouldNotCheck
        } else {
            Verdict::Violations
        }
    } else {
        // Without --settled an unreachable host only limits the notes.
        Verdict::Clean
    };
    println!(
        "poolmgr-check: {} ({} violations; pools={} vms={} leases={} hosts={} flintlock_vms={}; {}{} in {:.1}s)",
        match verdict {
            Verdict::Clean => "CLEAN",
            Verdict::Violations => "VIOLATIONS",
            Verdict::CouldNotCheck => "COULD NOT CHECK",
        },
        violations.len(),
        s.pools,
        s.vms,
        s.leases,
        s.hosts,
        s.flintlock_vms,
        if settled { "always + settled checks" } else { "always checks" },
        if outcome.unreachable.is_empty() {
            String::new()
        } else {
            format!(", {} host(s) unreachable", outcome.unreachable.len())
        },
        t0.elapsed().as_secs_f64()
    );
    (verdict, Some(outcome))
}

/// `3 vm-in-transition, 1 pool-below-size`.
fn summarize_kinds(findings: &[&Finding]) -> String {
    let mut kinds: Vec<(&str, usize)> = vec![];
    for f in findings {
        match kinds.iter_mut().find(|(k, _)| *k == f.check) {
            Some((_, n)) => *n += 1,
            None => kinds.push((f.check, 1)),
        }
    }
    kinds.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", ")
}
