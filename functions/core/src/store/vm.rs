//! The `vms` table: [`VmRow`] and the `vm_*` statements: reads, placement of a new VM,
//! phase transitions (each with its event, in the same statement), backoff, hook progress,
//! surplus and teardown.
//!
//! Never moves a VM out of DELETING: every transition is guarded by the phase it leaves.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_postgres::types::Type;

use super::{Executor, HostRow, LeaseRow, Result, Timed, json_col, json_req};
use crate::domain::{EventType, Phase, PoolRef, VmCounts};

/// A `vms` row.
#[derive(Debug, Clone, Deserialize)]
pub struct VmRow {
    pub id: String,
    pub uid: Option<String>,
    pub pool_namespace: String,
    pub pool_name: String,
    pub flintlock_host: String,
    pub phase: Phase,
    pub lease_id: Option<String>,
    pub network_interfaces: serde_json::Value,
    pub attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub hook_step: i32,
    pub hook_started_at: Option<DateTime<Utc>>,
    /// The pool's revision the VM was created from (V18).
    #[serde(default = "super::pool::first_revision")]
    pub revision: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl VmRow {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.pool_namespace.clone(), name: self.pool_name.clone() }
    }
}

/// The VMs of the pool named by the columns `p.namespace` and `p.name` of the enclosing
/// query, counted by phase into one jsonb object that decodes into [`VmCounts`]. The one
/// definition of these counts: every statement that counts a pool's VMs by phase uses it.
pub(super) const VM_COUNTS_OF_POOL_P: &str = "
    (SELECT jsonb_build_object(
        'available',    count(*) FILTER (WHERE v.phase = 'AVAILABLE'),
        'claiming',     count(*) FILTER (WHERE v.phase = 'PRE_LEASE_HOOK_RUNNING'
                                            OR (v.phase = 'LEASED' AND l.lease_id IS NULL)),
        'leased',       count(*) FILTER (WHERE v.phase = 'LEASED' AND l.lease_id IS NOT NULL),
        'provisioning', count(*) FILTER (WHERE v.phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING')),
        'quarantined',  count(*) FILTER (WHERE v.phase = 'QUARANTINED'),
        'deleting',     count(*) FILTER (WHERE v.phase = 'DELETING'),
        -- leases.vm_id is UNIQUE: the join never repeats a VM.
        'rows',         count(*))
     FROM vms v LEFT JOIN leases l ON l.vm_id = v.id
     WHERE v.pool_namespace = p.namespace AND v.pool_name = p.name)";

/// One pool's VMs counted by phase (`VM_COUNTS_OF_POOL_P`): what the replenishment
/// strategies count after a pass's steps.
pub async fn vm_counts_for_pool(c: &impl Executor, pool: &PoolRef) -> Result<VmCounts> {
    let row = c
        .timed_query_one(
            &format!("SELECT {VM_COUNTS_OF_POOL_P} AS counts FROM (SELECT $1::text AS namespace, $2::text AS name) p"),
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    json_req(&row, "counts")
}

pub async fn vm_get(c: &impl Executor, id: &str) -> Result<Option<VmRow>> {
    let row = c.timed_query_opt("SELECT to_jsonb(v) AS vm FROM vms v WHERE v.id = $1", &[(&id, Type::TEXT)]).await?;
    row.as_ref().map(|r| json_req(r, "vm")).transpose()
}

/// One page of VMs by id, after `after` (a page's last id; `""`: from the first), at most
/// `limit`.
pub async fn vm_list(
    c: &impl Executor,
    namespace: Option<&str>,
    pool: Option<&str>,
    phase: Option<Phase>,
    after: &str,
    limit: i64,
) -> Result<Vec<VmRow>> {
    let phase = phase.map(Phase::as_str);
    let rows = c
        .timed_query(
            "SELECT to_jsonb(v) AS vm FROM vms v
             WHERE ($1::text IS NULL OR v.pool_namespace = $1)
               AND ($2::text IS NULL OR v.pool_name = $2)
               AND ($3::text IS NULL OR v.phase = $3)
               AND v.id > $4
             ORDER BY v.id
             LIMIT $5",
            &[
                (&namespace, Type::TEXT),
                (&pool, Type::TEXT),
                (&phase, Type::TEXT),
                (&after, Type::TEXT),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "vm")).collect()
}

/// The fields of a new VM row.
pub struct VmInsert<'a> {
    pub id: &'a str,
    pub uid: Option<&'a str>,
    pub pool: &'a PoolRef,
    pub flintlock_host: &'a str,
    pub phase: Phase,
    pub network_interfaces: &'a serde_json::Value,
}

pub async fn vm_insert(c: &impl Executor, vm: &VmInsert<'_>) -> Result<VmRow> {
    let phase = vm.phase.as_str();
    let row = c
        .timed_query_one(
            "INSERT INTO vms AS v (id, uid, pool_namespace, pool_name, flintlock_host, phase, network_interfaces, revision)
             VALUES ($1, $2, $3, $4, $5, $6, $7,
                     coalesce((SELECT revision FROM pools WHERE namespace = $3 AND name = $4), 1))
             RETURNING to_jsonb(v) AS vm",
            &[
                (&vm.id, Type::TEXT),
                (&vm.uid, Type::TEXT),
                (&vm.pool.namespace, Type::TEXT),
                (&vm.pool.name, Type::TEXT),
                (&vm.flintlock_host, Type::TEXT),
                (&phase, Type::TEXT),
                (vm.network_interfaces, Type::JSONB),
            ],
        )
        .await?;
    json_req(&row, "vm")
}

pub enum VmFinish {
    /// The row was already gone (another deleter finished first).
    Gone,
    /// The row is removed, with the lease it still had (a release being finished).
    Removed { vm: Box<VmRow>, lease: Option<Box<LeaseRow>> },
}

/// Removes a DELETING VM's row, and its lease if one is left, once flintlock confirmed the
/// delete. A lease still present means a release is being finished: VM_DELETED_ON_RELEASE is
/// written in the same transaction. Expiry and pool delete wrote their events when they
/// marked the VM.
pub async fn vm_finish_delete(c: &impl Executor, vm_id: &str) -> Result<VmFinish> {
    let row = c
        .timed_query_one(
            "WITH v AS (
                 DELETE FROM vms WHERE id = $1 AND phase = 'DELETING' RETURNING *
             ), l AS (
                 DELETE FROM leases WHERE vm_id = (SELECT id FROM v) RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_DELETED_ON_RELEASE', l.pool_namespace, l.pool_name, l.vm_id, l.lease_id FROM l
             )
             SELECT (SELECT to_jsonb(v) FROM v) AS vm, (SELECT to_jsonb(l) FROM l) AS lease",
            &[(&vm_id, Type::TEXT)],
        )
        .await?;
    Ok(match json_col::<VmRow>(&row, "vm")? {
        None => VmFinish::Gone,
        Some(vm) => VmFinish::Removed { vm: Box::new(vm), lease: json_col::<LeaseRow>(&row, "lease")?.map(Box::new) },
    })
}

