//! Pools: create, update, get, list, delete (drain).

use std::collections::HashMap;

use futures::StreamExt;

use crate::api::{self, Pool};
use crate::app::AppState;
use crate::domain::{EventType, HostExec, IfMatch, PoolEtag, PoolRef, PoolSpec};
use crate::error::ApiError;
use crate::store::{self, PoolDelete, PoolStatus};

fn not_found(pool: &PoolRef) -> ApiError {
    ApiError::NotFound(format!("pool {pool} not found"))
}

/// Refuses a spec that names hosts nobody registered. Locks the named hosts (KEY SHARE) for
/// the rest of the transaction so a concurrent RemoveHost cannot slip in.
async fn check_hosts(tx: &crate::db::Tx<'_>, spec: &PoolSpec) -> Result<(), ApiError> {
    let missing = store::host_missing_for_pool(tx, &spec.flintlock_hosts).await?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ApiError::FailedPrecondition(format!(
            "pool {} names unregistered flintlock host(s) {}: register them with POST /v1/hosts first",
            spec.pool_ref(),
            missing.join(", ")
        )))
    }
}

/// The spec's own rules, then the deployment's spec policy (a 400 with reason `SPEC_POLICY`).
fn validated(state: &AppState, spec: &PoolSpec) -> Result<(), ApiError> {
    spec.validate().map_err(ApiError::InvalidArgument)?;
    within_policy(state, spec)
}

fn within_policy(state: &AppState, spec: &PoolSpec) -> Result<(), ApiError> {
    state.config.spec_policy.check(&spec.microvm_template).map_err(|msg| {
        tracing::warn!(pool = %spec.pool_ref(), refused = %msg, "spec outside the spec policy refused");
        ApiError::InvalidArgument(msg).reason(SPEC_POLICY)
    })
}

/// The `reason` of a spec refused by the deployment's spec policy.
pub const SPEC_POLICY: &str = "SPEC_POLICY";

/// Hooks run through flintlock's guest agent: a pool with commands may only name hosts
/// that can exec. A host's `exec` decides: `enabled` / `disabled` is an admin's declaration,
/// taken as it is (no probe); `auto` asks its ServerInfo (flintlock ≥ v0.15.2 with the exec
/// API enabled), and each probe's answer is stored on the host, so its status says why. A
/// refusal logs what ServerInfo answered, field by field, in case our reading of it is wrong.
async fn check_hosts_can_exec(state: &AppState, spec: &PoolSpec) -> Result<(), ApiError> {
    if spec.create_commands.is_empty() && spec.pre_lease_commands.is_empty() {
        return Ok(());
    }
    let override_hint = |name: &str| {
        format!("if its flintlockd can run exec after all, declare it: PUT /v1/hosts/{name} with \"exec\": \"enabled\"")
    };
    let mut refused = vec![];
    for name in &spec.flintlock_hosts {
        let host = {
            let conn = state.conn().await?;
            store::host_get(&conn, name).await?
        };
        // Unregistered hosts are refused by check_hosts with their own message.
        let Some((host, _)) = host else { continue };
        match host.exec {
            HostExec::Enabled => continue,
            HostExec::Disabled => {
                tracing::info!(host = %name, pool = %spec.pool_ref(), "exec gate: host declared exec disabled");
                refused.push(format!("{name}: exec is declared disabled on this host (its \"exec\": \"disabled\")"));
                continue;
            }
            HostExec::Auto => {}
        }
        let (version, why) = match state.flintlock.server_info(&host.endpoint()).await {
            Ok(info) => {
                let why = crate::flintlock::exec_supported(&info).err();
                if let Some(why) = &why {
                    tracing::warn!(
                        host = %name,
                        pool = %spec.pool_ref(),
                        reason = %why,
                        server_info = %info.response,
                        "exec gate: ServerInfo says this host cannot run hooks"
                    );
                }
                (Some(info.version.clone()), why)
            }
            Err(e @ crate::flintlock::FlintlockError::Unsupported { .. }) => {
                tracing::warn!(host = %name, pool = %spec.pool_ref(), error = %e, "exec gate: the host has no ServerInfo");
                (None, Some(e.to_string()))
            }
            Err(e) => {
                tracing::warn!(host = %name, pool = %spec.pool_ref(), error = %e, "exec gate: ServerInfo failed");
                return Err(ApiError::unavailable(
                    format!(
                        "cannot ask flintlock host {name} whether it can run hooks; retry when it is reachable ({})",
                        override_hint(name)
                    ),
                    e,
                ));
            }
        };
        {
            let conn = state.conn().await?;
            store::host_record_probe(&conn, name, version.as_deref(), why.as_deref()).await?;
        }
        if let Some(why) = why {
            refused.push(format!("{name}: {why} ({})", override_hint(name)));
        }
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(ApiError::FailedPrecondition(format!(
            "pool {} has create_commands or pre_lease_commands, which need flintlock's exec API, but {}",
            spec.pool_ref(),
            refused.join("; ")
        )))
    }
}

