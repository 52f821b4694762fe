//! The `pools` table: [`PoolRow`], a pool's live [`PoolStatus`] (its VMs counted by
//! `vm.rs`'s one definition), and the `pool_*` statements of the API: create, update, get,
//! list, delete. The pass's selection and the reconcile lease it takes on a pool are in
//! `pool_work.rs`.
//!
//! Never writes a VM's phase except as part of deleting the pool (its VMs go DELETING in the
//! same transaction).

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::vm::VM_COUNTS_OF_POOL_P;
use super::{Executor, LeaseRow, Result, StoreError, Timed, VmRow, json_req};
use crate::domain::VmCounts;
use crate::domain::{Autoscaling, HookFailurePolicy, PoolRef, PoolSpec, Replenishment, ScalingState, Strategy};
use crate::template::MicroVmTemplate;

/// A `pools` row.
#[derive(Debug, Clone, Deserialize)]
pub struct PoolRow {
    pub namespace: String,
    pub name: String,
    pub size: i32,
    pub flintlock_hosts: Vec<String>,
    pub strategy: Strategy,
    pub min_size: Option<i32>,
    pub microvm_template: MicroVmTemplate,
    pub create_commands: Vec<String>,
    pub pre_lease_commands: Vec<String>,
    pub hook_failure_policy: HookFailurePolicy,
    pub heartbeat_interval_seconds: i32,
    pub heartbeat_expiry_seconds: i32,
    /// V23: a lease's longest life (`None`: unbounded).
    #[serde(default)]
    pub max_lease_seconds: Option<i32>,
    /// Why the reconciler holds the pool below its target, as last reported in
    /// POOL_SIZE_BELOW_TARGET; `None` while nothing does ([`super::pool_set_below_target`]).
    #[serde(default)]
    pub below_target_reason: Option<String>,
    /// The autoscaling policy (`None`: `size` is the target).
    #[serde(default)]
    pub autoscaling: Option<Autoscaling>,
    /// What an autoscaled pool works towards (`None` without autoscaling): [`PoolRow::target_size`].
    #[serde(default)]
    pub desired_size: Option<i32>,
    /// The sizing step's state and last measurements (`reconcile::sizing`).
    #[serde(default)]
    pub scaling: Option<ScalingState>,
    /// Announced demand (`POST …/expect`).
    #[serde(default)]
    pub expected_claims: Option<i32>,
    #[serde(default)]
    pub expected_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub expected_until: Option<DateTime<Utc>>,
    /// Bumped by a change of a field that shapes the warm VMs (V18, [`pool_update`]).
    #[serde(default = "first_revision")]
    pub revision: i32,
    /// The rollout policy (`None`: a change applies to new VMs only) and the state of the
    /// pool's last rollout (V19; `reconcile::rollout`).
    #[serde(default)]
    pub rollout: Option<crate::domain::RolloutPolicy>,
    #[serde(default)]
    pub rollout_state: Option<crate::domain::RolloutState>,
    /// The revision the rollout started from.
    #[serde(default)]
    pub rollout_from: Option<i32>,
    /// Its ROLLOUT_STARTED event: failures and progress are counted after it.
    #[serde(default)]
    pub rollout_event_id: Option<i64>,
    #[serde(default)]
    pub rollout_started_at: Option<DateTime<Utc>>,
    /// Stale AVAILABLE VMs the rollout retired: each cost a boot that no claim needed.
    #[serde(default)]
    pub rollout_extra_boots: i32,
    #[serde(default)]
    pub rollout_halted_reason: Option<String>,
    /// The AVAILABLE VMs the pool had when its rollout started (V20): the warm capacity the
    /// rollout keeps.
    #[serde(default)]
    pub rollout_warm_floor: Option<i32>,
    /// The pool's VMs (DELETING ones not counted) by revision and status count, read by
    /// [`pool_get`] and [`pool_list`] only, while the pool has a rollout state.
    #[serde(default)]
    pub by_revision: Option<std::collections::BTreeMap<String, std::collections::BTreeMap<String, i64>>>,
    /// A new value (from one sequence) at every change of the spec (V25): what the pool's
    /// ETag is made of ([`PoolRow::etag`]).
    #[serde(default)]
    pub spec_version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A pool's (and a VM's) revision before V18 recorded one.
