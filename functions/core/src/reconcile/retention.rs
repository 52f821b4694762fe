//! Events retention: the pass deletes events older than `POOLMGR_EVENTS_RETENTION` (7 days
//! by default), in batches, oldest first.
//!
//! Never one big delete: each batch is its own short statement, so the pass never holds a
//! transaction open that would keep the events feed waiting (`store::event_horizon`) or
//! bloat one transaction. Never deletes an event younger than the retention.

use super::{Pass, PassReport};
use crate::store;

/// Events one statement deletes.
const BATCH: i64 = 1000;

/// Deletes expired events batch by batch until none is left or the pass deadline.
pub(super) async fn prune_events(pass: &Pass<'_>) -> PassReport {
    let mut report = PassReport::default();
    let Some(retention) = pass.state.config.reconcile.events_retention else {
        return report;
    };
    loop {
        if pass.past_cleanup_deadline() {
            report.deadline_reached = true;
            break;
        }
        // A connection per batch, given back in between (see "Connections" in `super`).
        let pruned = match pass.state.db.get().await {
            Ok(c) => store::event_prune(&c, retention.as_secs_f64(), BATCH, pass.state.clock.now_param()).await,
            Err(e) => Err(e),
        };
        match pruned {
            Ok(n) => {
                report.events_pruned += n;
                if n < BATCH as u64 {
                    break;
                }
            }
            Err(e) => {
                report.errors.push(format!("pruning events: {e}"));
                break;
            }
        }
    }
    if report.events_pruned > 0 {
        tracing::info!(pruned = report.events_pruned, retention_secs = retention.as_secs(), "old events pruned");
    }
    report
}
