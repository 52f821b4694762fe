//! The pools a reconcile pass works on: the selection of those that may need a step
//! ([`pool_list_with_work`], one statement) and the per-pool reconcile leases a pass takes,
//! marks and gives back. Part of the `pools` statements ([`super::pool`]).

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_postgres::types::Type;

use super::vm::VM_COUNTS_OF_POOL_P;
use super::{Executor, PoolRow, Result, Timed, json_req};
use crate::domain::{PoolRef, Strategy, VmCounts};

/// What the selection of a pass knows about a pool that may need a step
/// ([`pool_list_with_work`]): its counts for the strategy, and whether anything else is due.
#[derive(Debug, Clone, Deserialize)]
pub struct PoolWork {
    pub namespace: String,
    pub name: String,
    pub strategy: Strategy,
    pub size: i32,
    pub min_size: Option<i32>,
    /// An autoscaled pool's `autoscaling.max`, which counts every VM.
    #[serde(default)]
    pub ceiling: Option<i32>,
    pub below_target_reason: Option<String>,
    pub counts: VmCounts,
    /// The spec was written after the last pass released the pool (or none has yet).
    pub changed: bool,
    /// A lease to expire, or one expiring within the warning window not yet warned about.
    pub leases_due: bool,
    /// A DELETING, PROVISIONING or CREATE_HOOK_RUNNING VM whose backoff is over, or a claim
    /// abandoned mid pre-lease hook.
    pub vms_due: bool,
}

impl PoolWork {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.namespace.clone(), name: self.name.clone() }
    }
}

/// What a selection found ([`pool_list_with_work`]).
#[derive(Debug, Clone, Deserialize)]
pub struct PoolSelection {
    /// The pools that may need a step, with their counts, oldest reconcile lease first.
    pub work: Vec<PoolWork>,
    /// The last pool (key order) this selection checked in full: where the next one's full
    /// checks start ([`super::selection_advance`]). `None`: no pool exists.
    pub checked: Option<PoolRef>,
}

