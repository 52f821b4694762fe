//! The `events` table: [`EventRow`], the insert of an event on its own, the feed the API
//! pages through ([`event_horizon`], [`event_list`]) and retention ([`event_prune`]). Most
//! events are written by the statement that makes the change they report, in the same
//! transaction (see `vm.rs`, `lease.rs`, `claim.rs`).
//!
//! Never updates an event, and deletes only what retention ends. Never hands out an event id
//! while a smaller one may still commit (see [`event_horizon`]).

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed, json_col};
use crate::domain::{EventType, Keep, PoolRef, printable};

/// The most one string of an event's payload keeps, in bytes (hook failure reasons are cut
/// shorter by [`crate::flintlock::hook_failure`]; this bounds every other string).
pub const EVENT_STRING_CAP: usize = 4096;

/// An `events` row.
#[derive(Debug, Clone, Deserialize)]
pub struct EventRow {
    pub id: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub pool_namespace: String,
    pub pool_name: String,
    pub vm_id: Option<String>,
    pub lease_id: Option<String>,
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

/// What an event stores of `payload`: every string (keys too) through
/// [`printable`], at most [`EVENT_STRING_CAP`] bytes with control characters escaped. The one
/// place the payloads built in Rust pass before they are written ([`event_insert`],
/// `vm_transition`): a NUL (`\u0000`) anywhere makes PostgreSQL refuse the jsonb, and with it
/// the statement that made the change the event reports.
pub(crate) fn stored_payload(payload: &Value) -> Value {
    let text = |s: &str| printable(s, EVENT_STRING_CAP, Keep::Head);
    match payload {
        Value::String(s) => Value::String(text(s)),
        Value::Array(a) => Value::Array(a.iter().map(stored_payload).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, v)| (text(k), stored_payload(v))).collect()),
        other => other.clone(),
    }
}

pub async fn event_insert(
    c: &impl Executor,
    kind: EventType,
    pool: &PoolRef,
    vm_id: Option<&str>,
    lease_id: Option<&str>,
    payload: &serde_json::Value,
) -> Result<i64> {
    let kind = kind.as_str();
    let payload = stored_payload(payload);
    let row = c
        .timed_query_one(
            "INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id, payload)
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
            &[
                (&kind, Type::TEXT),
                (&pool.namespace, Type::TEXT),
                (&pool.name, Type::TEXT),
                (&vm_id, Type::TEXT),
                (&lease_id, Type::TEXT),
                (&payload, Type::JSONB),
            ],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// How far the feed can be read safely, from [`event_horizon`]: every event id up to
/// `last_id` has been handed out, to writers whose transaction ids are all below `xid`. Once
/// no transaction below `xid` is running, each of those events is committed (and visible) or
/// rolled back for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventHorizon {
    /// The largest event id handed out so far (committed or not); 0 before the first.
    pub last_id: i64,
    /// A transaction id assigned after `last_id` was read (the horizon's own, already ended).
    pub xid: i64,
}

/// The feed's horizon. Event ids come from a sequence, so they commit out of order: id 10 can
/// still be uncommitted while id 11 is visible, and a reader that handed out 11 would move its
/// consumer's cursor past 10 for good. So the feed hands out ids up to a horizon only once
/// every writer that could hold one of them has ended ([`event_list`] checks that).
///
/// Two statements, in this order (one statement would not say which it evaluates first):
/// 1. the sequence's `last_value`: the largest id handed out so far (CACHE 1, V8);
/// 2. a new transaction id (`pg_current_xact_id()`, committed at once by the statement).
///    Transaction ids are handed out in increasing order, and every writer of an id up to
///    `last_id` took its transaction id before its event id (`events_next_id()`, V8), so
///    before statement 1: its id is below this one.
///
/// Why a new transaction id and not the snapshot's `xmax`: `xmax` is one past the newest
/// *finished* transaction, and a writer that got its transaction id after that one finished
/// is running above it, invisible to every bound taken from that snapshot. Costs one
/// transaction id per read that finds new events: `None`, after statement 1 alone, when no id
/// above `after` has been handed out (an idle feed takes none). No session state: works
/// through a transaction-mode pooler. Run it on a connection, never inside a transaction of
/// the caller (statement 2 must end before [`event_list`] runs).
pub async fn event_horizon(c: &impl Executor, after: i64) -> Result<Option<EventHorizon>> {
    let last_id: i64 = c
        .timed_query_one("SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM events_id_seq", &[])
        .await?
        .try_get(0)?;
    if last_id <= after {
        return Ok(None);
    }
    let xid: i64 = c.timed_query_one("SELECT pg_current_xact_id()::text::bigint", &[]).await?.try_get(0)?;
    Ok(Some(EventHorizon { last_id, xid }))
}

/// Up to `limit` events with `after < id <= horizon.last_id`, optionally of one pool
/// namespace and/or pool name, in id order. `None` while a transaction below the horizon's
/// `xid` is still running (it may hold an id in that range that is not visible yet): the
/// caller waits and asks again with the same horizon.
pub async fn event_list(
    c: &impl Executor,
    after: i64,
    horizon: EventHorizon,
    namespace: Option<&str>,
    pool: Option<&str>,
    limit: i64,
) -> Result<Option<Vec<EventRow>>> {
    let rows = c
        .timed_query(
            // $1, the horizon's transaction, has ended, so every transaction below it that is
            // still running is listed in this statement's snapshot, whose xmin is the oldest
            // of them. xmin >= $1: none is left, so every id up to the horizon is committed
            // (and visible to this snapshot) or never will be. Always one row at least:
            // `settled` false, or true with no event.
            "SELECT s.settled, to_jsonb(e) AS event
             FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= $1 AS settled) s
             LEFT JOIN LATERAL (
                 SELECT * FROM events e
                 WHERE s.settled AND e.id > $2 AND e.id <= $3
                   AND ($4::text IS NULL OR e.pool_namespace = $4)
                   AND ($5::text IS NULL OR e.pool_name = $5)
                 ORDER BY e.id
                 LIMIT $6
             ) e ON true
             ORDER BY e.id",
            &[
                (&horizon.xid, Type::INT8),
                (&after, Type::INT8),
                (&horizon.last_id, Type::INT8),
                (&namespace, Type::TEXT),
                (&pool, Type::TEXT),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    let settled = match rows.first() {
        Some(r) => r.try_get::<_, bool>("settled")?,
        None => false,
    };
    if !settled {
        return Ok(None);
    }
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        if let Some(e) = json_col(r, "event")? {
            events.push(e);
        }
    }
    Ok(Some(events))
}

/// Deletes up to `batch` events created more than `older_than_seconds` before `now` (`None`:
/// the database's clock), oldest first; returns how many. Overlapping passes skip each
/// other's rows instead of waiting for them.
pub async fn event_prune(
    c: &impl Executor,
    older_than_seconds: f64,
    batch: i64,
    now: Option<DateTime<Utc>>,
) -> Result<u64> {
    c.timed_execute(
        // ARRAY(...) runs the subquery once; `IN (SELECT … LIMIT)` may be re-run by the plan
        // and delete more than one batch.
        "DELETE FROM events
         WHERE id = ANY(ARRAY(
             SELECT id FROM events
             WHERE created_at < coalesce($3, now()) - make_interval(secs => $1)
             ORDER BY created_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED
         ))",
        &[(&older_than_seconds, Type::FLOAT8), (&batch, Type::INT8), (&now, Type::TIMESTAMPTZ)],
    )
    .await
}
