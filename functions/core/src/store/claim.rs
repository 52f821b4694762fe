//! The claim statements: one VM picked, leased and logged in one call of the server-side
//! function `lease_claim` ([`LEASE_CLAIM_SQL`], [`lease_claim`]; migration V10), and the
//! two-phase claim of pools with pre-lease hooks ([`vm_claim_for_hook`], then
//! [`lease_insert_after_hook`]). They write `vms`, `leases` and `events` at once and share the
//! pick (the SQL function `vm_pick_available`), so they live together rather than in those
//! tables' files.
//!
//! A claim never waits on a row another claimer holds (SKIP LOCKED) and never leaves a VM
//! LEASED without its lease: the lease INSERT comes first and the VM UPDATE follows only when
//! it wrote a row. The one statement here that waits is [`vm_wait_for_claimers`], which only a
//! claim with a request_id runs, and only after it found no VM.

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::lease::lease_view;
use super::{Executor, HostRow, LeaseRow, LeaseView, Result, Timed, VmRow, json_col, timed};
use crate::domain::PoolRef;

/// What one call of `lease_claim` found or did. The hosts in its views carry no credentials
/// (`ca_pem`, `cert_pem`, `key_pem` and `basic_auth_token` are `None`, V14): a claim answers
/// with the host's name and address and never calls flintlock with it.
pub enum ClaimOutcome {
    PoolNotFound,
    /// The request_id already has a lease (maybe on another pool, maybe expired but not yet
    /// swept): nothing was claimed. `db_now` is the database's clock when the statement ran,
    /// for the caller's "is it still live" check.
    Existing {
        view: Box<LeaseView>,
        db_now: DateTime<Utc>,
    },
    /// Every AVAILABLE VM was gone or locked by a claim in flight (maybe one with this
    /// request_id: see [`vm_wait_for_claimers`]).
    NoVmAvailable,
    /// A concurrent claim with the same (principal, request_id) committed its lease first.
    /// Nothing was changed: the VM this claim picked is still AVAILABLE.
    DuplicateRequestId,
    /// The pool runs pre-lease commands: nothing was claimed; use the two-phase claim.
    NeedsPreLeaseHook,
    Claimed(Box<LeaseView>),
}

/// The claim: one call of the server-side function `lease_claim` (migration V10), which does
/// the replay lookup, the pick, the lease insert, the VM update and the event in one
/// statement, so one round trip and one implicit transaction. Parameters: $1 namespace,
/// $2 pool name, $3 new lease id, $4 request_id (NULL for none), $5 principal. Public so
/// `poolmgr-bench` can run the very same call through pgbench.
///
/// The statement itself is trivial to plan; the function's own statements are planned by
/// PL/pgSQL once per server connection and kept there, which survives a transaction pooler
/// (RDS Proxy, PgBouncer) that cannot keep a client's named prepared statement. Its
/// `SET enable_seqscan = off` keeps those kept plans on the indexes whatever the statistics
/// said when they were made (docs/design-notes.md, "Issue 12 section 4").
pub const LEASE_CLAIM_SQL: &str = "SELECT * FROM lease_claim($1, $2, $3, $4, $5)";

/// The claim: pick one AVAILABLE VM, write its lease and VM_CLAIMED, mark it LEASED, or find
/// the lease the request_id already has — one call of [`LEASE_CLAIM_SQL`].
///
/// The function inserts the lease before it updates the VM: when the request_id index
/// rejects the lease (a concurrent duplicate won), the VM is left AVAILABLE and nothing is
/// written — the rollback is built in.
///
/// `prepare`: send the call as a statement prepared once on this connection (deadpool's
/// per-connection cache), saving its parse and plan; off behind a transaction pooler that
/// cannot keep named statements (`POOLMGR_DB_PREPARE_CLAIM`). The one entry point of a
/// claim, so a caller may retry it whole.
pub async fn lease_claim(
    c: &crate::db::Conn,
    prepare: bool,
    pool: &PoolRef,
    lease_id: &str,
    request_id: Option<&str>,
    principal: &str,
) -> Result<ClaimOutcome> {
    if !prepare {
        return lease_claim_on(c, pool, lease_id, request_id, principal).await;
    }
    let cached = c.wrapper();
    let stmt = timed(c, || cached.prepare_typed_cached(LEASE_CLAIM_SQL, &[Type::TEXT; 5])).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&pool.namespace, &pool.name, &lease_id, &request_id, &principal];
    claim_outcome(&timed(c, || c.pg().query_one(&stmt, &params)).await?)
}