pub(super) fn first_revision() -> i32 {
    1
}

impl PoolRow {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.namespace.clone(), name: self.name.clone() }
    }

    /// The pool's strong entity tag: its spec version, quoted (`"42"`).
    pub fn etag(&self) -> crate::domain::PoolEtag {
        crate::domain::PoolEtag(self.spec_version)
    }

    /// The revision a rollout works towards: the pool's.
    pub fn target_revision(&self) -> i32 {
        self.revision
    }

    /// The size the strategy works with: the autoscaler's desired size, else `size`.
    pub fn target_size(&self) -> i32 {
        match (&self.autoscaling, self.desired_size) {
            (Some(_), Some(d)) => d,
            _ => self.size,
        }
    }

    pub fn spec(&self) -> PoolSpec {
        PoolSpec {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            size: self.size,
            flintlock_hosts: self.flintlock_hosts.clone(),
            replenishment: Replenishment { strategy: self.strategy, min_size: self.min_size },
            microvm_template: self.microvm_template.clone(),
            create_commands: self.create_commands.clone(),
            pre_lease_commands: self.pre_lease_commands.clone(),
            hook_failure_policy: self.hook_failure_policy,
            heartbeat_interval_seconds: self.heartbeat_interval_seconds,
            heartbeat_expiry_seconds: self.heartbeat_expiry_seconds,
            max_lease_seconds: self.max_lease_seconds,
            autoscaling: self.autoscaling.clone(),
            rollout: self.rollout.clone(),
        }
    }
}

/// Live VM counts of a pool, computed from `vms` and `leases`: the API's view of
/// [`VmCounts`], every count but `rows`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct PoolStatus {
    pub available: i64,
    /// PRE_LEASE_HOOK_RUNNING, or LEASED without a committed lease row.
    pub claiming: i64,
    pub leased: i64,
    pub provisioning: i64,
    pub quarantined: i64,
    pub deleting: i64,
}

impl From<VmCounts> for PoolStatus {
    fn from(c: VmCounts) -> PoolStatus {
        PoolStatus {
            available: c.available,
            claiming: c.claiming,
            leased: c.leased,
            provisioning: c.provisioning,
            quarantined: c.quarantined,
            deleting: c.deleting,
        }
    }
}

fn pool_with_counts(row: &Row) -> Result<(PoolRow, VmCounts)> {
    Ok((json_req(row, "pool")?, json_req(row, "counts")?))
}

/// Inserts a pool, and its revision 1 (rolled out: it has no VMs of another); `None` if one
/// with that key exists.
pub async fn pool_insert(c: &impl Executor, spec: &PoolSpec) -> Result<Option<PoolRow>> {
    let template = serde_json::to_value(&spec.microvm_template).map_err(|e| StoreError::Db(e.to_string()))?;
    let (autoscaling, desired) = autoscaling_params(spec)?;
    let spec_json = serde_json::to_value(spec).map_err(|e| StoreError::Db(e.to_string()))?;
    let rollout = rollout_param(spec)?;
    let row = c
        .timed_query_opt(
            "WITH p AS (
                 INSERT INTO pools AS p (namespace, name, size, flintlock_hosts, strategy, min_size,
                     microvm_template, create_commands, pre_lease_commands, hook_failure_policy,
                     heartbeat_interval_seconds, heartbeat_expiry_seconds, autoscaling, desired_size,
                     rollout, max_lease_seconds)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $16, $17)
                 ON CONFLICT (namespace, name) DO NOTHING
                 RETURNING *
             ), r AS (
                 INSERT INTO pool_revisions (namespace, name, revision, spec, rolled_out)
                 SELECT namespace, name, revision, $15, true FROM p
             )
             SELECT to_jsonb(p) AS pool FROM p",
            &[
                (&spec.namespace, Type::TEXT),
                (&spec.name, Type::TEXT),
                (&spec.size, Type::INT4),
                (&spec.flintlock_hosts, Type::TEXT_ARRAY),
                (&spec.replenishment.strategy.as_str(), Type::TEXT),
                (&spec.replenishment.min_size, Type::INT4),
                (&template, Type::JSONB),
                (&spec.create_commands, Type::TEXT_ARRAY),
                (&spec.pre_lease_commands, Type::TEXT_ARRAY),
                (&spec.hook_failure_policy.as_str(), Type::TEXT),
                (&spec.heartbeat_interval_seconds, Type::INT4),
                (&spec.heartbeat_expiry_seconds, Type::INT4),
                (&autoscaling, Type::JSONB),
                (&desired, Type::INT4),
                (&spec_json, Type::JSONB),
                (&rollout, Type::JSONB),
                (&spec.max_lease_seconds, Type::INT4),
            ],
        )
        .await?;
    row.map(|r| json_req(&r, "pool")).transpose()
}

