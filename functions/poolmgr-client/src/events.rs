//! Following the event feed: [`Client::event_feed`] returns an [`EventFeed`] that keeps the
//! cursor (`after` ← `next_after`) so every event is received once, in id order, as the
//! contract promises a consumer that always passes the last `next_after`.
//!
//! Must never move the cursor past events it did not hand out: it moves only when a batch
//! is returned, so a request that fails or is dropped midway is simply asked again.

use std::marker::PhantomData;
use std::time::Duration;

use futures_util::Stream;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::client::{Call, Client};
use crate::error::Error;
use crate::retry::Backoff;
use crate::types::{Event, EventQuery};

/// The server's longest long-poll (`wait_seconds` ≤ 20).
pub const MAX_WAIT_SECONDS: u64 = 20;

/// One answer of `GET /v1/events`, with events of any readable type.
#[derive(Deserialize)]
struct Batch<E> {
    events: Vec<E>,
    next_after: i64,
}

/// A cursor on the event feed ([`Client::event_feed`]). `E` is how an event is read:
/// [`Event`] by default, or e.g. `Box<serde_json::value::RawValue>` to keep the server's bytes.
#[derive(Debug)]
pub struct EventFeed<E = Event> {
    client: Client,
    query: EventQuery,
    _event: PhantomData<fn() -> E>,
}

impl Client {
    /// A feed of the events after `q.after` (of `q.pool`, `q.limit` per answer). With
    /// `q.wait_seconds` each request long-polls that long when nothing is new.
    pub fn event_feed<E: DeserializeOwned>(&self, q: EventQuery) -> EventFeed<E> {
        EventFeed { client: self.clone(), query: q, _event: PhantomData }
    }
}

impl<E: DeserializeOwned + Send + 'static> EventFeed<E> {
    /// The id of the last event handed out (pass it as `after` to resume later).
    pub fn cursor(&self) -> i64 {
        self.query.after
    }

    /// The next events: one request (retried on transient failures as the client's retry
    /// policy says), long-polling if the query says so; empty when nothing new came. The
    /// cursor moves past what is returned. Cancel-safe: a dropped call moves nothing.
    pub async fn next_batch(&mut self) -> Result<Vec<E>, Error> {
        let batch: Batch<E> = self.client.send(Call::events(&self.query)).await?.json()?;
        self.query.after = self.query.after.max(batch.next_after);
        Ok(batch.events)
    }

    /// Every event from the cursor on, for ever: long-polls (at most
    /// [`MAX_WAIT_SECONDS`] unless the query chose less), and transient failures are waited
    /// out with `backoff` however long they last. The stream ends after the first error that
    /// is not transient (a revoked token, an unknown pool), which it yields.
    pub fn follow(mut self, backoff: Backoff) -> impl Stream<Item = Result<E, Error>> + Send + 'static {
        if self.query.wait_seconds.is_none() {
            self.query.wait_seconds = Some(MAX_WAIT_SECONDS);
        }
        let state = (self, std::collections::VecDeque::<E>::new(), 0u32, false);
        futures_util::stream::unfold(state, move |(mut feed, mut buf, mut failures, ended)| async move {
            loop {
                if ended {
                    return None;
                }
                if let Some(e) = buf.pop_front() {
                    return Some((Ok(e), (feed, buf, 0, false)));
                }
                match feed.next_batch().await {
                    Ok(events) => buf.extend(events),
                    Err(e) if e.is_transient() => {
                        failures += 1;
                        let wait = backoff.delay(failures, e.retry_after(), &mut rand::rng());
                        tokio::time::sleep(wait.max(Duration::from_millis(50))).await;
                    }
                    Err(e) => return Some((Err(e), (feed, buf, failures, true))),
                }
            }
        })
    }
}
