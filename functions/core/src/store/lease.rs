//! The `leases` table: [`LeaseView`] (a lease with the VM and host it points at) and the
//! `lease_*` statements except the claims that create leases (`claim.rs`): lookups,
//! heartbeat, list, release, expiry and the expiry warning. The row type, [`LeaseRow`], is in
//! `rows.rs`.
//!
//! Never revives an expired lease: a heartbeat after `expires_at` finds nothing.

use chrono::{DateTime, Utc};
use tokio_postgres::Row;
use tokio_postgres::types::Type;

use super::{Executor, HostRow, LeaseRow, Result, Timed, VmRow, json_col, json_req};
use crate::domain::PoolRef;

/// A lease with the VM and host it points at (either may be gone).
#[derive(Debug, Clone)]
pub struct LeaseView {
    pub lease: LeaseRow,
    pub vm: Option<VmRow>,
    pub host: Option<HostRow>,
}

pub(super) fn lease_view(row: &Row) -> Result<LeaseView> {
    Ok(LeaseView { lease: json_req(row, "lease")?, vm: json_col(row, "vm")?, host: json_col(row, "host")? })
}

/// A lease read that calls no flintlock (a get, a list, a replay, a heartbeat) sees its host
/// without credentials (`ca_pem`, `cert_pem`, `key_pem`, `basic_auth_token` read as absent;
/// issue 25 item 4): only the reads that call flintlock (a release, a hook claim's take, a
/// discard, the reconciler) load them.
const LEASE_VIEW_SELECT: &str = "SELECT to_jsonb(l) AS lease, to_jsonb(v) AS vm,
            to_jsonb(h) - ARRAY['ca_pem', 'cert_pem', 'key_pem', 'basic_auth_token', 'credentials_key_id', 'credentials_dek'] AS host
     FROM leases l
     LEFT JOIN vms v ON v.id = l.vm_id
     LEFT JOIN hosts h ON h.name = v.flintlock_host";

/// The live lease this principal created with this request_id, on any pool: how a claim that
/// lost a concurrent request_id race finds the winner's lease.
pub async fn lease_get_by_request_id(
    c: &impl Executor,
    principal: &str,
    request_id: &str,
) -> Result<Option<LeaseView>> {
    let sql = format!("{LEASE_VIEW_SELECT} WHERE l.principal = $1 AND l.request_id = $2");
    let row = c.timed_query_opt(&sql, &[(&principal, Type::TEXT), (&request_id, Type::TEXT)]).await?;
    row.as_ref().map(lease_view).transpose()
}

/// A lease by id; with `owner`, only if that principal claimed it (`None` otherwise, exactly
/// as for an unknown id).
pub async fn lease_get(c: &impl Executor, lease_id: &str, owner: Option<&str>) -> Result<Option<LeaseView>> {
    let sql = format!("{LEASE_VIEW_SELECT} WHERE l.lease_id = $1 AND ($2::text IS NULL OR l.principal = $2)");
    let row = c.timed_query_opt(&sql, &[(&lease_id, Type::TEXT), (&owner, Type::TEXT)]).await?;
    row.as_ref().map(lease_view).transpose()
}

/// Extends a lease by its pool's *current* expiry. `None` if the lease or its pool is gone,
/// the lease already expired (an expired lease is not revived: the reconciler is about to
/// delete its VM), or `owner` is given and did not claim it.
pub async fn lease_heartbeat(
    c: &impl Executor,
    lease_id: &str,
    owner: Option<&str>,
    now: Option<DateTime<Utc>>,
) -> Result<Option<LeaseView>> {
    let row = c
        .timed_query_opt(
            "WITH l AS (
                 UPDATE leases l
                 -- $2: the clock's now (NULL: the database's), for the check and the new deadline.
                 -- Never past claimed_at + the pool's max_lease_seconds (V23).
                 SET expires_at = least(coalesce($2, now()) + make_interval(secs => p.heartbeat_expiry_seconds),
                                        l.claimed_at + make_interval(secs => p.max_lease_seconds)),
                     last_heartbeat_at = coalesce($2, now())
                 FROM pools p
                 WHERE l.lease_id = $1 AND l.expires_at > coalesce($2, now())
                   -- $3: the owner a client token is limited to (NULL: an admin, any lease).
                   AND ($3::text IS NULL OR l.principal = $3)
                   AND p.namespace = l.pool_namespace AND p.name = l.pool_name
                   -- A lease whose release began (its VM DELETING, the delete pending) is over:
                   -- a heartbeat must not answer 200 for it (issue 23 finding 5).
                   AND EXISTS (SELECT 1 FROM vms v WHERE v.id = l.vm_id AND v.phase = 'LEASED')
                 RETURNING l.*
             )
             SELECT to_jsonb(l) AS lease, to_jsonb(v) AS vm,
                    to_jsonb(h) - ARRAY['ca_pem', 'cert_pem', 'key_pem', 'basic_auth_token', 'credentials_key_id', 'credentials_dek'] AS host
             FROM l
             LEFT JOIN vms v ON v.id = l.vm_id
             LEFT JOIN hosts h ON h.name = v.flintlock_host",
            &[(&lease_id, Type::TEXT), (&now, Type::TIMESTAMPTZ), (&owner, Type::TEXT)],
        )
        .await?;
    row.as_ref().map(lease_view).transpose()
}