/// The `rollout` column of a spec.
fn rollout_param(spec: &PoolSpec) -> Result<Option<serde_json::Value>> {
    spec.rollout.as_ref().map(serde_json::to_value).transpose().map_err(|e| StoreError::Db(e.to_string()))
}

/// How many revisions of a pool are kept (the newest; issue 24 item 1).
pub const REVISIONS_KEPT: i32 = 10;

/// The `autoscaling` column and the desired size a pool starts from (`None`, `None`: off).
fn autoscaling_params(spec: &PoolSpec) -> Result<(Option<serde_json::Value>, Option<i32>)> {
    let Some(a) = &spec.autoscaling else { return Ok((None, None)) };
    let json = serde_json::to_value(a).map_err(|e| StoreError::Db(e.to_string()))?;
    Ok((Some(json), Some(a.initial_size(spec.size))))
}

/// What [`pool_update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolUpdate {
    NotFound,
    /// The pool exists but its spec version is none of those the update was conditioned on
    /// (someone changed it since they were read): nothing was changed.
    VersionMismatch,
    /// Replaced; `bumped`: a VM-shaping field changed, so `revision` is a new one, and a pool
    /// with a rollout policy rolls `from` its previous revision.
    Updated {
        from: i32,
        revision: i32,
        bumped: bool,
    },
}

