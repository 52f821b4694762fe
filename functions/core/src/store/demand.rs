//! A pool's demand: the `pool_refused_claims` table, what the sizing step reads of `pools`,
//! `events`, `vms` and that table in one statement ([`demand_list`]), the sizing decisions it
//! writes back with their POOL_SCALED events ([`pool_apply_scaling`]), and announced demand
//! ([`pool_expect`]).
//!
//! Never on the claim path but for a refusal: a claim that took a VM is counted from its
//! VM_CLAIMED event, which the claim writes anyway.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed, json_req};
use crate::domain::{Autoscaling, PoolRef, ScalingState, Strategy};

/// Records a claim refused for want of a VM as demand of an autoscaled pool (nothing for
/// another pool): `request_key` names the request, so its retries count once.
pub async fn pool_record_refused(c: &impl Executor, pool: &PoolRef, request_key: &str) -> Result<()> {
    c.timed_execute(
        "INSERT INTO pool_refused_claims (pool_namespace, pool_name, request_key)
         SELECT p.namespace, p.name, $3 FROM pools p
         WHERE p.namespace = $1 AND p.name = $2 AND p.autoscaling IS NOT NULL
         ON CONFLICT DO NOTHING",
        &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT), (&request_key, Type::TEXT)],
    )
    .await?;
    Ok(())
}

/// What the sizing step reads of one autoscaled pool.
#[derive(Debug, Clone, Deserialize)]
pub struct PoolDemand {
    pub namespace: String,
    pub name: String,
    pub strategy: Strategy,
    pub autoscaling: Autoscaling,
    pub desired_size: Option<i32>,
    pub size: i32,
    #[serde(default)]
    pub scaling: Option<ScalingState>,
    /// The database's now, in seconds since the epoch.
    pub now: f64,
    /// VM_CLAIMED events within the window, 5 and 30 windows ([`DEMAND_WINDOWS`]), none
    /// before the last change of demand seen; then within each of the [`RISE_SLICES`] slices
    /// of [`RISE_SLICE_WINDOWS`] windows that end now, oldest first.
    pub claims: [i64; 3 + RISE_SLICES],
    /// Refused requests within the same windows and slices.
    pub refused: [i64; 3 + RISE_SLICES],
    /// Of the slices' claims, those whose request had been refused before (counted in
    /// `refused` already): the rest are fresh arrivals (`reconcile::batches`).
    #[serde(default)]
    pub retried: [i64; RISE_SLICES],
    /// Of the demand window's claims, those whose request was refused within the window: the
    /// window's other refusals (`refused[0] - served_refused`) are requests still waiting for
    /// a VM.
    #[serde(default)]
    pub served_refused: i64,
    /// Of the demand window's claims, all whose request was refused before (within the window
    /// or before it): the window's fresh arrivals are `claims[0] + refused[0] - retried_window`.
    /// A claim of a request refused before the window arrived before it.
    #[serde(default)]
    pub retried_window: i64,
    /// Seconds since the demand window's first refusal (`None`: none in the window).
    #[serde(default)]
    pub first_refused_age: Option<f64>,
    /// When the last two slices' claims and refusals came: their median (seconds since the
    /// epoch; `None`: none came).
    #[serde(default)]
    pub recent_at: Option<f64>,
    /// Seconds since the pool was created (a window longer than that saw less).
    pub age: f64,
    /// The p90 of the last 20 VMs' creation to AVAILABLE (`None`: none recorded).
    pub provisioning: Option<f64>,
    /// Their mean: what a slot is out for on average (`reconcile::sizing`).
    #[serde(default)]
    pub provisioning_mean: Option<f64>,
    /// The mean of the 20 VMs created last among the last 50 up, of those created more than
    /// two p90s ago (all up by now, the slow ones too); `None` when fewer than 10 were. After
    /// a wave of creations the last VMs up are its slowest boots, so `provisioning_mean` reads
    /// high for the next 20 creations; this one does not (`reconcile::scale::decision_with`).
    #[serde(default)]
    pub provisioning_created_mean: Option<f64>,
    /// VMs leased or being claimed.
    pub busy: i64,
    /// The claims a live hint announced (0: no live hint), the arrivals since it came (claims,
    /// or refusals when more) and how long ago it came (seconds): the sizing step counts the
    /// arrivals beyond the pool's usual rate as the announced ones (`reconcile::scale`).
    #[serde(default)]
    pub hint_claims: i64,
    #[serde(default)]
    pub hint_arrivals: i64,
    #[serde(default)]
    pub hint_age: f64,
    /// The hint has expired: clear it.
    pub hint_expired: bool,
}

