//! [`LeaseRow`], the `leases` row. It lives here rather than in `lease.rs` because `vm.rs`
//! returns it (a finished VM delete hands back the lease it removed) while `lease.rs` returns
//! [`super::VmRow`]: one of the two rows sits below both files, so they do not import each
//! other.
//!
//! Never holds a statement: row types only.

use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::domain::PoolRef;

/// A `leases` row.
#[derive(Debug, Clone, Deserialize)]
pub struct LeaseRow {
    pub lease_id: String,
    pub vm_id: String,
    pub pool_namespace: String,
    pub pool_name: String,
    pub claimed_at: DateTime<Utc>,
    pub last_heartbeat_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub request_id: Option<String>,
    pub principal: String,
}

impl LeaseRow {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.pool_namespace.clone(), name: self.pool_name.clone() }
    }
}
