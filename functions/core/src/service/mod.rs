//! The operations behind the routes. Each takes the shared state and parsed input, runs its
//! transactions, and answers in `ApiError` terms. No HTTP here: every handler in `crate::http`
//! calls one of these, never the store.
//!
//! - `claim`: ClaimVM; `lease`: get, list, heartbeat, release.
//! - `pool`, `host`: create, read, update, delete; host cordons.
//! - `vm`: reads, and an operator's discard of one VM; `event`: the feed and its long-poll.
//! - `ops`: the health round trip and the `/metrics` text.

pub mod claim;
pub mod event;
pub mod host;
pub mod lease;
pub mod ops;
pub mod pool;
pub mod principal;
pub mod vm;

use std::future::Future;

use crate::error::ApiError;

/// Runs `fut` on its own task so it completes even if the caller is dropped (the client
/// disconnected). Cleanup that must not stop halfway — a release between its DELETING mark
/// and the row removal — runs through here. The task keeps the request's correlation id
/// ([`crate::error::REQUEST_ID`]).
pub async fn detached<T: Send + 'static>(
    fut: impl Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    let task = match crate::error::REQUEST_ID.try_with(Clone::clone) {
        Ok(id) => tokio::spawn(crate::error::REQUEST_ID.scope(id, fut)),
        Err(_) => tokio::spawn(fut),
    };
    match task.await {
        Ok(r) => r,
        Err(e) => Err(ApiError::internal(format!("detached task failed: {e}"))),
    }
}