/// [`lease_claim`] on any executor (a transaction: a claim under a quota), never prepared.
pub async fn lease_claim_on(
    c: &impl Executor,
    pool: &PoolRef,
    lease_id: &str,
    request_id: Option<&str>,
    principal: &str,
) -> Result<ClaimOutcome> {
    let row = c
        .timed_query_one(
            LEASE_CLAIM_SQL,
            &[
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&lease_id, Type::TEXT),
                (&request_id, Type::TEXT),
                (&principal, Type::TEXT),
            ],
        )
        .await?;
    claim_outcome(&row)
}

fn claim_outcome(row: &tokio_postgres::Row) -> Result<ClaimOutcome> {
    if !row.try_get::<_, bool>("pool_found")? {
        return Ok(ClaimOutcome::PoolNotFound);
    }
    if let Some(view) = existing_view(row)? {
        return Ok(ClaimOutcome::Existing { view: Box::new(view), db_now: row.try_get("db_now")? });
    }
    if row.try_get::<_, bool>("has_hooks")? {
        return Ok(ClaimOutcome::NeedsPreLeaseHook);
    }
    if row.try_get::<_, Option<String>>("picked")?.is_none() {
        return Ok(ClaimOutcome::NoVmAvailable);
    }
    if json_col::<LeaseRow>(row, "lease")?.is_none() {
        return Ok(ClaimOutcome::DuplicateRequestId);
    }
    Ok(ClaimOutcome::Claimed(Box::new(lease_view(row)?)))
}

/// The lease (with its VM and host) in the columns `existing_lease`, `existing_vm` and
/// `existing_host` of a claim statement's row, if there is one.
fn existing_view(row: &tokio_postgres::Row) -> Result<Option<LeaseView>> {
    Ok(match json_col::<LeaseRow>(row, "existing_lease")? {
        Some(lease) => {
            Some(LeaseView { lease, vm: json_col(row, "existing_vm")?, host: json_col(row, "existing_host")? })
        }
        None => None,
    })
}

/// What the first transaction of a two-phase claim found or took.
pub struct HookClaim {
    pub pool_found: bool,
    /// The request_id's lease, if it has one (maybe on another pool, maybe expired): nothing
    /// was taken.
    pub existing: Option<LeaseView>,
    /// The VM a claim with the same (principal, request_id) is running its pre-lease hook on
    /// (its first transaction committed, its lease does not exist yet): nothing was taken.
    pub in_flight: Option<VmRow>,
    /// The VM taken (now PRE_LEASE_HOOK_RUNNING), when none of the above.
    pub vm: Option<VmRow>,
    pub host: Option<HostRow>,
    pub commands: Vec<String>,
    /// The database's clock when the statement ran.
    pub db_now: DateTime<Utc>,
}

