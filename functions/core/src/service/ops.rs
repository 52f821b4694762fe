//! Operations: the readiness check (the database answers and has this binary's schema) and
//! the Prometheus text of `/metrics`. Reads only: nothing here may write. Liveness needs
//! nothing from here: a process that answers is alive.

use crate::app::AppState;
use crate::error::ApiError;
use crate::{db, store};

/// Ready to serve: the database answers and its newest applied migration is this binary's
/// newest ([`db::schema_current`]). Checked on every call, so a database migrated by another
/// build after this process connected makes it unready too.
pub async fn ready(state: &AppState) -> Result<(), ApiError> {
    let conn = state.conn().await?;
    let applied = store::schema_latest_applied(&conn).await?;
    db::schema_current(applied).map_err(|e| ApiError::unavailable(e.to_string(), &e).reason("SCHEMA_MISMATCH"))
}

/// The Prometheus text exposition (format 0.0.4): this process's counters, then the pool
/// gauges computed from the database now.
pub async fn metrics_text(state: &AppState) -> Result<String, ApiError> {
    let mut text = state.metrics.render();
    let conn = state.conn().await?;
    text.push_str(&crate::metrics::render_pool_gauges(&store::pool_gauges(&conn).await?));
    Ok(text)
}
