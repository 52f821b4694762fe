//! The `deployment` table (migration V9): the one row holding this deployment's id.
//!
//! Never changes the id: it names every flintlock namespace the deployment created VMs in.

use super::{Executor, Result, StoreError, Timed};

/// The id the database generated for this deployment.
pub async fn deployment_get_id(c: &impl Executor) -> Result<String> {
    let row = c.timed_query_opt("SELECT id FROM deployment", &[]).await?;
    let row = row.ok_or_else(|| StoreError::Db("the deployment table has no row (migration V9)".into()))?;
    Ok(row.try_get(0)?)
}
