//! Operations: the readiness check (the database answers and has this binary's schema) and
//! the Prometheus text of `/metrics`. Reads only: nothing here may write. Liveness needs
//! nothing from here: a process that answers is alive.

use std::time::{Duration, Instant};

use crate::app::AppState;
use crate::error::ApiError;
use crate::{db, store};

/// Ready to serve: the database answers and its newest applied migration is this binary's
/// newest ([`db::schema_current`]). Checked again once the last answer is older than
/// `POOLMGR_HEALTH_CACHE_SECONDS` ([`HealthCache`]), so a database migrated by another build
/// after this process connected makes it unready within that.
pub async fn ready(state: &AppState) -> Result<(), ApiError> {
    state.health.answer(check_ready(state)).await
}

async fn check_ready(state: &AppState) -> Result<(), ApiError> {
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

/// The last readiness answer of this instance, success or failure, kept for a short time.
/// One check runs at a time: probes that arrive during it wait for its answer instead of
/// starting their own, so a flood of unauthenticated probes costs the database one query
/// per period per instance (and none from the queue behind a hung connect).
pub struct HealthCache {
    ttl: Duration,
    last: tokio::sync::Mutex<Option<(Instant, Result<(), ApiError>)>>,
}

impl HealthCache {
    /// `ttl` zero: every probe checks.
    pub fn new(ttl: Duration) -> HealthCache {
        HealthCache { ttl, last: tokio::sync::Mutex::new(None) }
    }

    async fn answer(&self, check: impl Future<Output = Result<(), ApiError>>) -> Result<(), ApiError> {
        if self.ttl.is_zero() {
            return check.await;
        }
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = last.as_ref()
            && at.elapsed() < self.ttl
        {
            return answer.clone();
        }
        let answer = check.await;
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}