/// What [`vm_begin_discard`] found.
pub enum VmDiscard {
    NotFound,
    /// LEASED: refused, its lease is released instead. Nothing changed.
    Leased,
    /// DELETING now, `from` the phase it left (DELETING itself when an earlier delete, a
    /// release or the reconciler got there first), with its host for the flintlock delete.
    Deleting {
        vm: Box<VmRow>,
        host: Option<Box<HostRow>>,
        from: Phase,
    },
}

/// The first half of an operator's `DELETE /v1/vms/{id}`: any VM but a LEASED one →
/// DELETING, with VM_DISCARDED (`by`: the principal) in the same statement. The row lock
/// waits for a claim holding the VM, so a VM a concurrent claim leases is seen LEASED and
/// refused; one taken mid pre-lease hook goes DELETING and that claim answers ABORTED.
pub async fn vm_begin_discard(c: &impl Executor, vm_id: &str, by: &str) -> Result<VmDiscard> {
    let row = c
        .timed_query_opt(
            "WITH cur AS (
                 SELECT v.* FROM vms v WHERE v.id = $1 FOR NO KEY UPDATE
             ), moved AS (
                 UPDATE vms v SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now()
                 FROM cur WHERE v.id = cur.id AND cur.phase NOT IN ('LEASED', 'DELETING')
                 RETURNING v.*
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT 'VM_DISCARDED', m.pool_namespace, m.pool_name, m.id,
                        jsonb_build_object('phase', cur.phase, 'by', $2::text)
                 FROM moved m, cur
             )
             -- The CTEs share one snapshot: `cur` still shows the phase it had before.
             SELECT to_jsonb(cur.phase) AS was, coalesce((SELECT to_jsonb(m) FROM moved m), to_jsonb(cur)) AS vm,
                    to_jsonb(h) AS host
             FROM cur LEFT JOIN hosts h ON h.name = cur.flintlock_host",
            &[(&vm_id, Type::TEXT), (&by, Type::TEXT)],
        )
        .await?;
    let Some(row) = row else { return Ok(VmDiscard::NotFound) };
    let from: Phase = json_req(&row, "was")?;
    if from == Phase::Leased {
        return Ok(VmDiscard::Leased);
    }
    let host = json_col::<HostRow>(&row, "host")?.map(Box::new);
    Ok(VmDiscard::Deleting { vm: Box::new(json_req(&row, "vm")?), host, from })
}

