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

/// The key a `page_token` says the previous page ended at, parsed by `parse`. A page token is
/// a `next_page_token` passed back: the base64url (unpadded) of the last key of a page (a
/// lease id, a VM id, a host name, a pool's `namespace/name`). Anything else is
/// INVALID_ARGUMENT before it reaches SQL: bytes PostgreSQL refuses in text (`AA` is one NUL
/// byte), bytes that are not UTF-8, or a value no key can have.
pub fn page_key<K>(page_token: Option<&str>, parse: impl Fn(&str) -> Option<K>) -> Result<Option<K>, ApiError> {
    use crate::rules::{MAX_PAGE_TOKEN_CHARS, PAGE_TOKEN};
    use base64::Engine;
    let Some(token) = page_token.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    // The longest key encodes to MAX_PAGE_TOKEN_CHARS: no need to decode more.
    (PAGE_TOKEN.is_match(token) && token.len() <= MAX_PAGE_TOKEN_CHARS)
        .then(|| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).ok())
        .flatten()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .and_then(|key| parse(&key))
        .map(Some)
        .ok_or_else(|| ApiError::InvalidArgument("page_token is malformed: pass back next_page_token unchanged".into()))
}

/// `page_size` checked (default [`crate::rules::DEFAULT_PAGE_SIZE`]).
pub fn page_size(page_size: Option<i64>) -> Result<i64, ApiError> {
    use crate::rules::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE};
    let size = page_size.unwrap_or(DEFAULT_PAGE_SIZE);
    if !(1..=MAX_PAGE_SIZE).contains(&size) {
        return Err(ApiError::InvalidArgument(format!("page_size must be between 1 and {MAX_PAGE_SIZE}")));
    }
    Ok(size)
}

/// A page of `rows`, read with one row more than `size`: the rows to answer and the
/// `next_page_token` (empty on the last page), the base64url of the last row's `key`.
pub fn page_of<T>(mut rows: Vec<T>, size: i64, key: impl Fn(&T) -> String) -> (Vec<T>, String) {
    use base64::Engine;
    let more = rows.len() as i64 > size;
    rows.truncate(size as usize);
    let next = match (more, rows.last()) {
        (true, Some(last)) => base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key(last)),
        _ => String::new(),
    };
    (rows, next)
}

/// Records an admin's change of something that belongs to no pool (a host, a principal's
/// limits; issue 25 item 3): an event with an empty pool, `by` and `subject` (its key and
/// name, e.g. `("host", "spare")`) in its payload, in the caller's transaction.
pub(crate) async fn audit_fleet(
    tx: &impl crate::store::Executor,
    kind: crate::domain::EventType,
    subject: (&str, &str),
    by: &str,
    mut payload: serde_json::Value,
) -> crate::store::Result<()> {
    payload["by"] = serde_json::json!(by);
    payload[subject.0] = serde_json::json!(subject.1);
    crate::store::event_insert(tx, kind, &crate::domain::no_pool(), None, None, &payload).await.map(drop)
}
