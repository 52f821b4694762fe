//! A pool's rollout (issue 24, V19): started by a PUT that makes a new revision of a pool
//! with a rollout policy, stepped by the reconcile pass (`reconcile::rollout`). Every
//! statement that moves the state is guarded by the revision and the state it expects, so a
//! PUT or a pass meanwhile makes it a no-op (`false`).

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed};
use crate::domain::PoolRef;

/// Starts a rollout from revision `from` to `to`: ROLLOUT_STARTED, and the state reset.
pub async fn rollout_start(c: &impl Executor, pool: &PoolRef, from: i32, to: i32, by: &str) -> Result<()> {
    c.timed_execute(
        "WITH e AS (
             INSERT INTO events (type, pool_namespace, pool_name, payload)
             VALUES ('ROLLOUT_STARTED', $1, $2, jsonb_build_object('from', $3::int, 'to', $4::int, 'by', $5::text))
             RETURNING id
         )
         UPDATE pools SET rollout_state = 'PROGRESSING', rollout_from = $3, rollout_event_id = (SELECT id FROM e),
                          rollout_started_at = now(), rollout_extra_boots = 0, rollout_halted_reason = NULL,
                          rollout_warm_floor = (SELECT count(*) FROM vms v
                                                WHERE v.pool_namespace = $1 AND v.pool_name = $2 AND v.phase = 'AVAILABLE')
         WHERE namespace = $1 AND name = $2 AND revision = $4",
        &[
            (&pool.namespace, Type::TEXT),
            (&pool.name, Type::TEXT),
            (&from, Type::INT4),
            (&to, Type::INT4),
            (&by, Type::TEXT),
        ],
    )
    .await?;
    Ok(())
}

/// A pool's VMs against its revision, as a rollout step needs them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RolloutCounts {
    /// AVAILABLE VMs of another revision.
    pub stale_available: i64,
    /// PROVISIONING or CREATE_HOOK_RUNNING VMs of another revision.
    pub stale_coming: i64,
    /// LEASED or being claimed, of another revision: never touched.
    pub stale_leased: i64,
    pub current_available: i64,
    /// PROVISIONING or CREATE_HOOK_RUNNING VMs of the current revision.
    pub current_coming: i64,
    /// New VMs that failed since the rollout started (VM_HOOK_FAILED of a create, whatever
    /// failed it: a create hook, a boot that ended FAILED, the provision timeout).
    pub failures: i64,
    /// When a VM of the current revision last became AVAILABLE since the rollout started.
    pub last_progress: Option<DateTime<Utc>>,
    /// VM_CLAIMED events of the pool in the last `window` seconds (of its newest 5000 events).
    pub recent_claims: i64,
    pub db_now: DateTime<Utc>,
}

/// Counts the pool's VMs, failures, progress and recent claims for a rollout to `revision`
/// whose ROLLOUT_STARTED is `since_event` (events after it), in one statement.
pub async fn rollout_counts(
    c: &impl Executor,
    pool: &PoolRef,
    revision: i32,
    since_event: i64,
    window_seconds: i32,
) -> Result<RolloutCounts> {
    let window = f64::from(window_seconds);
    let row = c
        .timed_query_one(
            "SELECT
                 count(*) FILTER (WHERE v.phase = 'AVAILABLE' AND v.revision <> $3) AS stale_available,
                 count(*) FILTER (WHERE v.phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING') AND v.revision <> $3) AS stale_coming,
                 count(*) FILTER (WHERE v.phase IN ('LEASED', 'PRE_LEASE_HOOK_RUNNING') AND v.revision <> $3) AS stale_leased,
                 count(*) FILTER (WHERE v.phase = 'AVAILABLE' AND v.revision = $3) AS current_available,
                 count(*) FILTER (WHERE v.phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING') AND v.revision = $3) AS current_coming,
                 (SELECT count(*) FROM events e
                  WHERE e.pool_namespace = $1 AND e.pool_name = $2 AND e.id > $4 AND e.type = 'VM_HOOK_FAILED'
                    AND e.payload->>'hook' = 'create' AND (e.payload->>'revision')::int = $3) AS failures,
                 (SELECT max(e.created_at) FROM events e
                  WHERE e.pool_namespace = $1 AND e.pool_name = $2 AND e.id > $4 AND e.type = 'VM_AVAILABLE'
                    AND (e.payload->>'revision')::int = $3) AS last_progress,
                 (SELECT count(*) FROM (SELECT e.type, e.created_at FROM events e
                                        WHERE e.pool_namespace = $1 AND e.pool_name = $2
                                        ORDER BY e.id DESC LIMIT 5000) r
                  WHERE r.type = 'VM_CLAIMED' AND r.created_at > now() - make_interval(secs => $5)) AS recent_claims,
                 now() AS db_now
             FROM vms v WHERE v.pool_namespace = $1 AND v.pool_name = $2",
            &[
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&revision, Type::INT4),
                (&since_event, Type::INT8),
                (&window, Type::FLOAT8),
            ],
        )
        .await?;
    Ok(RolloutCounts {
        stale_available: row.try_get("stale_available")?,
        stale_coming: row.try_get("stale_coming")?,
        stale_leased: row.try_get("stale_leased")?,
        current_available: row.try_get("current_available")?,
        current_coming: row.try_get("current_coming")?,
        failures: row.try_get("failures")?,
        last_progress: row.try_get("last_progress")?,
        recent_claims: row.try_get("recent_claims")?,
        db_now: row.try_get("db_now")?,
    })
}

/// Retires up to `n` stale AVAILABLE VMs (another revision than `revision`), oldest first:
/// DELETING with VM_DELETED_FOR_ROLLOUT each, counted as extra boots. How many it retired.
pub async fn rollout_retire(c: &impl Executor, pool: &PoolRef, revision: i32, n: i64) -> Result<i64> {
    let row = c
        .timed_query_one(
            "WITH picked AS (
                 SELECT id FROM vms
                 WHERE pool_namespace = $1 AND pool_name = $2 AND phase = 'AVAILABLE' AND revision <> $3
                 ORDER BY created_at, id
                 LIMIT $4
                 FOR NO KEY UPDATE SKIP LOCKED
             ), v AS (
                 UPDATE vms SET phase = 'DELETING', attempts = 0, next_attempt_at = NULL, updated_at = now()
                 FROM picked WHERE vms.id = picked.id
                 RETURNING vms.*
             ), e AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, payload)
                 SELECT 'VM_DELETED_FOR_ROLLOUT', v.pool_namespace, v.pool_name, v.id,
                        jsonb_build_object('revision', v.revision, 'to', $3::int)
                 FROM v
             ), p AS (
                 UPDATE pools SET rollout_extra_boots = rollout_extra_boots + (SELECT count(*) FROM v)
                 WHERE namespace = $1 AND name = $2 AND revision = $3
             )
             SELECT count(*) AS n FROM v",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&revision, Type::INT4), (&n, Type::INT8)],
        )
        .await?;
    Ok(row.try_get("n")?)
}

