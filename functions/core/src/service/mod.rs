//! The operations behind the routes: claim, lease, pool, host. Each takes the shared state
//! and parsed input, runs its transactions, and answers in `ApiError` terms. No HTTP here.

pub mod claim;
pub mod host;
pub mod lease;
pub mod pool;

use std::future::Future;

use crate::error::ApiError;

/// Runs `fut` on its own task so it completes even if the caller is dropped (the client
/// disconnected). Cleanup that must not stop halfway — a release between its DELETING mark
/// and the row removal — runs through here.
pub async fn detached<T: Send + 'static>(
    fut: impl Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::spawn(fut).await {
        Ok(r) => r,
        Err(e) => Err(ApiError::internal(format!("detached task failed: {e}"))),
    }
}