/// Leases ordered by id, after `after`, at most `limit`; optionally one pool's, optionally
/// one principal's.
pub async fn lease_list(
    c: &impl Executor,
    pool: Option<&PoolRef>,
    principal: Option<&str>,
    after: &str,
    limit: i64,
) -> Result<Vec<LeaseView>> {
    let ns = pool.map(|p| p.namespace.as_str());
    let name = pool.map(|p| p.name.as_str());
    let sql = format!(
        "{LEASE_VIEW_SELECT}
         WHERE ($1::text IS NULL OR (l.pool_namespace = $1 AND l.pool_name = $2))
           AND ($3::text IS NULL OR l.principal = $3)
           AND l.lease_id > $4
         ORDER BY l.lease_id
         LIMIT $5"
    );
    let rows = c
        .timed_query(
            &sql,
            &[
                (&ns, Type::TEXT),
                (&name, Type::TEXT),
                (&principal, Type::TEXT),
                (&after, Type::TEXT),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    rows.iter().map(lease_view).collect()
}

/// First step of a release: marks the lease's VM DELETING (terminal), keeping the lease row
/// until flintlock confirms the delete. `None` for an unknown lease, or one `owner` (when
/// given) did not claim: then nothing is touched.
pub async fn lease_begin_release(c: &impl Executor, lease_id: &str, owner: Option<&str>) -> Result<Option<LeaseView>> {
    let row = c
        .timed_query_opt(
            "WITH l AS (
                 -- $2: the owner a client token is limited to (NULL: an admin, any lease).
                 SELECT * FROM leases WHERE lease_id = $1 AND ($2::text IS NULL OR principal = $2)
             ), v AS (
                 UPDATE vms v SET phase = 'DELETING', updated_at = now()
                 FROM l WHERE v.id = l.vm_id
                 RETURNING v.*
             )
             SELECT to_jsonb(l) AS lease, to_jsonb(v) AS vm, to_jsonb(h) AS host
             FROM l
             LEFT JOIN v ON true
             LEFT JOIN hosts h ON h.name = v.flintlock_host",
            &[(&lease_id, Type::TEXT), (&owner, Type::TEXT)],
        )
        .await?;
    row.as_ref().map(lease_view).transpose()
}

/// Removes a lease whose VM row is already gone.
pub async fn lease_delete(c: &impl Executor, lease_id: &str) -> Result<Option<LeaseRow>> {
    let row = c
        .timed_query_opt(
            "DELETE FROM leases l WHERE lease_id = $1 RETURNING to_jsonb(l) AS lease",
            &[(&lease_id, Type::TEXT)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "lease")).transpose()
}

/// What an expiry does after the CTE `exp` deleted the expired leases: their VMs → DELETING,
/// one VM_DELETED_DUE_TO_EXPIRY each, and the leases returned. The one definition behind the
/// sweep ([`lease_expire_for_pools`]) and a claim's expiry of one lease ([`lease_expire_one`]).
const LEASE_EXPIRE_REST: &str = ", v AS (
                 UPDATE vms SET phase = 'DELETING', updated_at = now(), attempts = 0, next_attempt_at = NULL
                 FROM exp WHERE vms.id = exp.vm_id
                 RETURNING vms.id
             ), ev AS (
                 INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
                 SELECT 'VM_DELETED_DUE_TO_EXPIRY', exp.pool_namespace, exp.pool_name, exp.vm_id, exp.lease_id FROM exp
             )
             SELECT to_jsonb(exp) AS lease FROM exp";

/// Leases one expiry statement takes at most (their VMs locked, then deleted).
pub const EXPIRE_BATCH: i64 = 500;