/// The selection of a reconcile pass, in one statement: the pools no pass holds and this pass
/// has not visited yet (`reconcile_until` before both now and `pass_started`) that may need a
/// step, oldest lease first, each with its counts for the strategy (`reconcile::select`
/// decides: the arithmetic stays in one place).
///
/// Only *candidates* are counted, and a pool is one only when something names it, each
/// found through an index or the scan of `pools`, never by counting a pool's VMs: its row
/// (a changed spec, a reason recorded for being below target, a step since the watermark), a
/// lease due, a VM due, a claim abandoned mid-hook, an event since the watermark (every
/// change to a pool's VMs outside a pass writes one), or its turn among the `full_checks` pools after the cursor of
/// `reconcile_selection` (key order, wrapping around), checked whatever the signals say. The
/// watermark is `reconcile_selection.seen_through` less `margin_seconds`. So a settled pool
/// costs its share of one scan of `pools`, and counting is proportional to the work.
///
/// A candidate is then left out when nothing can be due: no changed spec, no lease due, no
/// VM due, no reason recorded for being below target, no leased VM, and as many AVAILABLE,
/// claiming and provisioning VMs as its size, which every strategy calls full.
///
/// `now`: the clock's now (NULL: the database's); `warn_seconds`: the expiry warning window;
/// `abandon_seconds`: how long a pre-lease hook may run before its claim counts as abandoned.
pub async fn pool_list_with_work(
    c: &impl Executor,
    pass_started: DateTime<Utc>,
    now: Option<DateTime<Utc>>,
    warn_seconds: f64,
    abandon_seconds: f64,
    margin_seconds: f64,
    full_checks: i64,
) -> Result<PoolSelection> {
    let row = c
        .timed_query_one(
            &format!(
                "WITH mark AS (
                     SELECT seen_through - make_interval(secs => $5) AS since, checked_namespace, checked_name
                     FROM reconcile_selection
                 ), net AS MATERIALIZED (
                     -- The full checks: the $6 pools after the cursor in key order (the primary
                     -- key's order), wrapping around to the first pools at the end.
                     SELECT lap, namespace, name FROM (
                         (SELECT 0 AS lap, p.namespace, p.name FROM pools p, mark
                          WHERE (p.namespace, p.name) > (mark.checked_namespace, mark.checked_name)
                          ORDER BY p.namespace, p.name LIMIT $6)
                         UNION ALL
                         (SELECT 1, p.namespace, p.name FROM pools p, mark
                          WHERE (p.namespace, p.name) <= (mark.checked_namespace, mark.checked_name)
                          ORDER BY p.namespace, p.name LIMIT $6)
                     ) laps
                     ORDER BY lap, namespace, name LIMIT $6
                 ), candidates AS (
                     -- The pools row: a changed spec, a reason recorded, a step since the mark
                     -- (whatever that step did: rows it deleted leave nothing else behind).
                     -- One index each (pools_spec_changed, pools_below_target: V13;
                     -- pools_reconcile_until: V3): no scan of `pools`.
                     SELECT p.namespace, p.name FROM pools p WHERE p.updated_at > p.reconcile_until
                     UNION
                     SELECT p.namespace, p.name FROM pools p WHERE p.below_target_reason IS NOT NULL
                     UNION
                     SELECT p.namespace, p.name FROM pools p, mark WHERE p.reconcile_until >= mark.since
                     UNION
                     -- Leases to expire or warn about (leases_expires_at).
                     SELECT l.pool_namespace, l.pool_name FROM leases l
                     WHERE l.expires_at <= coalesce($2, now()) + make_interval(secs => $3)
                     UNION
                     -- VMs due (vms_phase_due), claims abandoned mid-hook (vms_pre_lease_hook_started).
                     SELECT v.pool_namespace, v.pool_name FROM vms v
                     WHERE v.phase IN ('DELETING', 'PROVISIONING', 'CREATE_HOOK_RUNNING')
                       AND (v.next_attempt_at IS NULL OR v.next_attempt_at <= coalesce($2, now()))
                     UNION
                     SELECT v.pool_namespace, v.pool_name FROM vms v
                     WHERE v.phase = 'PRE_LEASE_HOOK_RUNNING'
                       AND v.hook_started_at < coalesce($2, now()) - make_interval(secs => $4)
                     UNION
                     -- Events since the mark (events_created_at): what changed a pool's VMs
                     -- outside a pass (claims, releases, discards, quarantines, expiries)
                     -- writes one in the same statement, a removed VM row included.
                     SELECT e.pool_namespace, e.pool_name FROM events e, mark WHERE e.created_at >= mark.since
                     UNION
                     -- Rollouts under way (pools_rolling, V19): stepped every pass until done.
                     SELECT namespace, name FROM pools
                     WHERE rollout_state IN ('PROGRESSING', 'ROLLED_BACK') AND rollout_event_id IS NOT NULL
                     UNION
                     SELECT namespace, name FROM net
                 ), w AS MATERIALIZED (
                     -- MATERIALIZED: a subquery in FROM is flattened, and each use of `counts`
                     -- below then ran the correlated count again (eight times per pool).
                     -- The size the strategy works with: an autoscaled pool's desired size.
                     SELECT p.namespace, p.name, p.strategy,
                            CASE WHEN p.autoscaling IS NULL THEN p.size ELSE coalesce(p.desired_size, p.size) END AS size,
                            p.min_size, (p.autoscaling->>'max')::int AS ceiling, p.below_target_reason,
                            p.reconcile_until, c.counts,
                            p.updated_at > p.reconcile_until
                                OR (p.rollout_state IN ('PROGRESSING', 'ROLLED_BACK') AND p.rollout_event_id IS NOT NULL)
                                AS changed,
                            EXISTS (SELECT 1 FROM leases l
                                    WHERE l.pool_namespace = p.namespace AND l.pool_name = p.name
                                      AND l.expires_at <= coalesce($2, now()) + make_interval(secs => $3)
                                      AND (l.expires_at <= coalesce($2, now())
                                           OR l.warned_expires_at IS DISTINCT FROM l.expires_at)) AS leases_due,
                            EXISTS (SELECT 1 FROM vms v
                                    WHERE v.pool_namespace = p.namespace AND v.pool_name = p.name
                                      AND v.phase IN ('DELETING', 'PROVISIONING', 'CREATE_HOOK_RUNNING')
                                      AND (v.next_attempt_at IS NULL OR v.next_attempt_at <= coalesce($2, now())))
                            OR EXISTS (SELECT 1 FROM vms v
                                    WHERE v.pool_namespace = p.namespace AND v.pool_name = p.name
                                      AND v.phase = 'PRE_LEASE_HOOK_RUNNING'
                                      AND v.hook_started_at < coalesce($2, now()) - make_interval(secs => $4)) AS vms_due
                     FROM candidates k JOIN pools p ON (p.namespace, p.name) = (k.namespace, k.name),
                          LATERAL (SELECT {VM_COUNTS_OF_POOL_P} AS counts) c
                     WHERE p.reconcile_until < least(now(), $1)
                 )
                 SELECT (SELECT coalesce(jsonb_agg(to_jsonb(w) ORDER BY w.reconcile_until, w.namespace, w.name), '[]')
                         FROM w
                         WHERE w.changed OR w.leases_due OR w.vms_due OR w.below_target_reason IS NOT NULL
                            OR (w.counts->>'leased')::bigint > 0
                            OR (w.counts->>'available')::bigint + (w.counts->>'claiming')::bigint
                               + (w.counts->>'provisioning')::bigint <> w.size) AS work,
                        (SELECT jsonb_build_object('namespace', n.namespace, 'name', n.name) FROM net n
                         ORDER BY n.lap DESC, n.namespace DESC, n.name DESC LIMIT 1) AS checked"
            ),
            &[
                (&pass_started, Type::TIMESTAMPTZ),
                (&now, Type::TIMESTAMPTZ),
                (&warn_seconds, Type::FLOAT8),
                (&abandon_seconds, Type::FLOAT8),
                (&margin_seconds, Type::FLOAT8),
                (&full_checks, Type::INT8),
            ],
        )
        .await?;
    Ok(PoolSelection { work: json_req(&row, "work")?, checked: super::json_col(&row, "checked")? })
}