/// First transaction of a two-phase claim: one AVAILABLE VM → PRE_LEASE_HOOK_RUNNING, the
/// claim's (principal, request_id) written on it (no lease yet). Same pick as
/// [`lease_claim`]; nothing is taken when the request_id already has a lease or a hook claim
/// in flight.
///
/// The unique index `vms_hook_claim_request_id` (V6) guards the key while the hook runs: a
/// concurrent first transaction with the same key that committed after this statement's
/// snapshot makes this UPDATE wait for it and then fail with
/// [`super::StoreError::UniqueViolation`] (nothing changed; look again).
pub async fn vm_claim_for_hook(
    c: &impl Executor,
    pool: &PoolRef,
    principal: &str,
    request_id: Option<&str>,
) -> Result<HookClaim> {
    let row = c
        .timed_query_one(
            "WITH pool AS (
                 SELECT pre_lease_commands FROM pools WHERE namespace = $1 AND name = $2
             ), existing AS (
                 SELECT * FROM leases WHERE $4::text IS NOT NULL AND principal = $3 AND request_id = $4
             ), in_flight AS (
                 -- Served by vms_hook_claim_request_id: at most one row.
                 SELECT * FROM vms
                 WHERE $4::text IS NOT NULL AND claim_principal = $3 AND claim_request_id = $4
                   AND phase = 'PRE_LEASE_HOOK_RUNNING'
             ), go AS (
                 SELECT 1 FROM pool
                 WHERE NOT EXISTS (SELECT 1 FROM existing) AND NOT EXISTS (SELECT 1 FROM in_flight)
             ), picked AS (
                 -- One AVAILABLE VM, row locked: the claim's own pick (V10).
                 SELECT vm_pick_available($1, $2) AS id FROM go
             ), upd AS (
                 UPDATE vms v SET phase = 'PRE_LEASE_HOOK_RUNNING', hook_started_at = now(), updated_at = now(),
                                  claim_principal = $3, claim_request_id = $4
                 FROM picked, pool WHERE v.id = picked.id
                 RETURNING v.*
             )
             SELECT EXISTS (SELECT 1 FROM pool) AS pool_found,
                    coalesce((SELECT pre_lease_commands FROM pool), '{}') AS commands,
                    to_jsonb(upd) AS vm, to_jsonb(h) AS host,
                    to_jsonb(e) AS existing_lease, to_jsonb(ev_vm) AS existing_vm,
                    to_jsonb(ev_h) - ARRAY['ca_pem', 'cert_pem', 'key_pem', 'basic_auth_token', 'credentials_key_id', 'credentials_dek'] AS existing_host,
                    to_jsonb(f) AS in_flight, now() AS db_now
             FROM (SELECT 1) AS one
             LEFT JOIN upd ON true
             LEFT JOIN hosts h ON h.name = upd.flintlock_host
             LEFT JOIN existing e ON true
             LEFT JOIN vms ev_vm ON ev_vm.id = e.vm_id
             LEFT JOIN hosts ev_h ON ev_h.name = ev_vm.flintlock_host
             LEFT JOIN in_flight f ON true",
            &[
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&principal, Type::TEXT),
                (&request_id, Type::TEXT),
            ],
        )
        .await?;
    Ok(HookClaim {
        pool_found: row.try_get("pool_found")?,
        existing: existing_view(&row)?,
        in_flight: json_col(&row, "in_flight")?,
        vm: json_col(&row, "vm")?,
        host: json_col(&row, "host")?,
        commands: row.try_get("commands")?,
        db_now: row.try_get("db_now")?,
    })
}

/// Where a hook claim of (principal, request_id) stands, for a duplicate waiting on it.
pub struct HookClaimState {
    /// Its lease, once transaction 2 committed.
    pub existing: Option<LeaseView>,
    /// Its VM while the hook still runs.
    pub in_flight: Option<VmRow>,
    pub db_now: DateTime<Utc>,
}

/// The lease of (principal, request_id), and the VM a claim with that key is running its
/// pre-lease hook on: one read, so a duplicate sees the hook claim either still running or
/// with its lease (transaction 2 changes both at once).
pub async fn claim_get_by_request_id(c: &impl Executor, principal: &str, request_id: &str) -> Result<HookClaimState> {
    let row = c
        .timed_query_one(
            "SELECT to_jsonb(e) AS existing_lease, to_jsonb(ev_vm) AS existing_vm,
                    to_jsonb(ev_h) - ARRAY['ca_pem', 'cert_pem', 'key_pem', 'basic_auth_token', 'credentials_key_id', 'credentials_dek'] AS existing_host,
                    to_jsonb(f) AS in_flight, now() AS db_now
             FROM (SELECT 1) AS one
             LEFT JOIN leases e ON e.principal = $1 AND e.request_id = $2
             LEFT JOIN vms ev_vm ON ev_vm.id = e.vm_id
             LEFT JOIN hosts ev_h ON ev_h.name = ev_vm.flintlock_host
             LEFT JOIN vms f ON f.claim_principal = $1 AND f.claim_request_id = $2
                            AND f.phase = 'PRE_LEASE_HOOK_RUNNING'",
            &[(&principal, Type::TEXT), (&request_id, Type::TEXT)],
        )
        .await?;
    Ok(HookClaimState {
        existing: existing_view(&row)?,
        in_flight: json_col(&row, "in_flight")?,
        db_now: row.try_get("db_now")?,
    })
}

/// Waits until no transaction holds a row lock on an AVAILABLE VM of the pool, without
/// claiming anything. A claim with a request_id that found no VM runs it before it looks
/// again: the VMs it skipped were locked by claims in flight, and one of them may be a claim
/// of the same request_id whose lease its snapshot could not see yet. Once their
/// transactions ended, that lease (or that hook claim's VM) is committed, and the next look
/// finds it.
///
/// FOR SHARE conflicts with a claim's FOR NO KEY UPDATE, so it queues behind each holder;
/// a row that stopped being AVAILABLE meanwhile is rechecked and dropped. Its own share locks
/// last only until this statement ends (a claimer meeting one skips that VM, as it skips any
/// VM being claimed), and share locks do not conflict with each other.
pub async fn vm_wait_for_claimers(c: &impl Executor, pool: &PoolRef) -> Result<()> {
    c.timed_query_one(
        "SELECT count(*) FROM (
             SELECT id FROM vms
             WHERE pool_namespace = $1 AND pool_name = $2 AND phase = 'AVAILABLE'
             FOR SHARE
         ) waited",
        &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
    )
    .await?;
    Ok(())
}