/// The demand windows, in demand windows: the rate is estimated over all three
/// (`reconcile::sizing::arrival_rate`).
pub const DEMAND_WINDOWS: [f64; 3] = [1.0, 5.0, 30.0];

/// The last few seconds as consecutive slices (each [`RISE_SLICE_WINDOWS`] of the demand
/// window: 2.5 s of the default 60 s), for the rate of a rise while it comes
/// (`reconcile::sizing::arrival_rate`). [`demand_list`]'s statement spells both out (four
/// counts of `$1 / 24` seconds each): change them together.
pub const RISE_SLICES: usize = 4;
pub const RISE_SLICE_WINDOWS: f64 = 1.0 / 24.0;

impl PoolDemand {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.namespace.clone(), name: self.name.clone() }
    }
}

/// The autoscaled pools the sizing step must look at, with their demand over the last
/// `window_seconds` and the longer [`DEMAND_WINDOWS`]: those whose state says to look again (`pools_scaling_active`), with a
/// hint, with a claim or a refusal in the window (`pool`: just that one). Found through the
/// indexes of those conditions (recent events, refusals), never by scanning every pool; and
/// nothing at all is read when no pool is autoscaled.
pub async fn demand_list(c: &impl Executor, window_seconds: f64, pool: Option<&PoolRef>) -> Result<Vec<PoolDemand>> {
    let (ns, name) = (pool.map(|p| p.namespace.as_str()), pool.map(|p| p.name.as_str()));
    let row = c
        .timed_query_one(
            "WITH any_autoscaled AS (
                 SELECT EXISTS (SELECT 1 FROM pools WHERE autoscaling IS NOT NULL) AS yes
             ), bound AS (
                 -- The first event of the window and of the longest one (events_created_at),
                 -- for the ranges of events_pool_id.
                 SELECT coalesce((SELECT min(id) FROM events WHERE created_at >= now() - make_interval(secs => $1)),
                                 (SELECT coalesce(max(id), 0) + 1 FROM events)) AS first_id,
                        coalesce((SELECT min(id) FROM events WHERE created_at >= now() - make_interval(secs => 30 * $1)),
                                 (SELECT coalesce(max(id), 0) + 1 FROM events)) AS long_id
             ), cand AS (
                 SELECT p.namespace, p.name FROM pools p, any_autoscaled a
                 WHERE a.yes AND $2::text IS NULL AND p.autoscaling IS NOT NULL
                   AND (p.scaling IS NULL OR p.scaling->>'active' = 'true' OR p.expected_until IS NOT NULL)
                 UNION
                 SELECT e.pool_namespace, e.pool_name FROM events e, bound, any_autoscaled a
                 WHERE a.yes AND $2::text IS NULL AND e.id >= bound.first_id AND e.type = 'VM_CLAIMED'
                 UNION
                 SELECT r.pool_namespace, r.pool_name FROM pool_refused_claims r, any_autoscaled a
                 WHERE a.yes AND $2::text IS NULL AND r.refused_at >= now() - make_interval(secs => $1)
                 UNION
                 SELECT $2::text, $3::text WHERE $2::text IS NOT NULL
             ), d AS (
                 SELECT p.namespace, p.name, p.strategy, p.autoscaling, p.desired_size, p.size, p.scaling,
                        extract(epoch FROM now())::float8 AS now,
                        (SELECT jsonb_build_array(
                                    count(*) FILTER (WHERE e.created_at >= greatest(p.created_at, now() - make_interval(secs => $1))),
                                    count(*) FILTER (WHERE e.created_at >= greatest(s.since, now() - make_interval(secs => 5 * $1))),
                                    count(*),
                                    count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => 4 * $1 / 24) AND e.created_at < now() - make_interval(secs => 3 * $1 / 24)),
                                    count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => 3 * $1 / 24) AND e.created_at < now() - make_interval(secs => 2 * $1 / 24)),
                                    count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => 2 * $1 / 24) AND e.created_at < now() - make_interval(secs => $1 / 24)),
                                    count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => $1 / 24)))
                         FROM events e, bound
                         WHERE e.pool_namespace = p.namespace AND e.pool_name = p.name AND e.id >= bound.long_id
                           AND e.type = 'VM_CLAIMED' AND e.created_at >= s.since) AS claims,
                        (SELECT jsonb_build_array(
                                    count(*) FILTER (WHERE r.refused_at >= greatest(p.created_at, now() - make_interval(secs => $1))),
                                    count(*) FILTER (WHERE r.refused_at >= greatest(s.since, now() - make_interval(secs => 5 * $1))),
                                    count(*),
                                    count(*) FILTER (WHERE r.refused_at >= now() - make_interval(secs => 4 * $1 / 24) AND r.refused_at < now() - make_interval(secs => 3 * $1 / 24)),
                                    count(*) FILTER (WHERE r.refused_at >= now() - make_interval(secs => 3 * $1 / 24) AND r.refused_at < now() - make_interval(secs => 2 * $1 / 24)),
                                    count(*) FILTER (WHERE r.refused_at >= now() - make_interval(secs => 2 * $1 / 24) AND r.refused_at < now() - make_interval(secs => $1 / 24)),
                                    count(*) FILTER (WHERE r.refused_at >= now() - make_interval(secs => $1 / 24)))
                         FROM pool_refused_claims r
                         WHERE r.pool_namespace = p.namespace AND r.pool_name = p.name
                           AND r.refused_at >= s.since) AS refused,
                        rt.retried, rt.served_refused, rt.retried_window,
                        (SELECT extract(epoch FROM now() - min(r.refused_at))::float8 FROM pool_refused_claims r
                         WHERE r.pool_namespace = p.namespace AND r.pool_name = p.name
                           AND r.refused_at >= greatest(p.created_at, now() - make_interval(secs => $1))) AS first_refused_age,
                        -- When the last two slices' arrivals came: their median.
                        (SELECT extract(epoch FROM percentile_disc(0.5) WITHIN GROUP (ORDER BY x.t))::float8 FROM (
                             SELECT e.created_at AS t FROM events e, bound
                             WHERE e.pool_namespace = p.namespace AND e.pool_name = p.name AND e.id >= bound.first_id
                               AND e.type = 'VM_CLAIMED' AND e.created_at >= now() - make_interval(secs => 2 * $1 / 24)
                             UNION ALL
                             SELECT r.refused_at FROM pool_refused_claims r
                             WHERE r.pool_namespace = p.namespace AND r.pool_name = p.name
                               AND r.refused_at >= now() - make_interval(secs => 2 * $1 / 24)) x) AS recent_at,
                        greatest(0, extract(epoch FROM now() - p.created_at))::float8 AS age,
                        pv.provisioning, pv.provisioning_mean, pc.provisioning_created_mean,
                        (SELECT count(*) FROM vms v WHERE v.pool_namespace = p.namespace AND v.pool_name = p.name
                           AND v.phase IN ('LEASED', 'PRE_LEASE_HOOK_RUNNING')) AS busy,
                        -- A live hint: its claims, and the arrivals since it came: claims, or
                        -- refusals when more (a request refused and then served counts in both:
                        -- the larger is a floor on the arrivals, so the hint lasts rather than
                        -- runs down too soon).
                        CASE WHEN p.expected_until > now() THEN p.expected_claims ELSE 0 END AS hint_claims,
                        CASE WHEN p.expected_until > now() THEN greatest(
                               (SELECT count(*) FROM events e
                                WHERE e.pool_namespace = p.namespace AND e.pool_name = p.name
                                  AND e.id >= coalesce((SELECT min(id) FROM events WHERE created_at >= p.expected_at),
                                                       (SELECT coalesce(max(id), 0) + 1 FROM events))
                                  AND e.type = 'VM_CLAIMED' AND e.created_at >= p.expected_at),
                               (SELECT count(*) FROM pool_refused_claims r
                                WHERE r.pool_namespace = p.namespace AND r.pool_name = p.name
                                  AND r.refused_at >= p.expected_at))
                        ELSE 0 END AS hint_arrivals,
                        CASE WHEN p.expected_until > now()
                             THEN greatest(0, extract(epoch FROM now() - p.expected_at))::float8 ELSE 0 END AS hint_age,
                        coalesce(p.expected_until <= now(), false) AS hint_expired
                 FROM cand k JOIN pools p ON (p.namespace, p.name) = (k.namespace, k.name)
                 -- The windows start no earlier than the pool (a pool of the same name
                 -- deleted before left its events) and the last change of the demand the
                 -- estimate detected (`since`; what came before is another regime), but
                 -- never less than one window before now (as `sizing::cut_spans`).
                 CROSS JOIN LATERAL (SELECT greatest(now() - make_interval(secs => 30 * $1), p.created_at,
                                                     least(now() - make_interval(secs => $1),
                                                           to_timestamp(coalesce((p.scaling->>'since')::float8, 0)))) AS since) s
                 -- The claims of a request refused before (its retry served): in each slice
                 -- (the rest are fresh arrivals, `reconcile::batches`); within the demand
                 -- window, those of a request refused within it too (the window's other
                 -- refusals still wait), and all of them (none is an arrival of the window:
                 -- its request arrived when it was first refused).
                 CROSS JOIN LATERAL (
                     SELECT jsonb_build_array(
                                count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => 4 * $1 / 24) AND e.created_at < now() - make_interval(secs => 3 * $1 / 24)),
                                count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => 3 * $1 / 24) AND e.created_at < now() - make_interval(secs => 2 * $1 / 24)),
                                count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => 2 * $1 / 24) AND e.created_at < now() - make_interval(secs => $1 / 24)),
                                count(*) FILTER (WHERE e.created_at >= now() - make_interval(secs => $1 / 24))) AS retried,
                            count(*) FILTER (WHERE r.refused_at >= greatest(p.created_at, now() - make_interval(secs => $1))) AS served_refused,
                            count(*) AS retried_window
                     FROM events e
                     JOIN leases l ON l.lease_id = e.lease_id
                     JOIN pool_refused_claims r ON (r.pool_namespace, r.pool_name, r.request_key)
                                                 = (p.namespace, p.name, l.principal || ':' || l.request_id)
                     , bound
                     WHERE e.pool_namespace = p.namespace AND e.pool_name = p.name AND e.id >= bound.first_id
                       AND e.type = 'VM_CLAIMED' AND e.created_at >= greatest(p.created_at, now() - make_interval(secs => $1))
                       AND l.request_id IS NOT NULL AND r.refused_at <= e.created_at) rt
                 -- The last 20 VMs' creation to AVAILABLE (events_pool_available: the pool's
                 -- last VM_AVAILABLE events only): its p90 and its mean.
                 CROSS JOIN LATERAL (
                     SELECT percentile_cont(0.9) WITHIN GROUP (ORDER BY x.s) AS provisioning, avg(x.s) AS provisioning_mean
                     FROM (SELECT (e.payload->>'provision_seconds')::float8 AS s FROM events e
                           WHERE e.pool_namespace = p.namespace AND e.pool_name = p.name AND e.type = 'VM_AVAILABLE'
                             AND e.payload ? 'provision_seconds'
                           ORDER BY e.id DESC LIMIT 20) x) pv
                 -- Of the last 50 up, the 20 created last of those created more than two p90s
                 -- ago: their mean, when there are at least 10.
                 CROSS JOIN LATERAL (
                     SELECT CASE WHEN count(*) >= 10 THEN avg(y.s) END AS provisioning_created_mean
                     FROM (SELECT x.s FROM (
                               SELECT (e.payload->>'provision_seconds')::float8 AS s, e.created_at FROM events e
                               WHERE e.pool_namespace = p.namespace AND e.pool_name = p.name AND e.type = 'VM_AVAILABLE'
                                 AND e.payload ? 'provision_seconds'
                               ORDER BY e.id DESC LIMIT 50) x
                           WHERE x.created_at - make_interval(secs => x.s) < now() - make_interval(secs => 2 * pv.provisioning)
                           ORDER BY x.created_at - make_interval(secs => x.s) DESC LIMIT 20) y) pc
                 WHERE p.autoscaling IS NOT NULL
             ), pruned AS (
                 -- Refusals past any window or hint (an hour is the longest hint).
                 DELETE FROM pool_refused_claims
                 WHERE refused_at < now() - make_interval(secs => greatest(31 * $1, 7200))
             )
             SELECT coalesce(jsonb_agg(to_jsonb(d) ORDER BY d.namespace, d.name), '[]') AS pools FROM d",
            &[(&window_seconds, Type::FLOAT8), (&ns, Type::TEXT), (&name, Type::TEXT)],
        )
        .await?;
    json_req(&row, "pools")
}