/// Every VM row of a pool with whether it has a committed lease.
pub async fn vm_list_for_pool(c: &impl Executor, pool: &PoolRef) -> Result<Vec<(VmRow, bool)>> {
    let rows = c
        .timed_query(
            "SELECT to_jsonb(v) AS vm, EXISTS (SELECT 1 FROM leases l WHERE l.vm_id = v.id) AS has_lease
             FROM vms v WHERE v.pool_namespace = $1 AND v.pool_name = $2 ORDER BY v.created_at, v.id",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    rows.iter().map(|r| Ok((json_req(r, "vm")?, r.try_get("has_lease")?))).collect()
}

/// Inserts a PROVISIONING intent row on the least-loaded eligible host of the pool, in one
/// statement. Eligible: named by the pool, registered, not cordoned, not in `skip`, not found
/// unreachable a moment ago (`unreachable_until`, [`super::host_mark_unreachable`]). Load:
/// this pool's VMs on the host, DELETING and FAILED not counted; ties go to the host listed
/// first. The chosen host row is share-locked, so a cordon committing meanwhile waits for
/// this insert (and the next placement sees it). `None`: no eligible host.
pub async fn vm_place_and_insert(
    c: &impl Executor,
    pool: &PoolRef,
    id: &str,
    skip: &[String],
) -> Result<Option<VmRow>> {
    let row = c
        .timed_query_opt(
            "WITH p AS (
                 -- KEY SHARE conflicts with a concurrent pool delete: either the delete waits
                 -- and then marks this new row DELETING too, or this insert waits and finds
                 -- the pool gone. A PROVISIONING row can never outlive its pool.
                 SELECT flintlock_hosts, revision FROM pools WHERE namespace = $1 AND name = $2 FOR KEY SHARE
             ), eligible AS (
                 SELECT h.name, array_position(p.flintlock_hosts, h.name) AS ord
                 FROM hosts h, p
                 WHERE h.name = ANY (p.flintlock_hosts) AND NOT h.cordoned AND NOT (h.name = ANY ($4))
                   AND (h.unreachable_until IS NULL OR h.unreachable_until <= now())
                 FOR SHARE OF h
             ), pick AS (
                 SELECT e.name FROM eligible e
                 ORDER BY (SELECT count(*) FROM vms v
                           WHERE v.flintlock_host = e.name AND v.pool_namespace = $1 AND v.pool_name = $2
                             AND v.phase NOT IN ('DELETING', 'FAILED')),
                          e.ord
                 LIMIT 1
             )
             INSERT INTO vms AS v (id, pool_namespace, pool_name, flintlock_host, phase, revision)
             SELECT $3, $1, $2, pick.name, 'PROVISIONING', p.revision FROM pick, p
             RETURNING to_jsonb(v) AS vm",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&id, Type::TEXT), (&skip, Type::TEXT_ARRAY)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "vm")).transpose()
}

/// Records flintlock's uid on an intent row (after CreateMicroVM, or adoption), and the
/// revision whose template the create used (`None`: adopted, the row's is kept).
pub async fn vm_set_uid(
    c: &impl Executor,
    vm_id: &str,
    uid: &str,
    event: EventType,
    revision: Option<i32>,
) -> Result<bool> {
    let kind = event.as_str();
    let n = c
        .timed_execute(
            "WITH v AS (
                 UPDATE vms SET uid = $2, attempts = 0, next_attempt_at = NULL, updated_at = now(),
                                revision = coalesce($4, revision)
                 WHERE id = $1 AND uid IS NULL AND phase = 'PROVISIONING'
                 RETURNING *
             )
             INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
             SELECT $3, v.pool_namespace, v.pool_name, v.id, jsonb_build_object('uid', v.uid, 'host', v.flintlock_host)
             FROM v",
            &[(&vm_id, Type::TEXT), (&uid, Type::TEXT), (&kind, Type::TEXT), (&revision, Type::INT4)],
        )
        .await?;
    Ok(n == 1)
}

