//! Which microVMs belong to this deployment: [`Deployment`], the id every flintlock namespace
//! of the deployment carries, and how a namespace is read back.
//!
//! Several poolmgr deployments (each with its own database) may share flintlock hosts. The
//! orphan scan deletes microVMs no row accounts for, so it must only ever look at microVMs
//! it can attribute to its own deployment: those in a namespace `<prefix><id>-<pool
//! namespace>`. The id has no `-`, so the first `-` after the prefix ends it and no other
//! deployment's namespace (another id) parses as ours. Nothing here touches the database
//! or the network; the id comes from `POOLMGR_DEPLOYMENT_ID` or the database (migration V9),
//! see `AppState::deployment`.

use std::sync::LazyLock;

use regex::Regex;

/// A deployment id: lowercase letters and digits, 1 to 20 of them (the database's default is
/// 12 hex digits).
pub const DEPLOYMENT_ID_PATTERN: &str = r"^[a-z0-9]{1,20}$";

/// This deployment's flintlock namespaces: `<prefix><id>-<pool namespace>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deployment {
    prefix: String,
    id: String,
}

/// Checks a deployment id against [`DEPLOYMENT_ID_PATTERN`].
pub fn validate_deployment_id(id: &str) -> Result<(), String> {
    static RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(DEPLOYMENT_ID_PATTERN).expect("valid pattern"));
    if RE.is_match(id) {
        Ok(())
    } else {
        Err(format!("deployment id {id:?} must be 1-20 lowercase letters and digits (no '-')"))
    }
}

impl Deployment {
    /// `prefix` is `POOLMGR_FLINTLOCK_NAMESPACE_PREFIX` (`poolmgr-`).
    pub fn new(prefix: &str, id: &str) -> Result<Deployment, String> {
        validate_deployment_id(id)?;
        Ok(Deployment { prefix: prefix.to_owned(), id: id.to_owned() })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The flintlock namespace of this deployment's VMs of pool namespace `pool_namespace`.
    pub fn namespace(&self, pool_namespace: &str) -> String {
        format!("{}{}-{pool_namespace}", self.prefix, self.id)
    }

    /// The pool namespace of one of this deployment's flintlock namespaces; `None` for any
    /// other namespace (another deployment's, one poolmgr used before deployment ids, anyone
    /// else's): a microVM there is not ours to delete.
    pub fn pool_namespace<'n>(&self, flintlock_namespace: &'n str) -> Option<&'n str> {
        let rest = flintlock_namespace.strip_prefix(&self.prefix)?.strip_prefix(&self.id)?;
        rest.strip_prefix('-').filter(|ns| crate::domain::validate_name("namespace", ns).is_ok())
    }

    /// Whether a microVM with one of our VM ids in `flintlock_namespace` is that VM: in this
    /// deployment's namespace of `pool_namespace`, or in the one poolmgr used before
    /// deployment ids (`<prefix><pool namespace>`), so a create sent before the upgrade whose
    /// reply was lost is still adopted. (VM ids are ULIDs this deployment made: no one else
    /// creates a VM with that id.)
    pub fn holds(&self, flintlock_namespace: &str, pool_namespace: &str) -> bool {
        flintlock_namespace == self.namespace(pool_namespace)
            || flintlock_namespace.strip_prefix(&self.prefix) == Some(pool_namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_reads_back_only_for_its_own_deployment() {
        let d = Deployment::new("poolmgr-", "3fa9c01b7d2e").unwrap();
        let ns = d.namespace("team-a");
        assert_eq!(ns, "poolmgr-3fa9c01b7d2e-team-a");
        assert_eq!(d.pool_namespace(&ns), Some("team-a"));
        // Another deployment, even one whose id starts with ours or is a prefix of ours.
        for other in ["3fa9c01b7d2e0", "3fa9c01b7d2", "x"] {
            let theirs = Deployment::new("poolmgr-", other).unwrap().namespace("team-a");
            assert_eq!(d.pool_namespace(&theirs), None, "{theirs}");
        }
        // poolmgr's namespace before deployment ids, other prefixes, and junk.
        for ns in ["poolmgr-team-a", "poolmgr-3fa9c01b7d2e", "poolmgr-3fa9c01b7d2e-", "team-a", "", "x-3fa9c01b7d2e-a"]
        {
            assert_eq!(d.pool_namespace(ns), None, "{ns}");
        }
        assert_eq!(d.pool_namespace("poolmgr-3fa9c01b7d2e-Team"), None, "not a pool namespace");
    }

    #[test]
    fn a_vm_is_adopted_from_its_namespace_or_the_one_before_deployment_ids() {
        let d = Deployment::new("poolmgr-", "abc").unwrap();
        assert!(d.holds("poolmgr-abc-default", "default"));
        assert!(d.holds("poolmgr-default", "default"));
        assert!(!d.holds("poolmgr-xyz-default", "default"));
        assert!(!d.holds("poolmgr-abc-other", "default"));
    }

    #[test]
    fn deployment_ids_are_letters_and_digits() {
        for ok in ["a", "0", "3fa9c01b7d2e", "prod1", &"a".repeat(20)] {
            assert!(validate_deployment_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a-b", "Prod", "a_b", "a.b", "é", &"a".repeat(21), " a"] {
            assert!(validate_deployment_id(bad).is_err(), "{bad}");
        }
    }
}