/// Ends a rollout to `revision` that replaced every stale VM it could: COMPLETE (from
/// PROGRESSING) and POOL_ROLLOUT_COMPLETED, the revision marked rolled out. A rollback that
/// finished keeps its state. `false`: the pool moved on meanwhile.
pub async fn rollout_complete(c: &impl Executor, pool: &PoolRef, revision: i32) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "WITH p AS (
                 UPDATE pools SET rollout_state = CASE WHEN rollout_state = 'PROGRESSING' THEN 'COMPLETE' ELSE rollout_state END,
                                  rollout_event_id = NULL
                 WHERE namespace = $1 AND name = $2 AND revision = $3
                   AND rollout_state IN ('PROGRESSING', 'ROLLED_BACK') AND rollout_event_id IS NOT NULL
                 RETURNING namespace, name, rollout_state, rollout_extra_boots
             ), r AS (
                 UPDATE pool_revisions SET rolled_out = true
                 FROM p WHERE pool_revisions.namespace = p.namespace AND pool_revisions.name = p.name
                   AND pool_revisions.revision = $3
             ), e AS (
                 INSERT INTO events (type, pool_namespace, pool_name, payload)
                 SELECT 'POOL_ROLLOUT_COMPLETED', p.namespace, p.name,
                        jsonb_build_object('revision', $3::int, 'extra_boots', p.rollout_extra_boots)
                 FROM p
             )
             SELECT 1 FROM p",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&revision, Type::INT4)],
        )
        .await?;
    Ok(row.is_some())
}