/// Moves a VM from one phase to another (never out of DELETING: the guard is the `from`
/// phase), recording interfaces when given and writing `event` in the same statement.
/// `false` if the VM was not in `from` any more.
pub async fn vm_transition(
    c: &impl Executor,
    vm_id: &str,
    from: Phase,
    to: Phase,
    network_interfaces: Option<&serde_json::Value>,
    event: Option<(EventType, &serde_json::Value)>,
) -> Result<bool> {
    let (from, to) = (from.as_str(), to.as_str());
    let (kind, payload) = match event {
        Some((k, p)) => (Some(k.as_str()), Some(super::event::stored_payload(p))),
        None => (None, None),
    };
    let row = c
        .timed_query_one(
            "WITH v AS (
                 UPDATE vms SET phase = $3, network_interfaces = coalesce($4, network_interfaces),
                     attempts = 0, next_attempt_at = NULL, updated_at = now(),
                     hook_step = 0,
                     hook_started_at = CASE WHEN $3 IN ('CREATE_HOOK_RUNNING', 'PRE_LEASE_HOOK_RUNNING')
                                            THEN now() END,
                     -- Only a LEASED VM names a lease.
                     lease_id = CASE WHEN $3 = 'LEASED' THEN lease_id END
                 WHERE id = $1 AND phase = $2
                 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT $5, v.pool_namespace, v.pool_name, v.id, coalesce($6, '{}'::jsonb) FROM v WHERE $5 IS NOT NULL
             )
             SELECT count(*) FROM v",
            &[
                (&vm_id, Type::TEXT),
                (&from, Type::TEXT),
                (&to, Type::TEXT),
                (&network_interfaces, Type::JSONB),
                (&kind, Type::TEXT),
                (&payload, Type::JSONB),
            ],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)? == 1)
}

/// [`vm_transition`] out of PRE_LEASE_HOOK_RUNNING for the claim that put the VM there
/// only: `claim_started` is that claim's `hook_started_at` (its first transaction's `now()`,
/// one per claim of the VM). A claim whose give-back or policy write is retried after a lost
/// reply would otherwise move *another* claim's VM once the first write had gone through and
/// the VM been claimed again (an ABA: issue 23 finding 5).
pub async fn vm_transition_hook_claim(
    c: &impl Executor,
    vm_id: &str,
    claim_started: Option<DateTime<Utc>>,
    to: Phase,
    event: Option<(EventType, &serde_json::Value)>,
) -> Result<bool> {
    let (kind, payload) = match event {
        Some((k, p)) => (Some(k.as_str()), Some(super::event::stored_payload(p))),
        None => (None, None),
    };
    let row = c
        .timed_query_one(
            "WITH v AS (
                 UPDATE vms SET phase = $2, attempts = 0, next_attempt_at = NULL, updated_at = now(),
                     hook_step = 0, hook_started_at = NULL, lease_id = NULL
                 WHERE id = $1 AND phase = 'PRE_LEASE_HOOK_RUNNING' AND hook_started_at = $3
                 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT $4, v.pool_namespace, v.pool_name, v.id, coalesce($5, '{}'::jsonb) FROM v WHERE $4 IS NOT NULL
             )
             SELECT count(*) FROM v",
            &[
                (&vm_id, Type::TEXT),
                (&to.as_str(), Type::TEXT),
                (&claim_started, Type::TIMESTAMPTZ),
                (&kind, Type::TEXT),
                (&payload, Type::JSONB),
            ],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)? == 1)
}