/// One sizing decision to write.
#[derive(Debug, Clone, Serialize)]
pub struct ScalingWrite {
    pub namespace: String,
    pub name: String,
    /// The desired size the decision started from: the write applies only if it still holds
    /// (two overlapping passes: the second one's decision is dropped, not written twice).
    pub from_size: Option<i32>,
    pub desired: i32,
    pub reason: String,
    pub scaling: ScalingState,
    pub clear_hint: bool,
    /// The policy the decision was made by.
    pub policy: Autoscaling,
}

/// Writes sizing decisions, and POOL_SCALED `{from, to, reason}` for each that changed the
/// desired size, in one statement. Returns the pools whose desired size changed.
pub async fn pool_apply_scaling(c: &impl Executor, writes: &[ScalingWrite]) -> Result<Vec<PoolRef>> {
    let writes = serde_json::to_value(writes).map_err(|e| super::StoreError::Db(e.to_string()))?;
    let row = c
        .timed_query_one(
            "WITH u AS (
                 SELECT * FROM jsonb_to_recordset($1) AS x(namespace text, name text, from_size int, desired int,
                                                          reason text, scaling jsonb, clear_hint boolean,
                                                          policy jsonb)
             ), upd AS (
                 -- Only if the decision's inputs still hold: the desired size it started from and
                 -- the policy it decided by (a PUT since), and a hint cleared only if it has
                 -- expired (not a new one posted since).
                 UPDATE pools p SET desired_size = u.desired, scaling = u.scaling,
                     expected_claims = CASE WHEN u.clear_hint AND p.expected_until <= now() THEN NULL ELSE p.expected_claims END,
                     expected_at = CASE WHEN u.clear_hint AND p.expected_until <= now() THEN NULL ELSE p.expected_at END,
                     expected_until = CASE WHEN u.clear_hint AND p.expected_until <= now() THEN NULL ELSE p.expected_until END
                 FROM u
                 WHERE (p.namespace, p.name) = (u.namespace, u.name) AND p.autoscaling = u.policy
                   AND p.desired_size IS NOT DISTINCT FROM u.from_size
                 RETURNING p.namespace, p.name
             ), scaled AS (
                 INSERT INTO events (type, pool_namespace, pool_name, payload)
                 SELECT 'POOL_SCALED', u.namespace, u.name,
                        jsonb_build_object('from', u.from_size, 'to', u.desired, 'reason', u.reason)
                 FROM u JOIN upd ON (upd.namespace, upd.name) = (u.namespace, u.name)
                 WHERE u.from_size IS DISTINCT FROM u.desired
                 RETURNING pool_namespace, pool_name
             )
             SELECT coalesce(jsonb_agg(jsonb_build_object('namespace', pool_namespace, 'name', pool_name)), '[]') AS scaled
             FROM scaled",
            &[(&writes, Type::JSONB)],
        )
        .await?;
    json_req(&row, "scaled")
}