/// A pool and its entity tag (the `ETag` of its GET, PUT and create answers).
#[derive(Debug, Clone)]
pub struct Tagged {
    pub pool: Pool,
    pub etag: PoolEtag,
}

pub async fn create(state: &AppState, spec: PoolSpec, by: &str) -> Result<Pool, ApiError> {
    create_tagged(state, spec, by).await.map(|t| t.pool)
}

/// [`create`], with the new pool's entity tag.
pub async fn create_tagged(state: &AppState, spec: PoolSpec, by: &str) -> Result<Tagged, ApiError> {
    validated(state, &spec)?;
    check_hosts_can_exec(state, &spec).await?;
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    check_hosts(&tx, &spec).await?;
    let row = store::pool_insert(&tx, &spec).await?.ok_or_else(|| {
        ApiError::AlreadyExists(format!("pool {} already exists: use PUT to change it", spec.pool_ref()))
    })?;
    let audit = serde_json::json!({"by": by, "revision": row.revision});
    store::event_insert(&tx, EventType::PoolCreated, &spec.pool_ref(), None, None, &audit).await?;
    tx.commit().await?;
    drop(conn); // back before the wake: on Lambda it is the only one
    tracing::info!(pool = %spec.pool_ref(), size = spec.size, by, "pool created");
    state.wake("pool created").await;
    Ok(Tagged { pool: Pool::new(&row, PoolStatus::default()), etag: row.etag() })
}

/// Replaces a pool's spec. A new revision of a pool with a rollout policy starts a rollout
/// to it in the same transaction (ROLLOUT_STARTED, `by` the principal).
pub async fn update(state: &AppState, path: &PoolRef, spec: PoolSpec, by: &str) -> Result<Pool, ApiError> {
    update_tagged(state, path, spec, by, None).await.map(|t| t.pool)
}

/// [`update`] conditioned on `if_match` (`If-Match`): a pool whose spec version it does not
/// name is left as it is, and the answer is 412 FAILED_PRECONDITION (`ETAG_MISMATCH`). The
/// check and the write are one statement ([`store::pool_update`]), so of concurrent updates
/// read from one version exactly one wins. A request refused anyway (a bad spec, an unknown
/// pool) is refused for that reason first.
pub async fn update_tagged(
    state: &AppState,
    path: &PoolRef,
    spec: PoolSpec,
    by: &str,
    if_match: Option<&IfMatch>,
) -> Result<Tagged, ApiError> {
    if spec.pool_ref() != *path {
        return Err(ApiError::InvalidArgument(format!(
            "the body names pool {} but the path names {path}: they must match (pools cannot be renamed)",
            spec.pool_ref()
        )));
    }
    validated(state, &spec)?;
    check_hosts_can_exec(state, &spec).await?;
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    check_hosts(&tx, &spec).await?;
    let versions = if_match.and_then(IfMatch::versions);
    // `*` (no versions) needs only the pool to exist, as every update does.
    let (revision, bumped) = match store::pool_update(&tx, &spec, versions).await? {
        store::PoolUpdate::NotFound => return Err(not_found(path)),
        store::PoolUpdate::VersionMismatch => {
            return Err(ApiError::PreconditionFailed(format!(
                "pool {path} was changed since its ETag was read (If-Match names none of its current spec): \
                 GET it again, apply your change to what it is now, and PUT with the new ETag"
            )));
        }
        store::PoolUpdate::Updated { from, revision, bumped } => {
            if bumped && spec.rollout.is_some() {
                store::rollout_start(&tx, path, from, revision, by).await?;
            }
            (revision, bumped)
        }
    };
    let (row, status) = store::pool_get(&tx, path).await?.ok_or_else(|| not_found(path))?;
    let audit = serde_json::json!({"by": by, "revision": revision, "new_revision": bumped});
    store::event_insert(&tx, EventType::PoolUpdated, path, None, None, &audit).await?;
    tx.commit().await?;
    drop(conn); // back before the wake: on Lambda it is the only one
    tracing::info!(pool = %path, size = spec.size, revision, new_revision = bumped, by, "pool updated");
    state.wake("pool updated").await;
    Ok(Tagged { pool: Pool::new(&row, status), etag: row.etag() })
}