/// Backs a VM off after a failed step: attempts + 1, next try after an exponential delay
/// (`base * 2^attempts`, at most `cap`).
pub async fn vm_backoff(c: &impl Executor, vm_id: &str, base_seconds: f64, cap_seconds: f64) -> Result<()> {
    c.timed_execute(
        "UPDATE vms SET attempts = attempts + 1,
             next_attempt_at = now() + make_interval(secs => least($3, $2 * power(2, least(attempts, 20))))
         WHERE id = $1",
        &[(&vm_id, Type::TEXT), (&base_seconds, Type::FLOAT8), (&cap_seconds, Type::FLOAT8)],
    )
    .await?;
    Ok(())
}

/// Removes an intent row that never got a uid (its host stayed unreachable). The orphan scan
/// deletes the microVM should the create have reached flintlock after all.
pub async fn vm_delete_intent(c: &impl Executor, vm_id: &str) -> Result<bool> {
    let n = c
        .timed_execute(
            "DELETE FROM vms WHERE id = $1 AND uid IS NULL AND phase = 'PROVISIONING'",
            &[(&vm_id, Type::TEXT)],
        )
        .await?;
    Ok(n == 1)
}

/// DELETING VMs whose pool is gone (a deleted pool's stragglers), due for a retry. Each
/// returned VM's next attempt is pushed back first, so an overlapping pass skips it.
pub async fn vm_take_orphaned_deletions(c: &impl Executor, limit: i64) -> Result<Vec<VmRow>> {
    let rows = c
        .timed_query(
            "UPDATE vms v SET next_attempt_at = now() + interval '30 seconds'
             WHERE v.id IN (
                 SELECT id FROM vms x
                 WHERE x.phase = 'DELETING' AND (x.next_attempt_at IS NULL OR x.next_attempt_at <= now())
                   AND NOT EXISTS (SELECT 1 FROM pools p WHERE p.namespace = x.pool_namespace AND p.name = x.pool_name)
                 ORDER BY x.id
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             )
             RETURNING to_jsonb(v) AS vm",
            &[(&limit, Type::INT8)],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "vm")).collect()
}

/// The rows of the given VM ids: (id, host, uid).
pub async fn vm_identities(c: &impl Executor, ids: &[String]) -> Result<Vec<(String, String, Option<String>)>> {
    let rows = c
        .timed_query("SELECT id, flintlock_host, uid FROM vms WHERE id = ANY ($1)", &[(&ids, Type::TEXT_ARRAY)])
        .await?;
    rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))).collect()
}