/// Expires the leases of `pools` with `expires_at <= now()` (at most [`EXPIRE_BATCH`]), every pool's in the same two
/// statements (a pass expires the leases of a batch of pools at once): lease removed, VM →
/// DELETING and VM_DELETED_DUE_TO_EXPIRY. A concurrent heartbeat either commits first (and
/// the lease is no longer expired when this re-checks it) or finds the lease gone.
///
/// Must run inside a transaction, in two statements, for the lock order: the expired
/// leases' VM rows are locked first (by id, across the pools), then the leases are deleted,
/// the order of a forced pool delete ([`super::pool_delete_and_mark_vms`]: VMs, then leases).
/// One statement deleting the leases and then updating their VMs took them the other way
/// round, and a forced delete of the same pool deadlocked with it. A data-modifying CTE
/// gives no order guarantee, hence the separate statement.
pub async fn lease_expire_for_pools(
    c: &impl Executor,
    pools: &[PoolRef],
    now: Option<DateTime<Utc>>,
) -> Result<Vec<LeaseRow>> {
    let (namespaces, names) = super::pool_work::pool_keys(pools);
    let locked: Vec<String> = c
        .timed_query(
            "SELECT v.id FROM vms v JOIN leases l ON l.vm_id = v.id
             WHERE (l.pool_namespace, l.pool_name) IN (SELECT * FROM unnest($1::text[], $2::text[]))
               -- $3: the clock's now (NULL: the database's).
               AND l.expires_at <= coalesce($3, now())
               -- A lease whose release began (its VM DELETING, the delete pending) is left to
               -- that release: its deleter writes VM_DELETED_ON_RELEASE (issue 23 finding 5).
               AND v.phase <> 'DELETING'
             ORDER BY v.id
             -- Bounded (issue 23 finding 5): the rest are due again, so the next pass (or the
             -- next batch) takes them; one statement never expires an unbounded fleet.
             LIMIT $4
             FOR UPDATE OF v",
            &[
                (&namespaces, Type::TEXT_ARRAY),
                (&names, Type::TEXT_ARRAY),
                (&now, Type::TIMESTAMPTZ),
                (&EXPIRE_BATCH, Type::INT8),
            ],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let rows = c
        .timed_query(
            &format!(
                "WITH exp AS (
                     -- Only leases whose VM row is locked above (or that have none): a lease that
                     -- expired since would be taken before its VM.
                     DELETE FROM leases l
                     WHERE (pool_namespace, pool_name) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                       AND expires_at <= coalesce($3, now())
                       AND (vm_id = ANY ($4) OR NOT EXISTS (SELECT 1 FROM vms v WHERE v.id = l.vm_id))
                     RETURNING *
                 ){LEASE_EXPIRE_REST}"
            ),
            &[
                (&namespaces, Type::TEXT_ARRAY),
                (&names, Type::TEXT_ARRAY),
                (&now, Type::TIMESTAMPTZ),
                (&locked, Type::TEXT_ARRAY),
            ],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "lease")).collect()
}

/// Expires one lease, if it is past `expires_at`, exactly as [`lease_expire_for_pools`] does
/// for a pool (lease removed, VM → DELETING, VM_DELETED_DUE_TO_EXPIRY; same lock order: the
/// VM row, then the lease row): for a claim whose request_id's lease expired before the sweep
/// came. `None` when it is no longer there (the sweep was first) or not expired.
///
/// One statement, the VM locked first all the same: the DELETE locks a lease row only once
/// its scan has returned it, and the scan returns it only after checking it against `vm`,
/// which has locked the VM row by then (`vm` is read, not data-modifying, so it runs when the
/// DELETE asks for it).
pub async fn lease_expire_one(
    c: &impl Executor,
    lease_id: &str,
    now: Option<DateTime<Utc>>,
) -> Result<Option<LeaseRow>> {
    let row = c
        .timed_query_opt(
            &format!(
                "WITH vm AS (
                     SELECT v.id FROM leases l JOIN vms v ON v.id = l.vm_id
                     -- $2: the clock's now (NULL: the database's).
                     WHERE l.lease_id = $1 AND l.expires_at <= coalesce($2, now())
                     FOR UPDATE OF v
                 ), exp AS (
                     DELETE FROM leases l WHERE lease_id = $1 AND expires_at <= coalesce($2, now())
                       AND (vm_id IN (SELECT id FROM vm) OR NOT EXISTS (SELECT 1 FROM vms v WHERE v.id = l.vm_id))
                     RETURNING *
                 ){LEASE_EXPIRE_REST}"
            ),
            &[(&lease_id, Type::TEXT), (&now, Type::TIMESTAMPTZ)],
        )
        .await?;
    row.as_ref().map(|r| json_req(r, "lease")).transpose()
}

/// Writes VM_EXPIRING_SOON once per expiry deadline for the leases of `pools` expiring
/// within `window`, every pool's in one statement.
pub async fn lease_warn_expiring_for_pools(
    c: &impl Executor,
    pools: &[PoolRef],
    window_seconds: f64,
    now: Option<DateTime<Utc>>,
) -> Result<u64> {
    let (namespaces, names) = super::pool_work::pool_keys(pools);
    c.timed_execute(
        "WITH w AS (
                 UPDATE leases SET warned_expires_at = expires_at
                 WHERE (pool_namespace, pool_name) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                   -- $4: the clock's now (NULL: the database's).
                   AND expires_at > coalesce($4, now())
                   AND expires_at <= coalesce($4, now()) + make_interval(secs => $3)
                   AND warned_expires_at IS DISTINCT FROM expires_at
                 RETURNING *
             )
             INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id, payload)
             SELECT 'VM_EXPIRING_SOON', w.pool_namespace, w.pool_name, w.vm_id, w.lease_id,
                    jsonb_build_object('expires_at', w.expires_at)
             FROM w",
        &[
            (&namespaces, Type::TEXT_ARRAY),
            (&names, Type::TEXT_ARRAY),
            (&window_seconds, Type::FLOAT8),
            (&now, Type::TIMESTAMPTZ),
        ],
    )
    .await
}