/// Replaces a pool's spec. Switching autoscaling on starts the desired size from `size`;
/// changing the policy keeps the desired size within the new floor and ceiling (the next
/// sizing step decides from there); switching it off forgets the sizing state.
///
/// A changed `microvm_template` or `create_commands` (compared as stored: jsonb equality,
/// so key order does not count) bumps the revision and keeps the new spec as that revision,
/// dropping all but the newest [`REVISIONS_KEPT`]; any other change keeps the revision. In
/// one statement: the SET expressions read the row as it was, and a concurrent update of the
/// same pool waits for this one, so two PUTs never get one revision number.
///
/// `versions` (`If-Match`): replace only a pool whose spec version is one of them. The
/// condition is in the UPDATE's WHERE, so it is checked again on the row a concurrent update
/// committed (READ COMMITTED re-reads the locked row): of many updates conditioned on one
/// version, exactly one matches; the others find the new version and change nothing.
/// `None`: unconditional. Every update takes a new spec version.
pub async fn pool_update(c: &impl Executor, spec: &PoolSpec, versions: Option<&[i64]>) -> Result<PoolUpdate> {
    let template = serde_json::to_value(&spec.microvm_template).map_err(|e| StoreError::Db(e.to_string()))?;
    let (autoscaling, desired) = autoscaling_params(spec)?;
    let (min, max) = spec.autoscaling.as_ref().map_or((None, None), |a| (Some(a.min), Some(a.max)));
    let spec_json = serde_json::to_value(spec).map_err(|e| StoreError::Db(e.to_string()))?;
    let rollout = rollout_param(spec)?;
    let row = c
        .timed_query_opt(
            "WITH upd AS (
             UPDATE pools SET size = $3, flintlock_hosts = $4, strategy = $5, min_size = $6,
                 rollout = $19,
                 -- The revision a rollout starts from: the row's as it was (a SET expression
                 -- reads the row this UPDATE replaces, after waiting for a concurrent one).
                 rollout_from = CASE WHEN $19::jsonb IS NOT NULL
                                      AND (microvm_template IS DISTINCT FROM $7::jsonb
                                           OR create_commands IS DISTINCT FROM $8::text[])
                                     THEN revision ELSE rollout_from END,
                 -- After a rollback the pool is on an older revision: a new one is numbered
                 -- after the newest kept.
                 revision = CASE WHEN microvm_template IS DISTINCT FROM $7::jsonb
                                   OR create_commands IS DISTINCT FROM $8::text[]
                                 THEN greatest(revision, (SELECT max(r.revision) FROM pool_revisions r
                                                          WHERE r.namespace = $1 AND r.name = $2)) + 1
                                 ELSE revision END,
                 microvm_template = $7, create_commands = $8, pre_lease_commands = $9,
                 hook_failure_policy = $10, heartbeat_interval_seconds = $11,
                 heartbeat_expiry_seconds = $12, autoscaling = $13, max_lease_seconds = $20,
                 desired_size = CASE WHEN $13::jsonb IS NULL THEN NULL
                                     WHEN desired_size IS NULL OR autoscaling IS NULL THEN $14
                                     ELSE least(greatest(desired_size, $15), $16) END,
                 -- A changed policy is decided again by the next pass, idle or not.
                 scaling = CASE WHEN $13::jsonb IS NULL THEN NULL
                                WHEN autoscaling IS DISTINCT FROM $13::jsonb
                                    THEN jsonb_set(coalesce(scaling, '{}'), '{active}', 'true')
                                ELSE scaling END,
                 spec_version = nextval('pool_spec_versions'),
                 updated_at = now()
             WHERE namespace = $1 AND name = $2
               AND ($21::bigint[] IS NULL OR spec_version = ANY($21::bigint[]))
             RETURNING namespace, name, revision, rollout_from
             ), kept AS (
                 -- A revision that exists already (nothing VM-shaping changed) is left as is.
                 INSERT INTO pool_revisions (namespace, name, revision, spec)
                 SELECT namespace, name, revision, $17 FROM upd
                 ON CONFLICT (namespace, name, revision) DO NOTHING
                 RETURNING revision
             ), trimmed AS (
                 DELETE FROM pool_revisions r USING upd
                 WHERE r.namespace = upd.namespace AND r.name = upd.name
                   AND r.revision <= upd.revision - $18
             )
             SELECT coalesce(upd.rollout_from, upd.revision) AS from_revision, upd.revision,
                    EXISTS (SELECT 1 FROM kept) AS bumped
             FROM upd",
            &[
                (&spec.namespace, Type::TEXT),
                (&spec.name, Type::TEXT),
                (&spec.size, Type::INT4),
                (&spec.flintlock_hosts, Type::TEXT_ARRAY),
                (&spec.replenishment.strategy.as_str(), Type::TEXT),
                (&spec.replenishment.min_size, Type::INT4),
                (&template, Type::JSONB),
                (&spec.create_commands, Type::TEXT_ARRAY),
                (&spec.pre_lease_commands, Type::TEXT_ARRAY),
                (&spec.hook_failure_policy.as_str(), Type::TEXT),
                (&spec.heartbeat_interval_seconds, Type::INT4),
                (&spec.heartbeat_expiry_seconds, Type::INT4),
                (&autoscaling, Type::JSONB),
                (&desired, Type::INT4),
                (&min, Type::INT4),
                (&max, Type::INT4),
                (&spec_json, Type::JSONB),
                (&REVISIONS_KEPT, Type::INT4),
                (&rollout, Type::JSONB),
                (&spec.max_lease_seconds, Type::INT4),
                (&versions, Type::INT8_ARRAY),
            ],
        )
        .await?;
    Ok(match row {
        // Which one: the pool is gone, or it is there under another version.
        None if versions.is_some() && pool_exists(c, &spec.pool_ref()).await? => PoolUpdate::VersionMismatch,
        None => PoolUpdate::NotFound,
        Some(r) => PoolUpdate::Updated {
            from: r.try_get("from_revision")?,
            revision: r.try_get("revision")?,
            bumped: r.try_get("bumped")?,
        },
    })
}

/// Whether the pool exists.
async fn pool_exists(c: &impl Executor, pool: &PoolRef) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "SELECT 1 FROM pools WHERE namespace = $1 AND name = $2",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    Ok(row.is_some())
}

/// One kept revision of a pool.
#[derive(Debug, Clone, Deserialize)]
pub struct RevisionRow {
    pub revision: i32,
    pub spec: PoolSpec,
    pub created_at: DateTime<Utc>,
    pub rolled_out: bool,
}