/// One row of host `host` that [`vm_retire_on_dead_host`] would take (a uid-less intent,
/// PROVISIONING, CREATE_HOOK_RUNNING or AVAILABLE), as (id, uid), rows with a uid first: the
/// VM a dead judgement asks the host about once more. `None`: nothing to retire.
pub async fn vm_retirable_on_host(c: &impl Executor, host: &str) -> Result<Option<(String, Option<String>)>> {
    let row = c
        .timed_query_opt(
            "SELECT id, uid FROM vms WHERE flintlock_host = $1
                 AND phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING', 'AVAILABLE')
             ORDER BY uid IS NULL LIMIT 1",
            &[(&host, Type::TEXT)],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

/// Retires the rows on a host judged dead (issue 23 finding 2), in one statement, each with
/// VM_LOST (`payload` plus its phase): rows without a uid (creates never answered) are
/// dropped, and the orphan scan deletes their microVM should the host come back with one;
/// PROVISIONING, CREATE_HOOK_RUNNING and AVAILABLE rows become DELETING, so they stop
/// counting as the pool's (its replacements go to the other hosts) and are never handed out,
/// and their microVMs are deleted once the host answers again. LEASED and
/// PRE_LEASE_HOOK_RUNNING VMs are their claims', QUARANTINED ones the operator's: left alone.
/// Nothing is retired unless the host is still marked unreachable since `judged_since` (the
/// mark it was judged by). Returns how many rows it retired.
pub async fn vm_retire_on_dead_host(
    c: &impl Executor,
    host: &str,
    judged_since: chrono::DateTime<chrono::Utc>,
    payload: &serde_json::Value,
) -> Result<i64> {
    let payload = super::event::stored_payload(payload);
    let row = c
        .timed_query_one(
            "WITH judged AS (
                 -- The mark the host was judged by still stands: a pass that reached the host
                 -- meanwhile cleared or renewed it, and then nothing is retired.
                 SELECT 1 FROM hosts WHERE name = $1 AND unreachable_since = $3
             ), dropped AS (
                 DELETE FROM vms WHERE flintlock_host = $1 AND phase = 'PROVISIONING' AND uid IS NULL
                   AND EXISTS (SELECT 1 FROM judged)
                 RETURNING pool_namespace, pool_name, id, phase
             ), retired AS (
                 UPDATE vms v SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now(),
                     hook_step = 0, hook_started_at = NULL
                 FROM (SELECT id, phase AS was FROM vms
                       WHERE flintlock_host = $1 AND uid IS NOT NULL
                         AND phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING', 'AVAILABLE')
                         AND EXISTS (SELECT 1 FROM judged)
                       FOR UPDATE) old
                 WHERE v.id = old.id
                 RETURNING v.pool_namespace, v.pool_name, v.id, old.was AS phase
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT 'VM_LOST', x.pool_namespace, x.pool_name, x.id, $2 || jsonb_build_object('phase', x.phase)
                 FROM (SELECT * FROM dropped UNION ALL SELECT * FROM retired) x
             )
             SELECT (SELECT count(*) FROM dropped) + (SELECT count(*) FROM retired)",
            &[(&host, Type::TEXT), (&payload, Type::JSONB), (&judged_since, Type::TIMESTAMPTZ)],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// The phases whose rows must name a live microVM and that no other step polls: what the
/// orphan scan checks against flintlock's list ([`vm_missing_on_host`]). PROVISIONING rows
/// are polled by their own step; LEASED and PRE_LEASE_HOOK_RUNNING VMs are their claim's.
pub const PHASES_CHECKED_FOR_LOSS: [&str; 3] = ["AVAILABLE", "QUARANTINED", "CREATE_HOOK_RUNNING"];

/// VMs on `host` in [`PHASES_CHECKED_FOR_LOSS`] with a uid that is not in `present` (the
/// live microVMs flintlock just listed there): `(id, uid, phase)`, each to be confirmed by a
/// GetMicroVM before [`vm_forget_lost`] (a VM that became AVAILABLE after the list was taken
/// is simply not in it).
pub async fn vm_missing_on_host(
    c: &impl Executor,
    host: &str,
    present: &[String],
) -> Result<Vec<(String, String, Phase)>> {
    let phases: Vec<&str> = PHASES_CHECKED_FOR_LOSS.to_vec();
    let rows = c
        .timed_query(
            "SELECT id, uid, phase FROM vms
             WHERE flintlock_host = $1 AND uid IS NOT NULL AND phase = ANY ($3) AND NOT (uid = ANY ($2))",
            &[(&host, Type::TEXT), (&present, Type::TEXT_ARRAY), (&phases, Type::TEXT_ARRAY)],
        )
        .await?;
    rows.iter()
        .map(|r| {
            let phase: String = r.try_get(2)?;
            let phase = Phase::parse(&phase).ok_or_else(|| super::StoreError::Db(format!("vms.phase {phase:?}")))?;
            Ok((r.try_get(0)?, r.try_get(1)?, phase))
        })
        .collect()
}

/// Removes the row of a VM whose microVM flintlock no longer has (deleted behind poolmgr's
/// back, lost with a host's reboot), with VM_LOST in the same statement (payload: `uid`,
/// `host`, `phase`, `reason` = "its microVM is gone: {why}"), while it is still in `phase`
/// with `uid`: a claim that took the VM meanwhile keeps it. `false`: it had moved.
pub async fn vm_forget_lost(
    c: &impl Executor,
    vm_id: &str,
    uid: &str,
    phase: Phase,
    host: &str,
    why: &str,
) -> Result<bool> {
    let payload = super::event::stored_payload(
        &serde_json::json!({"uid": uid, "host": host, "phase": phase, "reason": format!("its microVM is gone: {why}")}),
    );
    let row = c
        .timed_query_one(
            "WITH v AS (
                 DELETE FROM vms WHERE id = $1 AND uid = $2 AND phase = $3
                 RETURNING pool_namespace, pool_name, id
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT 'VM_LOST', v.pool_namespace, v.pool_name, v.id, $4 FROM v
             )
             SELECT count(*) FROM v",
            &[(&vm_id, Type::TEXT), (&uid, Type::TEXT), (&phase.as_str(), Type::TEXT), (&payload, Type::JSONB)],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)? == 1)
}

/// Records that a CREATE_HOOK_RUNNING VM finished create command `step - 1`.
pub async fn vm_set_hook_step(c: &impl Executor, vm_id: &str, step: i32) -> Result<bool> {
    let n = c
        .timed_execute(
            "UPDATE vms SET hook_step = $2, attempts = 0, next_attempt_at = NULL, updated_at = now()
             WHERE id = $1 AND phase = 'CREATE_HOOK_RUNNING'",
            &[(&vm_id, Type::TEXT), (&step, Type::INT4)],
        )
        .await?;
    Ok(n == 1)
}

/// Marks DELETING every VM of `pools` stuck in PRE_LEASE_HOOK_RUNNING for longer than
/// `older_than_seconds` (every pool's in one statement): the claim that took it died
/// mid-hook. Never back to AVAILABLE: the hook may have half-run, and the VM must not be
/// handed out in an unknown state. Returns the VMs so marked.
pub async fn vm_recover_abandoned_claims(
    c: &impl Executor,
    pools: &[PoolRef],
    older_than_seconds: f64,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<VmRow>> {
    let (namespaces, names) = super::pool_work::pool_keys(pools);
    let rows = c
        .timed_query(
            "WITH v AS (
                 UPDATE vms SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now()
                 WHERE (pool_namespace, pool_name) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                   AND phase = 'PRE_LEASE_HOOK_RUNNING'
                   -- $4: the clock's now (NULL: the database's).
                   AND hook_started_at < coalesce($4, now()) - make_interval(secs => $3)
                 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT 'VM_HOOK_FAILED', v.pool_namespace, v.pool_name, v.id,
                        jsonb_build_object('hook', 'pre_lease', 'reason', 'claim abandoned mid-hook; VM deleted')
                 FROM v
             )
             SELECT to_jsonb(v) AS vm FROM v",
            &[
                (&namespaces, Type::TEXT_ARRAY),
                (&names, Type::TEXT_ARRAY),
                (&older_than_seconds, Type::FLOAT8),
                (&now, Type::TIMESTAMPTZ),
            ],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "vm")).collect()
}