pub async fn get(state: &AppState, pool: &PoolRef) -> Result<Pool, ApiError> {
    get_tagged(state, pool).await.map(|t| t.pool)
}

/// [`get`], with the pool's entity tag.
pub async fn get_tagged(state: &AppState, pool: &PoolRef) -> Result<Tagged, ApiError> {
    let conn = state.conn().await?;
    let (row, status) = store::pool_get(&conn, pool).await?.ok_or_else(|| not_found(pool))?;
    Ok(Tagged { pool: Pool::new(&row, status), etag: row.etag() })
}

/// Pauses (`pause`) or resumes the pool's rollout (`POST …/rollout/pause`, `…/resume`):
/// FAILED_PRECONDITION when no rollout is running (or paused, for a resume).
pub async fn rollout_pause(state: &AppState, pool: &PoolRef, pause: bool, by: &str) -> Result<Pool, ApiError> {
    // The connection goes back before the wake: on Lambda it is the only one, and the wake's
    // ask (or a second checkout for the answer) would wait for it.
    let answer = {
        let conn = state.conn().await?;
        let (row, _) = store::pool_get(&conn, pool).await?.ok_or_else(|| not_found(pool))?;
        if !store::rollout_set_paused(&conn, pool, pause).await? {
            let now = row.rollout_state.map_or("none ever ran".to_owned(), |s| format!("it is {s}"));
            return Err(ApiError::FailedPrecondition(if pause {
                format!("pool {pool} has no rollout running to pause ({now})")
            } else {
                format!("pool {pool} has no paused rollout to resume ({now})")
            }));
        }
        let kind = if pause { EventType::RolloutPaused } else { EventType::RolloutResumed };
        store::event_insert(&conn, kind, pool, None, None, &serde_json::json!({"by": by})).await?;
        let (row, status) = store::pool_get(&conn, pool).await?.ok_or_else(|| not_found(pool))?;
        Pool::new(&row, status)
    };
    tracing::info!(pool = %pool, by, paused = pause, "rollout {}", if pause { "paused" } else { "resumed" });
    if !pause {
        state.wake("rollout resumed").await;
    }
    Ok(answer)
}

/// `POST …/rollout/undo`: back to kept revision `to` (default: the newest kept one before the
/// pool's), with a rollout to it. The pool needs a rollout policy; `to` must be kept and not
/// the pool's revision.
pub async fn rollout_undo(state: &AppState, pool: &PoolRef, to: Option<i32>, by: &str) -> Result<Pool, ApiError> {
    let (answer, from) = undo_recorded(state, pool, to, by).await?;
    tracing::info!(pool = %pool, by, from, to = answer.revision, "rollout undo");
    state.wake("rollout undo").await;
    Ok(answer)
}

/// `rollout_undo`'s database half, on one connection that is back in the pool before the
/// wake (on Lambda it is the only one). Returns the pool after the undo and the revision it
/// left.
async fn undo_recorded(state: &AppState, pool: &PoolRef, to: Option<i32>, by: &str) -> Result<(Pool, i32), ApiError> {
    let conn = state.conn().await?;
    let (row, _) = store::pool_get(&conn, pool).await?.ok_or_else(|| not_found(pool))?;
    if row.rollout.is_none() {
        return Err(ApiError::FailedPrecondition(format!(
            "pool {pool} has no rollout policy: add a `rollout` block to its spec to undo through a rollout"
        )));
    }
    let revs = store::pool_revisions(&conn, pool).await?.unwrap_or_default();
    let to = match to {
        Some(t) => t,
        None => revs.iter().map(|r| r.revision).find(|r| *r < row.revision).ok_or_else(|| {
            ApiError::FailedPrecondition(format!("pool {pool} keeps no revision before {}", row.revision))
        })?,
    };
    if to == row.revision {
        return Err(ApiError::FailedPrecondition(format!("pool {pool} is on revision {to} already")));
    }
    let Some(target) = revs.iter().find(|r| r.revision == to) else {
        let list = revs.iter().map(|r| r.revision.to_string()).collect::<Vec<_>>().join(", ");
        return Err(ApiError::InvalidArgument(format!("revision {to} of pool {pool} is not kept (kept: {list})")));
    };
    // A kept revision from before the policy was tightened is not a way around it.
    within_policy(state, &target.spec)?;
    if !store::rollout_undo(&conn, pool, row.revision, to, by).await? {
        return Err(ApiError::Aborted(format!("pool {pool} changed meanwhile; look at it again and retry")));
    }
    let (after, status) = store::pool_get(&conn, pool).await?.ok_or_else(|| not_found(pool))?;
    Ok((Pool::new(&after, status), row.revision))
}

