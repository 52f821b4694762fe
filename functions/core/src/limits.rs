//! Client scopes and quotas (issue 25 item 2): which pools a client principal may claim from
//! and how many live leases it may hold, from the `principal_limits` table (V22), changed
//! through `/v1/principals/{name}` without a redeploy.
//!
//! Every function instance keeps the whole table for [`LimitsCache`]'s time to live
//! (`POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS`, default 5): a change reaches every instance
//! within it. The quota itself is counted in the claim's transaction under a row lock
//! (`store::principal_quota_lock`), so concurrent claims can never exceed it.
//!
//! Admins are never limited. A principal without limits may claim from every pool.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::domain::{PoolRef, validate_name};
use crate::error::ApiError;
use crate::store::{self, PrincipalLimitsRow};

/// The most patterns one principal may have.
pub const MAX_PATTERNS: usize = 100;

/// A pool pattern: `namespace/*` or `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolPattern {
    Namespace(String),
    Pool(PoolRef),
}

impl PoolPattern {
    pub fn parse(raw: &str) -> Result<PoolPattern, String> {
        let bad =
            |why: String| format!("pool pattern {raw:?} is invalid: {why}; write `namespace/*` or `namespace/name`");
        let (ns, name) = raw.split_once('/').ok_or_else(|| bad("it has no `/`".into()))?;
        validate_name("namespace", ns).map_err(bad)?;
        if name == "*" {
            return Ok(PoolPattern::Namespace(ns.to_owned()));
        }
        PoolRef::parse(ns, name).map(PoolPattern::Pool).map_err(bad)
    }

    pub fn matches(&self, pool: &PoolRef) -> bool {
        match self {
            PoolPattern::Namespace(ns) => *ns == pool.namespace,
            PoolPattern::Pool(p) => p == pool,
        }
    }
}

/// One principal's limits, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// `None`: every pool.
    pub pools: Option<Vec<PoolPattern>>,
    pub max_live_leases: Option<i32>,
}

impl Limits {
    fn from_row(row: &PrincipalLimitsRow) -> Limits {
        // The API validated every stored pattern; one that does not parse (written by hand)
        // matches nothing: a limit fails closed.
        let pools = row.pools.as_ref().map(|ps| ps.iter().filter_map(|p| PoolPattern::parse(p).ok()).collect());
        Limits { pools, max_live_leases: row.max_live_leases }
    }

    pub fn allows(&self, pool: &PoolRef) -> bool {
        self.pools.as_ref().is_none_or(|ps| ps.iter().any(|p| p.matches(pool)))
    }
}

/// Validates an admin's limits for `principal`: the name as tokens name principals, each
/// pattern, at most [`MAX_PATTERNS`] of them, a quota ≥ 0.
pub fn validate(principal: &str, pools: Option<&[String]>, max_live_leases: Option<i32>) -> Result<(), ApiError> {
    if !crate::auth::valid_name(principal) {
        return Err(ApiError::InvalidArgument(format!(
            "principal {principal:?} is invalid: a principal is named like a token's name: letters, digits, `.`, `_` and `-`, starting with a letter or digit, at most {}",
            crate::auth::MAX_NAME_LEN
        )));
    }
    if let Some(ps) = pools {
        if ps.len() > MAX_PATTERNS {
            return Err(ApiError::InvalidArgument(format!("pools has {} patterns: at most {MAX_PATTERNS}", ps.len())));
        }
        for p in ps {
            PoolPattern::parse(p).map_err(|e| ApiError::InvalidArgument(format!("pools: {e}")))?;
        }
    }
    if max_live_leases.is_some_and(|m| m < 0) {
        return Err(ApiError::InvalidArgument("max_live_leases must be ≥ 0 (null: no quota)".into()));
    }
    Ok(())
}

struct Snapshot {
    at: Instant,
    by_principal: Arc<HashMap<String, Limits>>,
}

/// Every principal's limits, read from the database at most once per time to live.
pub struct LimitsCache {
    ttl: Duration,
    snapshot: tokio::sync::Mutex<Option<Snapshot>>,
}

impl LimitsCache {
    pub fn new(ttl: Duration) -> LimitsCache {
        LimitsCache { ttl, snapshot: tokio::sync::Mutex::new(None) }
    }

    /// The limits of `principal`, `None` if it has none. Reads the table when the snapshot is
    /// older than the time to live; a failed read is the caller's error (a claim whose limits
    /// cannot be known is not served unlimited).
    pub async fn of(&self, db: &crate::db::Db, principal: &str) -> Result<Option<Limits>, ApiError> {
        let mut snap = self.snapshot.lock().await;
        let fresh = snap.as_ref().is_some_and(|s| s.at.elapsed() < self.ttl);
        if !fresh {
            let conn = db.get().await?;
            let rows = store::principal_limits_all(&conn).await?;
            let map = rows.iter().map(|r| (r.principal.clone(), Limits::from_row(r))).collect();
            *snap = Some(Snapshot { at: Instant::now(), by_principal: Arc::new(map) });
        }
        Ok(snap.as_ref().and_then(|s| s.by_principal.get(principal).cloned()))
    }

    /// Forgets the snapshot: this instance's next look reads the table (after an admin's
    /// change through this instance).
    pub async fn invalidate(&self) {
        *self.snapshot.lock().await = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(ns: &str, name: &str) -> PoolRef {
        PoolRef::parse(ns, name).unwrap()
    }

    #[test]
    fn patterns_name_a_namespace_or_one_pool() {
        let ns = PoolPattern::parse("team-a/*").unwrap();
        assert!(ns.matches(&pool("team-a", "ci")) && !ns.matches(&pool("team-b", "ci")));
        let one = PoolPattern::parse("team-a/ci").unwrap();
        assert!(one.matches(&pool("team-a", "ci")) && !one.matches(&pool("team-a", "cd")));
        for bad in ["team-a", "*/*", "team-a/c*", "Team/x", "a/b/c", "/x", "x/", "*"] {
            assert!(PoolPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn no_patterns_allow_every_pool_and_an_empty_list_none() {
        let all = Limits { pools: None, max_live_leases: None };
        assert!(all.allows(&pool("x", "y")));
        let none = Limits { pools: Some(vec![]), max_live_leases: None };
        assert!(!none.allows(&pool("x", "y")));
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(validate("ci", Some(&["team-a/*".into()]), Some(3)).is_ok());
        let e = validate("ci runner", None, None).unwrap_err().to_string();
        assert!(e.contains("principal"), "{e}");
        let e = validate("ci", Some(&["nope".into()]), None).unwrap_err().to_string();
        assert!(e.contains("pools") && e.contains("nope"), "{e}");
        assert!(validate("ci", None, Some(-1)).unwrap_err().to_string().contains("max_live_leases"));
    }
}