/// Halts the rollout to `revision` (ROLLOUT_HALTED {reason}); with `rollback_to`, the pool then
/// returns to that kept revision: its VM-shaping fields (`microvm_template`,
/// `create_commands`) and number restored, ROLLOUT_ROLLED_BACK {to}, the state ROLLED_BACK
/// (the stale VMs of the halted revision are retired like any rollout's). `false`: the pool
/// moved on meanwhile.
pub async fn rollout_halt(
    c: &impl Executor,
    pool: &PoolRef,
    revision: i32,
    reason: &str,
    rollback_to: Option<i32>,
) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "WITH target AS (
                 SELECT r.revision, r.spec FROM pool_revisions r
                 WHERE r.namespace = $1 AND r.name = $2 AND r.revision = $5
             ), halted AS (
                 INSERT INTO events (type, pool_namespace, pool_name, payload)
                 SELECT 'ROLLOUT_HALTED', $1, $2, jsonb_build_object('reason', $4::text, 'revision', $3::int)
                 WHERE EXISTS (SELECT 1 FROM pools WHERE namespace = $1 AND name = $2 AND revision = $3
                                                     AND rollout_state = 'PROGRESSING')
                 RETURNING id
             ), back AS (
                 INSERT INTO events (type, pool_namespace, pool_name, payload)
                 SELECT 'ROLLOUT_ROLLED_BACK', $1, $2, jsonb_build_object('to', t.revision, 'from', $3::int)
                 FROM target t WHERE EXISTS (SELECT 1 FROM halted)
                 RETURNING id
             ), p AS (
                 UPDATE pools p SET
                     rollout_halted_reason = $4,
                     rollout_state = CASE WHEN t.revision IS NULL THEN 'HALTED' ELSE 'ROLLED_BACK' END,
                     rollout_from = CASE WHEN t.revision IS NULL THEN p.rollout_from ELSE $3 END,
                     rollout_event_id = CASE WHEN t.revision IS NULL THEN p.rollout_event_id ELSE (SELECT id FROM back) END,
                     revision = coalesce(t.revision, p.revision),
                     rollout_warm_floor = (SELECT count(*) FROM vms v
                                           WHERE v.pool_namespace = $1 AND v.pool_name = $2 AND v.phase = 'AVAILABLE'),
                     microvm_template = coalesce(t.spec->'microvm_template', p.microvm_template),
                     create_commands = CASE WHEN t.revision IS NULL THEN p.create_commands
                                            ELSE ARRAY(SELECT jsonb_array_elements_text(coalesce(t.spec->'create_commands', '[]'))) END,
                     -- A rollback changes the spec: a new version (V25), so an If-Match read
                     -- before it no longer matches.
                     spec_version = CASE WHEN t.revision IS NULL THEN p.spec_version
                                         ELSE nextval('pool_spec_versions') END,
                     updated_at = now()
                 FROM (SELECT 1) one LEFT JOIN target t ON true
                 WHERE p.namespace = $1 AND p.name = $2 AND p.revision = $3 AND p.rollout_state = 'PROGRESSING'
                   AND EXISTS (SELECT 1 FROM halted)
                 RETURNING 1
             )
             SELECT 1 FROM p",
            &[
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&revision, Type::INT4),
                (&reason, Type::TEXT),
                (&rollback_to, Type::INT4),
            ],
        )
        .await?;
    Ok(row.is_some())
}

/// The newest kept revision other than `revision` that rolled out: where a halted rollout
/// goes back to.
pub async fn rollout_last_good(c: &impl Executor, pool: &PoolRef, revision: i32) -> Result<Option<i32>> {
    let row = c
        .timed_query_opt(
            "SELECT revision FROM pool_revisions
             WHERE namespace = $1 AND name = $2 AND revision <> $3 AND rolled_out
             ORDER BY revision DESC LIMIT 1",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&revision, Type::INT4)],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Pauses a PROGRESSING rollout (`true`), or resumes a PAUSED one (`pause` false): its
/// progress deadline then counts from the resume. `false`: not in the state it needs.
pub async fn rollout_set_paused(c: &impl Executor, pool: &PoolRef, pause: bool) -> Result<bool> {
    let (from, to) = if pause { ("PROGRESSING", "PAUSED") } else { ("PAUSED", "PROGRESSING") };
    let n = c
        .timed_execute(
            "UPDATE pools SET rollout_state = $4,
                 rollout_started_at = CASE WHEN $4 = 'PROGRESSING' THEN now() ELSE rollout_started_at END
             WHERE namespace = $1 AND name = $2 AND rollout_state = $3 AND rollout_event_id IS NOT NULL",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&from, Type::TEXT), (&to, Type::TEXT)],
        )
        .await?;
    Ok(n == 1)
}

/// Undo: the pool goes back to its kept revision `to` (its `microvm_template` and
/// `create_commands`, and its number) and a rollout to it starts (ROLLOUT_STARTED {from, to,
/// by}), while the pool is still on revision `from`. `false`: revision `to` is not kept, or
/// the pool moved on meanwhile.
pub async fn rollout_undo(c: &impl Executor, pool: &PoolRef, from: i32, to: i32, by: &str) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "WITH t AS (
                 SELECT spec FROM pool_revisions WHERE namespace = $1 AND name = $2 AND revision = $4
             ), e AS (
                 INSERT INTO events (type, pool_namespace, pool_name, payload)
                 SELECT 'ROLLOUT_STARTED', $1, $2, jsonb_build_object('from', $3::int, 'to', $4::int, 'by', $5::text, 'undo', true)
                 FROM t WHERE EXISTS (SELECT 1 FROM pools WHERE namespace = $1 AND name = $2 AND revision = $3)
                 RETURNING id
             )
             UPDATE pools p SET
                 microvm_template = t.spec->'microvm_template',
                 create_commands = ARRAY(SELECT jsonb_array_elements_text(coalesce(t.spec->'create_commands', '[]'))),
                 revision = $4, rollout_state = 'PROGRESSING', rollout_from = $3,
                 rollout_event_id = (SELECT id FROM e), rollout_started_at = now(),
                 rollout_extra_boots = 0, rollout_halted_reason = NULL, updated_at = now(),
                 spec_version = nextval('pool_spec_versions'),
                 rollout_warm_floor = (SELECT count(*) FROM vms v
                                       WHERE v.pool_namespace = $1 AND v.pool_name = $2 AND v.phase = 'AVAILABLE')
             FROM t
             WHERE p.namespace = $1 AND p.name = $2 AND p.revision = $3 AND EXISTS (SELECT 1 FROM e)
             RETURNING 1",
            &[
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&from, Type::INT4),
                (&to, Type::INT4),
                (&by, Type::TEXT),
            ],
        )
        .await?;
    Ok(row.is_some())
}
