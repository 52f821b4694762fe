//! Events: the outbox read as a cursor feed, with an optional long-poll. Events are written
//! by the operations that cause them, never here.
//!
//! Never hands out an event id while a smaller one may still commit: a consumer that always
//! passes the last `next_after` sees every event exactly once, in id order
//! ([`crate::store::event_horizon`] says how).

use std::time::Duration;

use tokio::time::Instant;

use crate::api::EventList;
use crate::app::AppState;
use crate::error::ApiError;
use crate::store;

/// How often a long-poll looks for new events.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long a read waits for the writers of new events to finish even without a long-poll.
/// Writers are single statements or short transactions, done in milliseconds; only a
/// transaction left open (anywhere on the database server: the transaction ids are the
/// server's) holds the feed back longer, and then the answer is empty and the cursor kept.
const SETTLE_WAIT: Duration = Duration::from_secs(5);

/// First and longest pause between two checks for those writers.
const SETTLE_PAUSE: (Duration, Duration) = (Duration::from_millis(2), Duration::from_millis(50));

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
    let started = Instant::now();
    let deadline = started + wait;
    let settle_deadline = started + wait.max(SETTLE_WAIT);
    // Where the next look starts: `after`, moved past ids already seen to hold nothing for
    // this filter (settled, so nothing can appear there any more).
    let mut from = after;
    // Long-poll by polling: no LISTEN, so it works through a transaction-mode pooler. The
    // connection goes back to the pool between polls.
    let events = 'poll: loop {
        let horizon = {
            let conn = state.conn().await?;
            store::event_horizon(&conn, from).await?
        };
        if let Some(horizon) = horizon {
            let mut pause = SETTLE_PAUSE.0;
            loop {
                let listed = {
                    let conn = state.conn().await?;
                    store::event_list(&conn, from, horizon, namespace, pool, limit).await?
                };
                match listed {
                    // Events of other pools only (a filter): keep polling after them.
                    Some(events) if events.is_empty() => {
                        from = horizon.last_id;
                        break;
                    }
                    Some(events) => break 'poll events,
                    // A writer older than the horizon's transaction may still commit an id up
                    // to it.
                    None if Instant::now() >= settle_deadline => {
                        tracing::warn!(
                            after,
                            horizon = horizon.last_id,
                            "events feed: a transaction open for over {SETTLE_WAIT:?} holds the feed back; answering empty"
                        );
                        break 'poll vec![];
                    }
                    None => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(SETTLE_PAUSE.1);
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            break vec![];
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    };
    let next_after = events.last().map_or(after, |e| e.id);
    Ok(EventList { events: events.iter().map(Into::into).collect(), next_after })
}