/// `pools` as the two parallel arrays the batch statements take (`unnest($1, $2)`).
pub(super) fn pool_keys(pools: &[PoolRef]) -> (Vec<&str>, Vec<&str>) {
    pools.iter().map(|p| (p.namespace.as_str(), p.name.as_str())).unzip()
}

/// Takes the reconcile lease of each of `pools` that no pass holds and this pass has not
/// visited yet, in one statement, and returns their rows (a pool another pass took since the
/// selection is skipped, never waited for). The lease ends `lease_seconds` from now or when
/// [`pool_release_reconcile_leases`] gives it back.
pub async fn pool_take_reconcile_leases(
    c: &impl Executor,
    owner: &str,
    pass_started: DateTime<Utc>,
    lease_seconds: f64,
    pools: &[PoolRef],
) -> Result<Vec<PoolRow>> {
    let (namespaces, names) = pool_keys(pools);
    let rows = c
        .timed_query(
            "UPDATE pools p SET reconcile_owner = $1, reconcile_until = now() + make_interval(secs => $3)
             FROM (
                 SELECT namespace, name FROM pools
                 WHERE (namespace, name) IN (SELECT * FROM unnest($4::text[], $5::text[]))
                   AND reconcile_until < least(now(), $2)
                 FOR UPDATE SKIP LOCKED
             ) picked
             WHERE (p.namespace, p.name) = (picked.namespace, picked.name)
             RETURNING to_jsonb(p) AS pool",
            &[
                (&owner, Type::TEXT),
                (&pass_started, Type::TIMESTAMPTZ),
                (&lease_seconds, Type::FLOAT8),
                (&namespaces, Type::TEXT_ARRAY),
                (&names, Type::TEXT_ARRAY),
            ],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "pool")).collect()
}

/// Records why the reconciler holds a pool below its target (`None`: nothing does any
/// more). POOL_SIZE_BELOW_TARGET (`payload` plus the `reason`) is written in the same
/// statement only when the reason changes to a new one, so a pool held back for hours writes
/// one event, not one per pass. Returns whether it wrote one.
pub async fn pool_set_below_target(
    c: &impl Executor,
    pool: &PoolRef,
    reason: Option<&str>,
    payload: &serde_json::Value,
) -> Result<bool> {
    let row = c
        .timed_query_one(
            "WITH p AS (
                 -- No change, no row: the guard is what makes it once per state change.
                 UPDATE pools SET below_target_reason = $3
                 WHERE namespace = $1 AND name = $2 AND below_target_reason IS DISTINCT FROM $3
                 RETURNING namespace, name
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, payload)
                 SELECT 'POOL_SIZE_BELOW_TARGET', p.namespace, p.name, $4 || jsonb_build_object('reason', $3)
                 FROM p WHERE $3 IS NOT NULL
                 RETURNING id
             )
             SELECT count(*) FROM ev",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&reason, Type::TEXT), (payload, Type::JSONB)],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)? == 1)
}

/// Gives back the reconcile leases this pass (`owner`) holds on `pools`. The lease ends at
/// now, so no pass that started before this moment takes the pool again: each pass visits a
/// pool at most once.
pub async fn pool_release_reconcile_leases(c: &impl Executor, pools: &[PoolRef], owner: &str) -> Result<()> {
    let (namespaces, names) = pool_keys(pools);
    c.timed_execute(
        "UPDATE pools SET reconcile_owner = NULL, reconcile_until = now()
         WHERE (namespace, name) IN (SELECT * FROM unnest($1::text[], $2::text[])) AND reconcile_owner = $3",
        &[(&namespaces, Type::TEXT_ARRAY), (&names, Type::TEXT_ARRAY), (&owner, Type::TEXT)],
    )
    .await?;
    Ok(())
}