/// The kept revisions of a pool, newest first; `None` if the pool does not exist.
pub async fn pool_revisions(c: &impl Executor, pool: &PoolRef) -> Result<Option<Vec<RevisionRow>>> {
    let rows = c
        .timed_query(
            "SELECT to_jsonb(r) - 'namespace' - 'name' AS rev FROM pools p
             LEFT JOIN pool_revisions r ON r.namespace = p.namespace AND r.name = p.name
             WHERE p.namespace = $1 AND p.name = $2
             ORDER BY r.revision DESC",
            &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)],
        )
        .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        if let Some(rev) = super::json_col::<RevisionRow>(r, "rev")? {
            out.push(rev);
        }
    }
    Ok(Some(out))
}

/// A pool row (`p`) with its VMs by revision ([`PoolRow::by_revision`]) while it has a
/// rollout state: each revision's VMs counted under the pool status's names.
const POOL_WITH_REVISIONS_P: &str = "
    to_jsonb(p) || jsonb_build_object('by_revision', CASE WHEN p.rollout_state IS NULL THEN NULL ELSE (
        SELECT coalesce(jsonb_object_agg(x.rev, x.counts), '{}') FROM (
            SELECT y.revision::text AS rev, jsonb_object_agg(y.status, y.n) AS counts FROM (
                SELECT v.revision,
                       CASE WHEN v.phase = 'AVAILABLE' THEN 'available'
                            WHEN v.phase = 'PRE_LEASE_HOOK_RUNNING' THEN 'claiming'
                            WHEN v.phase = 'LEASED' THEN 'leased'
                            WHEN v.phase IN ('PROVISIONING', 'CREATE_HOOK_RUNNING') THEN 'provisioning'
                            ELSE lower(v.phase) END AS status,
                       count(*) AS n
                FROM vms v
                WHERE v.pool_namespace = p.namespace AND v.pool_name = p.name AND v.phase <> 'DELETING'
                GROUP BY 1, 2
            ) y GROUP BY y.revision
        ) x) END)";

pub async fn pool_get(c: &impl Executor, pool: &PoolRef) -> Result<Option<(PoolRow, PoolStatus)>> {
    let sql = format!(
        "SELECT {POOL_WITH_REVISIONS_P} AS pool, {VM_COUNTS_OF_POOL_P} AS counts FROM pools p WHERE p.namespace = $1 AND p.name = $2"
    );
    let row = c.timed_query_opt(&sql, &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)]).await?;
    Ok(row.as_ref().map(pool_with_counts).transpose()?.map(|(p, n)| (p, n.into())))
}

pub async fn pool_list(c: &impl Executor, namespace: Option<&str>) -> Result<Vec<(PoolRow, PoolStatus)>> {
    Ok(pool_list_with_counts(c, namespace).await?.into_iter().map(|(p, n)| (p, n.into())).collect())
}

/// One page of pools (optionally one namespace's), ordered by key, after `after` (a page's
/// last pool), at most `limit`, with their status counts.
pub async fn pool_list_page(
    c: &impl Executor,
    namespace: Option<&str>,
    after: Option<&PoolRef>,
    limit: i64,
) -> Result<Vec<(PoolRow, PoolStatus)>> {
    let sql = format!(
        "SELECT {POOL_WITH_REVISIONS_P} AS pool, {VM_COUNTS_OF_POOL_P} AS counts FROM pools p
         WHERE ($1::text IS NULL OR p.namespace = $1)
           AND ($2::text IS NULL OR (p.namespace, p.name) > ($2, $3))
         ORDER BY p.namespace, p.name
         LIMIT $4"
    );
    let (ans, aname) = (after.map(|p| p.namespace.as_str()), after.map(|p| p.name.as_str()));
    let rows = c
        .timed_query(&sql, &[(&namespace, Type::TEXT), (&ans, Type::TEXT), (&aname, Type::TEXT), (&limit, Type::INT8)])
        .await?;
    rows.iter().map(pool_with_counts).map(|r| r.map(|(p, n)| (p, n.into()))).collect()
}

/// Every pool (optionally one namespace's), ordered by key, with its VMs counted by phase.
pub async fn pool_list_with_counts(c: &impl Executor, namespace: Option<&str>) -> Result<Vec<(PoolRow, VmCounts)>> {
    let sql = format!(
        "SELECT {POOL_WITH_REVISIONS_P} AS pool, {VM_COUNTS_OF_POOL_P} AS counts FROM pools p
         WHERE $1::text IS NULL OR p.namespace = $1
         ORDER BY p.namespace, p.name"
    );
    let rows = c.timed_query(&sql, &[(&namespace, Type::TEXT)]).await?;
    rows.iter().map(pool_with_counts).collect()
}

