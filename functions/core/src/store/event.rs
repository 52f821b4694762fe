//! The `events` table: [`EventRow`], the insert of an event on its own and the list the API
//! pages through. Most events are written by the statement that makes the change they
//! report, in the same transaction (see `vm.rs`, `lease.rs`, `claim.rs`).
//!
//! Never updates or deletes an event: the table is append-only.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed, json_req};
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

pub async fn event_list(
    c: &impl Executor,
    after: i64,
    namespace: Option<&str>,
    pool: Option<&str>,
    limit: i64,
) -> Result<Vec<EventRow>> {
    let rows = c
        .timed_query(
            "SELECT to_jsonb(e) AS event FROM events e
             WHERE e.id > $1
               AND ($2::text IS NULL OR e.pool_namespace = $2)
               AND ($3::text IS NULL OR e.pool_name = $3)
             ORDER BY e.id
             LIMIT $4",
            &[(&after, Type::INT8), (&namespace, Type::TEXT), (&pool, Type::TEXT), (&limit, Type::INT8)],
        )
        .await?;
    rows.iter().map(|r| json_req(r, "event")).collect()
}