pub enum HookLease {
    /// The VM is no longer PRE_LEASE_HOOK_RUNNING (DELETING, or its row is gone): a forced
    /// pool delete took it during the hook. Nothing was written.
    VmTaken,
    /// A concurrent claim with the same request_id won; nothing was written and the VM is
    /// still PRE_LEASE_HOOK_RUNNING (the caller gives it back).
    DuplicateRequestId,
    Claimed(Box<LeaseView>),
}

/// Second transaction of a two-phase claim: the lease, the VM → LEASED and VM_CLAIMED, only
/// while the VM is still PRE_LEASE_HOOK_RUNNING (DELETING is terminal). As in
/// [`lease_claim`], the INSERT runs before the UPDATE, so a rejected request_id changes
/// nothing.
pub async fn lease_insert_after_hook(
    c: &impl Executor,
    vm_id: &str,
    lease_id: &str,
    request_id: Option<&str>,
    principal: &str,
    claim_started: Option<DateTime<Utc>>,
) -> Result<HookLease> {
    let row = c
        .timed_query_one(
            "WITH vm AS (
                 -- $5: this claim's hook_started_at: the VM is still *this* claim's (issue 23
                 -- finding 5: not another claim's after a give-back and a new claim).
                 SELECT v.id, v.pool_namespace, v.pool_name FROM vms v
                 WHERE v.id = $1 AND v.phase = 'PRE_LEASE_HOOK_RUNNING' AND v.hook_started_at = $5
                 FOR NO KEY UPDATE
             ), pool AS (
                 -- The first deadline, never past max_lease_seconds (V23).
                 SELECT least(p.heartbeat_expiry_seconds, coalesce(p.max_lease_seconds, p.heartbeat_expiry_seconds))
                            AS heartbeat_expiry_seconds
                 FROM pools p, vm
                 WHERE p.namespace = vm.pool_namespace AND p.name = vm.pool_name
             ), ins AS (
                 INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at,
                                     last_heartbeat_at, expires_at, request_id, principal)
                 SELECT $2, vm.id, vm.pool_namespace, vm.pool_name, now(), now(),
                        now() + make_interval(secs => pool.heartbeat_expiry_seconds), $3, $4
                 FROM vm, pool
                 ON CONFLICT (principal, request_id) WHERE request_id IS NOT NULL DO NOTHING
                 RETURNING *
             ), upd AS (
                 UPDATE vms v SET phase = 'LEASED', lease_id = ins.lease_id, hook_started_at = NULL, updated_at = now()
                 FROM ins WHERE v.id = ins.vm_id
                 RETURNING v.*
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_CLAIMED', ins.pool_namespace, ins.pool_name, ins.vm_id, ins.lease_id FROM ins
             )
             SELECT EXISTS (SELECT 1 FROM vm) AND EXISTS (SELECT 1 FROM pool) AS vm_ok,
                    to_jsonb(ins) AS lease, to_jsonb(upd) AS vm,
                    -- The answer needs the host's name and address only.
                    to_jsonb(h) - ARRAY['ca_pem', 'cert_pem', 'key_pem', 'basic_auth_token', 'credentials_key_id', 'credentials_dek'] AS host
             FROM (SELECT 1) AS one
             LEFT JOIN ins ON true
             LEFT JOIN upd ON true
             LEFT JOIN hosts h ON h.name = upd.flintlock_host",
            &[
                (&vm_id, Type::TEXT),
                (&lease_id, Type::TEXT),
                (&request_id, Type::TEXT),
                (&principal, Type::TEXT),
                (&claim_started, Type::TIMESTAMPTZ),
            ],
        )
        .await?;
    if !row.try_get::<_, bool>("vm_ok")? {
        return Ok(HookLease::VmTaken);
    }
    if json_col::<LeaseRow>(&row, "lease")?.is_none() {
        return Ok(HookLease::DuplicateRequestId);
    }
    Ok(HookLease::Claimed(Box::new(lease_view(&row)?)))
}