pub enum PoolDelete {
    NotFound,
    /// Refused without `force`: this many VMs are leased or being claimed.
    HasLeasedVms(i64),
    /// Every VM of the pool, now DELETING, and the leases that were removed.
    Deleted {
        vms: Vec<VmRow>,
        leases: Vec<LeaseRow>,
    },
}

/// Deletes a pool and marks its VMs DELETING. Must run inside a transaction: the pool row and
/// every VM row are locked first, so a claim cannot slip a lease in between the leased-VM
/// check and the marking.
///
/// Lock order: the pool row, then its VM rows by id, then their leases. Every statement that
/// locks a VM and its lease takes them in that order (VM first, lower ids first; see
/// [`super::lease_expire_for_pools`]), so none of them can deadlock with this.
pub async fn pool_delete_and_mark_vms(c: &impl Executor, pool: &PoolRef, force: bool) -> Result<PoolDelete> {
    let p: &[(&(dyn ToSql + Sync), Type)] = &[(&pool.namespace, Type::TEXT), (&pool.name, Type::TEXT)];
    let deleted = c.timed_execute("DELETE FROM pools WHERE namespace = $1 AND name = $2", p).await?;
    if deleted == 0 {
        return Ok(PoolDelete::NotFound);
    }
    // FOR UPDATE waits for in-flight claims on these rows (they hold FOR NO KEY UPDATE), so
    // the count below sees every lease that committed.
    let leased: i64 = c
        .timed_query_one(
            "WITH locked AS (
                 -- By id: the order every statement locking several VMs uses.
                 SELECT id, phase FROM vms WHERE pool_namespace = $1 AND pool_name = $2
                 ORDER BY id
                 FOR UPDATE
             )
             SELECT count(*) FROM locked WHERE phase IN ('LEASED', 'PRE_LEASE_HOOK_RUNNING')",
            p,
        )
        .await?
        .get(0);
    if leased > 0 && !force {
        return Ok(PoolDelete::HasLeasedVms(leased));
    }
    let row = c
        .timed_query_one(
            "WITH old AS (
                 SELECT id, phase FROM vms WHERE pool_namespace = $1 AND pool_name = $2
             ), marked AS (
                 -- A VM already DELETING (a release or a discard pending) has its deleter, which
                 -- writes its terminal event (VM_DELETED_ON_RELEASE with its lease): neither
                 -- marked again, nor its lease taken, nor a second terminal event written
                 -- (issue 23 finding 5). The inline delete below still helps finish it.
                 UPDATE vms v SET phase = 'DELETING', lease_id = NULL, updated_at = now()
                 FROM old WHERE v.id = old.id AND old.phase <> 'DELETING'
                 RETURNING v.*
             ), removed AS (
                 DELETE FROM leases l WHERE l.pool_namespace = $1 AND l.pool_name = $2
                   AND (l.vm_id IN (SELECT id FROM marked) OR l.vm_id NOT IN (SELECT id FROM old))
                 RETURNING *
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_DELETED_ON_POOL_DELETE', m.pool_namespace, m.pool_name, m.id, r.lease_id
                 FROM marked m LEFT JOIN removed r ON r.vm_id = m.id
             )
             SELECT (SELECT coalesce(jsonb_agg(to_jsonb(x) ORDER BY x.id), '[]') FROM (
                         SELECT * FROM marked
                         UNION ALL
                         SELECT v.* FROM vms v JOIN old ON old.id = v.id AND old.phase = 'DELETING'
                     ) x) AS vms,
                    (SELECT coalesce(jsonb_agg(to_jsonb(r)), '[]') FROM removed r) AS leases",
            p,
        )
        .await?;
    Ok(PoolDelete::Deleted { vms: json_req(&row, "vms")?, leases: json_req(&row, "leases")? })
}

/// Every pool with its size and status, for the pool gauges (`metrics::POOL_GAUGES`).
pub async fn pool_gauges(c: &impl Executor) -> Result<Vec<(PoolRow, PoolStatus)>> {
    pool_list(c, None).await
}