/// The pool's kept revisions, newest first (`GET /v1/pools/{namespace}/{name}/revisions`).
pub async fn revisions(state: &AppState, pool: &PoolRef) -> Result<crate::api::RevisionList, ApiError> {
    let conn = state.conn().await?;
    let revs = store::pool_revisions(&conn, pool).await?.ok_or_else(|| not_found(pool))?;
    Ok(crate::api::RevisionList { revisions: revs.iter().map(crate::api::Revision::from).collect() })
}

/// One page of pools by key, and the next page's token (empty on the last).
pub async fn list(
    state: &AppState,
    namespace: Option<&str>,
    page_size: Option<i64>,
    page_token: Option<&str>,
) -> Result<(Vec<Pool>, String), ApiError> {
    let size = super::page_size(page_size)?;
    let after =
        super::page_key(page_token, |key| key.split_once('/').and_then(|(ns, name)| PoolRef::parse(ns, name).ok()))?;
    let conn = state.conn().await?;
    let rows = store::pool_list_page(&conn, namespace, after.as_ref(), size + 1).await?;
    let (rows, next) = super::page_of(rows, size, |(p, _)| format!("{}/{}", p.namespace, p.name));
    Ok((rows.into_iter().map(|(r, s)| Pool::new(&r, s)).collect(), next))
}

/// The rows of a pool delete, in one transaction: committed when the pool was deleted,
/// rolled back (dropped) when it was refused or not found.
async fn delete_rows(state: &AppState, pool: &PoolRef, force: bool, by: &str) -> store::Result<PoolDelete> {
    let mut conn = state.db.get().await?;
    let tx = conn.transaction().await?;
    let outcome = store::pool_delete_and_mark_vms(&tx, pool, force).await?;
    if let PoolDelete::Deleted { vms, leases } = &outcome {
        let audit = serde_json::json!({"by": by, "force": force, "vms": vms.len(), "leases": leases.len()});
        store::event_insert(&tx, EventType::PoolDeleted, pool, None, None, &audit).await?;
        tx.commit().await?;
    }
    Ok(outcome)
}

