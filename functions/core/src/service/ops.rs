//! Operations: the health check's database round trip and the Prometheus text of
//! `/metrics`. Reads only: nothing here may write.

use crate::app::AppState;
use crate::error::ApiError;
use crate::store;

/// One round trip to the database: `Ok` when it answers.
pub async fn health(state: &AppState) -> Result<(), ApiError> {
    let conn = state.conn().await?;
    store::ping(&conn).await?;
    Ok(())
}

/// The Prometheus text exposition (format 0.0.4): this process's counters, then the pool
/// gauges computed from the database now.
pub async fn metrics_text(state: &AppState) -> Result<String, ApiError> {
    let mut text = state.metrics.render();
    let conn = state.conn().await?;
    text.push_str(&crate::metrics::render_pool_gauges(&store::pool_gauges(&conn).await?));
    Ok(text)
}