/// An announced demand as recorded ([`pool_expect`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Expected {
    pub expected_until: DateTime<Utc>,
    pub expected_claims: i32,
    pub autoscaled: bool,
    pub size: i32,
}

/// Records that `claims` claims are expected within `within_seconds` on a pool: added to a
/// hint still running (counted from its start), else a new one; it lasts `within_seconds`
/// plus the pool's provisioning time (`provisioning_seconds` when none is measured). `None`:
/// no such pool.
pub async fn pool_expect(
    c: &impl Executor,
    pool: &PoolRef,
    claims: i32,
    within_seconds: i32,
    provisioning_seconds: f64,
) -> Result<Option<Expected>> {
    let row = c
        .timed_query_opt(
            "WITH p AS (
                 SELECT namespace, name, expected_until > now() AS live,
                        coalesce((scaling->>'provisioning_seconds')::float8, 0) AS measured
                 FROM pools WHERE namespace = $1 AND name = $2
                 FOR NO KEY UPDATE
             )
             UPDATE pools t SET
                 expected_claims = least(10000, CASE WHEN p.live THEN t.expected_claims + $3 ELSE $3 END),
                 expected_at = CASE WHEN p.live THEN t.expected_at ELSE now() END,
                 expected_until = greatest(CASE WHEN p.live THEN t.expected_until END,
                     now() + make_interval(secs => $4 + CASE WHEN p.measured > 0 THEN p.measured ELSE $5 END))
             FROM p WHERE (t.namespace, t.name) = (p.namespace, p.name)
             RETURNING jsonb_build_object('expected_until', t.expected_until, 'expected_claims', t.expected_claims,
                                          'autoscaled', t.autoscaling IS NOT NULL, 'size', t.size) AS expected",
            &[
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&claims, Type::INT4),
                (&f64::from(within_seconds), Type::FLOAT8),
                (&provisioning_seconds, Type::FLOAT8),
            ],
        )
        .await?;
    row.map(|r| json_req(&r, "expected")).transpose()
}