async fn delete_one(state: &AppState, vm: &store::VmRow, host: Option<&store::HostRow>) {
    match crate::teardown::finish_vm_delete(&state.flintlock, &state.db, vm, host).await {
        // A release pending on this VM (its lease was not the pool delete's to take), finished
        // here first: the release then finds the row gone, so its release is recorded here,
        // as the reconciler's sweep does.
        Ok(store::VmFinish::Removed { lease: Some(l), .. }) => {
            let held = (chrono::Utc::now() - l.claimed_at).as_seconds_f64();
            state.metrics.release(&l.pool_ref(), "api", Some(held));
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(vm = %vm.id, error = %e, "VM of deleted pool left DELETING for the reconciler"),
    }
}

/// VMs a pool delete deletes in flintlock before it answers, at most; and how many at a time.
const POOL_DELETE_INLINE: usize = 64;
const POOL_DELETE_IN_FLIGHT: usize = 16;

/// Deletes a pool: its row goes, every VM becomes DELETING and every lease is removed in one
/// transaction; then each VM is deleted in flintlock, best effort. A VM whose delete fails
/// stays DELETING and the reconciler finishes it.
///
/// The transaction runs a second time when the database rolled it back for a deadlock or a
/// serialization failure (nothing of it was kept, and nothing outside the database happened
/// yet); a second such failure answers 503 with Retry-After.
pub async fn delete(state: &AppState, pool: &PoolRef, force: bool, by: &str) -> Result<(), ApiError> {
    let state = state.clone();
    let pool = pool.clone();
    let by = by.to_owned();
    super::detached(async move {
        let (vms, leases) = match store::retry_once(|| delete_rows(&state, &pool, force, &by)).await? {
            PoolDelete::NotFound => return Err(not_found(&pool)),
            PoolDelete::HasLeasedVms(n) => {
                return Err(ApiError::FailedPrecondition(format!(
                    "pool {pool} has {n} leased VM(s): release them or delete with force=true"
                )));
            }
            PoolDelete::Deleted { vms, leases } => (vms, leases),
        };
        let now = chrono::Utc::now();
        for l in &leases {
            state.metrics.release(&pool, "pool_delete", Some((now - l.claimed_at).as_seconds_f64()));
        }
        tracing::info!(%pool, vms = vms.len(), leases = leases.len(), force, by, "pool deleted");

        let hosts: HashMap<String, store::HostRow> = {
            let conn = state.conn().await?;
            store::host_list(&conn).await?.into_iter().map(|(h, _)| (h.name.clone(), h)).collect()
        };
        // Bounded (issue 23 finding 5): a 10,000-VM pool fanned out 10,000 deletes at once
        // from one request. The first POOL_DELETE_INLINE go now, POOL_DELETE_IN_FLIGHT at a
        // time; the rest stay DELETING for the reconciler (its stragglers' cleanup), woken here.
        // A loop, not a closure kept in the stream: that makes the future not `Send`.
        let mut deletes = Vec::with_capacity(vms.len().min(POOL_DELETE_INLINE));
        for vm in vms.iter().take(POOL_DELETE_INLINE) {
            deletes.push(delete_one(&state, vm, hosts.get(&vm.flintlock_host)));
        }
        futures::stream::iter(deletes).buffer_unordered(POOL_DELETE_IN_FLIGHT).collect::<Vec<()>>().await;
        if vms.len() > POOL_DELETE_INLINE {
            tracing::info!(%pool, left = vms.len() - POOL_DELETE_INLINE, "the rest of the deleted pool's VMs are left to the reconciler");
            state.wake("pool deleted").await;
        }
        Ok(())
    })
    .await
}

/// Announced demand: `claims` claims expected within `within_seconds`
/// (`POST /v1/pools/{namespace}/{name}/expect`). An autoscaled pool is sized for it at once
/// (up to its ceiling; the hint lasts `within_seconds` plus the pool's provisioning time and
/// counts down as claims arrive); any pool's reconciler is woken, so it refills without
/// waiting for the schedule.
pub async fn expect(
    state: &AppState,
    pool: &PoolRef,
    claims: i32,
    within_seconds: i32,
) -> Result<api::Expected, ApiError> {
    if !(1..=crate::rules::MAX_POOL_SIZE).contains(&claims) {
        return Err(ApiError::InvalidArgument(format!(
            "claims must be between 1 and {}, got {claims}",
            crate::rules::MAX_POOL_SIZE
        )));
    }
    if !(1..=3600).contains(&within_seconds) {
        return Err(ApiError::InvalidArgument(format!(
            "within_seconds must be between 1 and 3600, got {within_seconds}"
        )));
    }
    let default_p = state.config.autoscale.default_provisioning.as_secs_f64();
    let expected = {
        let conn = state.conn().await?;
        store::pool_expect(&conn, pool, claims, within_seconds, default_p).await?.ok_or_else(|| not_found(pool))?
    };
    let desired_size = if expected.autoscaled {
        // The hint is recorded: answering an error now would make the client retry and count
        // its claims twice. A sizing that fails here is the next pass's to do.
        if let Err(e) = crate::reconcile::scale::scale_pools(state, Some(pool)).await {
            tracing::warn!(%pool, error = %e, "demand hint recorded; the pool is sized by the next pass");
        }
        let conn = state.conn().await?;
        store::pool_get(&conn, pool).await?.map_or(expected.size, |(row, _)| row.target_size())
    } else {
        expected.size
    };
    tracing::info!(%pool, claims, within_seconds, desired_size, "demand announced");
    state.wake("demand hint").await;
    Ok(api::Expected { expected_until: expected.expected_until, desired_size })
}
