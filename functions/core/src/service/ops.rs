//! Operations: the health check's database round trip and the Prometheus text of
//! `/metrics`. Reads only: nothing here may write.

use crate::app::AppState;
use crate::error::ApiError;
use crate::store;

/// One round trip to the database: `Ok` when it answers.
pub async fn health(state: &AppState) -> Result<(), ApiError> {
    let conn = state.conn().await?;
    store::ping(&**conn).await?;
    Ok(())
}

/// The Prometheus text exposition (format 0.0.4): this process's counters, then the pool
/// gauges computed from the database now.
pub async fn metrics_text(state: &AppState) -> Result<String, ApiError> {
    let mut text = state.metrics.render();
    let conn = state.conn().await?;
    let pools = store::pool_gauges(&**conn).await?;
    type Gauge = fn(&store::PoolRow, &store::PoolStatus) -> i64;
    let gauges: [(&str, &str, Gauge); 5] = [
        ("poolmgr_pool_size", "Target size of the pool.", |p, _| i64::from(p.size)),
        ("poolmgr_pool_available", "AVAILABLE VMs.", |_, s| s.available),
        ("poolmgr_pool_leased", "LEASED VMs, plus VMs being claimed.", |_, s| s.leased + s.claiming),
        ("poolmgr_pool_provisioning", "VMs being provisioned or running create hooks.", |_, s| s.provisioning),
        ("poolmgr_pool_quarantined", "QUARANTINED VMs.", |_, s| s.quarantined),
    ];
    for (name, help, f) in gauges {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (p, s) in &pools {
            text.push_str(&format!(
                "{name}{{pool_namespace=\"{}\",pool_name=\"{}\"}} {}\n",
                p.namespace,
                p.name,
                f(p, s)
            ));
        }
    }
    Ok(text)
}