/// Shrinks a pool whose size went down: up to `n` AVAILABLE VMs (stale ones first, then the oldest) → DELETING,
/// with VM_DELETED_ON_SCALE_DOWN. SKIP LOCKED: a VM being claimed right now is left alone.
pub async fn vm_mark_surplus(c: &impl Executor, pool: &PoolRef, n: i64) -> Result<u64> {
    c.timed_execute(
        "WITH picked AS (
                 -- Stale VMs first (another revision than the pool's: issue 24), then the oldest.
                 SELECT v.id FROM vms v
                 WHERE v.pool_namespace = $1 AND v.pool_name = $2 AND v.phase = 'AVAILABLE'
                 ORDER BY v.revision = (SELECT p.revision FROM pools p WHERE p.namespace = $1 AND p.name = $2),
                          v.created_at
                 LIMIT $3
                 FOR NO KEY UPDATE OF v SKIP LOCKED
             ), v AS (
                 UPDATE vms SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now()
                 FROM picked WHERE vms.id = picked.id
                 RETURNING vms.*
             )
             INSERT INTO events (type, pool_namespace, pool_name, vm_id)
             SELECT 'VM_DELETED_ON_SCALE_DOWN', v.pool_namespace, v.pool_name, v.id FROM v",
        &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&n, Type::INT8)],
    )
    .await
}
