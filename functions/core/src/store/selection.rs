//! The `reconcile_selection` table: the one row saying what the passes have seen so far (the
//! watermark of events and pool steps, and the cursor of the pools checked in full), read
//! by the selection ([`super::pool_list_with_work`]) and moved on by a pass that leased every
//! pool it selected.
//!
//! Never moves the watermark back (`greatest`): of two overlapping passes, the one that
//! finishes last must not undo what the other saw.

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed};
use crate::domain::PoolRef;

/// The database's now, and the horizon of a pass starting now: the start of the oldest
/// transaction still open in this database (other client connections only), or now when
/// none is. A change stamps its event's `created_at` with its transaction's start and may
/// commit long after it; a write from a transaction not open any more committed before this statement,
/// so a selection that runs after it sees the write. Hence everything stamped before the
/// horizon is seen by the selection that follows, and the next selection may look only at
/// what is stamped from the horizon on.
///
/// `pg_stat_activity` shows the `xact_start` of other roles' connections only to a role
/// with `pg_read_all_stats`; poolmgr's functions connect as one role, so they see each
/// other's (a foreign role's transaction is covered by the margin and the full checks only).
pub async fn selection_horizon(c: &impl Executor) -> Result<(DateTime<Utc>, DateTime<Utc>)> {
    let row = c
        .timed_query_one(
            "SELECT now(), least(now(), (SELECT min(a.xact_start) FROM pg_stat_activity a
                                         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                                           AND a.backend_type = 'client backend'))",
            &[],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// Records what a pass that leased every pool it selected has seen: events and pool steps
/// stamped before `horizon` (its [`selection_horizon`]), and the pools checked in full up to
/// `checked` (key order; `None`: it checked none).
pub async fn selection_advance(c: &impl Executor, horizon: DateTime<Utc>, checked: Option<&PoolRef>) -> Result<()> {
    let (ns, name) = (checked.map(|p| p.namespace.as_str()), checked.map(|p| p.name.as_str()));
    c.timed_execute(
        "UPDATE reconcile_selection SET seen_through = greatest(seen_through, $1),
             checked_namespace = coalesce($2, checked_namespace), checked_name = coalesce($3, checked_name),
             updated_at = now()",
        &[(&horizon, Type::TIMESTAMPTZ), (&ns, Type::TEXT), (&name, Type::TEXT)],
    )
    .await?;
    Ok(())
}

/// The planner settings of the selection, for the rest of the transaction `c` is (`SET
/// LOCAL`: nothing outlives it, so a transaction pooler may hand the connection on
/// afterwards). Every lookup of the selection is an index probe or an index range
/// (`store::pool_list_with_work`), and its statistics are at their worst when it matters:
/// right after a fleet filled, `vms` was analyzed full of PROVISIONING rows.
/// - No JIT: the estimated cost of the candidates' counts can pass `jit_above_cost` while
///   the work is small (compiling took 66 of 98 ms over 100 pools with stale statistics).
/// - No sequential scans, bitmap scans, merge or hash joins: measured at 10,000 pools just
///   after the fill, the planner scanned `pools` and sorted it for a merge join, and read
///   `vms_phase_due` with a bitmap scan, which never marks the index entries of the 100,000
///   VMs that had left PROVISIONING as dead, so every pass read them all again (75 ms a
///   selection; 17 ms with these settings, the dead entries skipped from the second pass).
pub async fn selection_planner_settings(c: &impl Executor) -> Result<()> {
    // One statement (set_config(…, true) is SET LOCAL): the extended protocol takes one.
    c.timed_query_one(
        "SELECT set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true),
                set_config('enable_bitmapscan', 'off', true), set_config('enable_mergejoin', 'off', true),
                set_config('enable_hashjoin', 'off', true)",
        &[],
    )
    .await?;
    Ok(())
}
