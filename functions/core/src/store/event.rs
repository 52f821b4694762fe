//! The `events` table: [`EventRow`], the insert of an event on its own and the list the API
//! pages through. Most events are written by the statement that makes the change they
//! report, in the same transaction (see `vm.rs`, `lease.rs`, `claim.rs`).
//!
//! Never updates or deletes an event: the table is append-only.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed, json_req};
use crate::domain::{EventType, PoolRef};

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

pub async fn event_insert(
    c: &impl Executor,
    kind: EventType,
    pool: &PoolRef,
    vm_id: Option<&str>,
    lease_id: Option<&str>,
    payload: &serde_json::Value,
) -> Result<i64> {
    let kind = kind.as_str();
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
                (payload, Type::JSONB),
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
