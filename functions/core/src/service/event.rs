//! Events: the outbox read as a cursor feed, with an optional long-poll. Events are written
//! by the operations that cause them, never here.

use std::time::Duration;

use crate::api::EventList;
use crate::app::AppState;
use crate::error::ApiError;
use crate::store;

/// Up to `limit` events with an id above `after`, optionally of one pool namespace and/or
/// pool name. With a `wait`, polls until a first event arrives or the wait is over.
pub async fn list(
    state: &AppState,
    after: i64,
    namespace: Option<&str>,
    pool: Option<&str>,
    limit: i64,
    wait: Duration,
) -> Result<EventList, ApiError> {
    let deadline = tokio::time::Instant::now() + wait;
    // Long-poll by polling: no LISTEN, so it works through a transaction-mode pooler. The
    // connection goes back to the pool between polls.
    let events = loop {
        let events = {
            let conn = state.conn().await?;
            store::event_list(&conn, after, namespace, pool, limit).await?
        };
        if !events.is_empty() || tokio::time::Instant::now() >= deadline {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let next_after = events.last().map_or(after, |e| e.id);
    Ok(EventList { events: events.iter().map(Into::into).collect(), next_after })
}
