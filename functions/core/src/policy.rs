//! The deployment's spec policy (issue 25 item 1): what a pool's `microvm_template` may ask of
//! a host, set by whoever deploys poolmgr (environment, template parameters), never through
//! the API, so an admin token cannot widen it.
//!
//! | setting | limits | default |
//! |---|---|---|
//! | `POOLMGR_POLICY_VIRTIOFS_PATHS` | host directories a volume's `virtiofs_source` may share: the path itself or anything under it | none |
//! | `POOLMGR_POLICY_BRIDGES` | host bridges an interface's `overrides.bridge_name` may name, exactly | none |
//! | `POOLMGR_POLICY_IMAGE_PREFIXES` | prefixes of every image: kernel, initrd, root and additional volumes' `container_source` | any |
//!
//! Each is a comma-separated list; `*` alone allows anything; blank is the same as unset. A spec outside the policy is
//! refused at create, update and rollout undo with a 400 naming the field (reason
//! `SPEC_POLICY`); the reconciler creates no VM for a pool whose stored spec the policy no
//! longer allows (written before the policy was tightened), holding it below target with the
//! same message, so tightening the policy takes effect without touching the pools.

use crate::config::ConfigError;
use crate::template::MicroVmTemplate;

/// One list of the policy: anything, or only what matches an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allow {
    Any,
    Only(Vec<String>),
}

impl Allow {
    fn parse(
        lookup: &impl Fn(&str) -> Option<String>,
        var: &str,
        default: Allow,
        check: impl Fn(&str) -> Result<(), String>,
    ) -> Result<Allow, ConfigError> {
        // Unset and blank are alike (a template parameter left empty): the default.
        let Some(raw) = lookup(var).filter(|v| !v.trim().is_empty()) else { return Ok(default) };
        let entries: Vec<String> = raw.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
        if entries.iter().any(|e| e == "*") {
            return if entries.len() == 1 {
                Ok(Allow::Any)
            } else {
                Err(ConfigError(format!("{var}: `*` allows anything and must be the only entry")))
            };
        }
        for e in &entries {
            check(e).map_err(|why| ConfigError(format!("{var} entry {e:?} {why}")))?;
        }
        Ok(Allow::Only(entries))
    }

    fn describe(&self) -> String {
        match self {
            Allow::Any => "anything".to_owned(),
            Allow::Only(v) if v.is_empty() => "none".to_owned(),
            Allow::Only(v) => v.join(", "),
        }
    }
}

/// What a pool's template may ask of a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecPolicy {
    pub virtiofs_paths: Allow,
    pub bridges: Allow,
    pub image_prefixes: Allow,
}

impl Default for SpecPolicy {
    /// No host directory, no bridge override, any image.
    fn default() -> Self {
        SpecPolicy { virtiofs_paths: Allow::Only(vec![]), bridges: Allow::Only(vec![]), image_prefixes: Allow::Any }
    }
}

const VIRTIOFS_VAR: &str = "POOLMGR_POLICY_VIRTIOFS_PATHS";
const BRIDGES_VAR: &str = "POOLMGR_POLICY_BRIDGES";
const IMAGES_VAR: &str = "POOLMGR_POLICY_IMAGE_PREFIXES";

/// An absolute path without `.`/`..` components, empty components or a trailing `/` (but `/`
/// itself): the only form compared, so `/srv/a/../..` can never pass as under `/srv/a`.
fn plain_absolute(path: &str) -> Result<(), String> {
    if path == "/" {
        return Ok(());
    }
    if !path.starts_with('/') {
        return Err("is not an absolute path".into());
    }
    if path[1..].split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err("must be a plain absolute path: no `.` or `..` components, `//` or trailing `/`".into());
    }
    if path.chars().any(char::is_control) {
        return Err("contains a control character".into());
    }
    Ok(())
}

/// `path` is `prefix` or under it, component by component (`/srv/a` does not cover `/srv/ab`).
fn path_within(path: &str, prefix: &str) -> bool {
    prefix == "/" || path == prefix || path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('/'))
}

impl SpecPolicy {
    pub fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<SpecPolicy, ConfigError> {
        let d = SpecPolicy::default();
        Ok(SpecPolicy {
            virtiofs_paths: Allow::parse(lookup, VIRTIOFS_VAR, d.virtiofs_paths, plain_absolute)?,
            bridges: Allow::parse(lookup, BRIDGES_VAR, d.bridges, |b| {
                // Linux interface names: at most 15 bytes, no '/', whitespace or ':'.
                if b.len() > 15 || b.chars().any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control()) {
                    Err("is not a Linux interface name (at most 15 characters, no `/`, `:` or spaces)".into())
                } else {
                    Ok(())
                }
            })?,
            image_prefixes: Allow::parse(lookup, IMAGES_VAR, d.image_prefixes, |_| Ok(()))?,
        })
    }

    /// The first field of `t` outside the policy, named as in the API
    /// (`microvm_template.additional_volumes[0].source.virtiofs_source`), with what is allowed
    /// and which setting widens it.
    pub fn check(&self, t: &MicroVmTemplate) -> Result<(), String> {
        let mut images: Vec<(String, &str)> = Vec::new();
        if let Some(k) = &t.kernel {
            images.push(("kernel.image".into(), &k.image));
        }
        if let Some(i) = &t.initrd {
            images.push(("initrd.image".into(), &i.image));
        }
        let volumes = t
            .root_volume
            .iter()
            .map(|v| ("root_volume".to_owned(), v))
            .chain(t.additional_volumes.iter().enumerate().map(|(i, v)| (format!("additional_volumes[{i}]"), v)));
        for (at, v) in volumes {
            if let Some(img) = v.source.container_source.as_deref() {
                images.push((format!("{at}.source.container_source"), img));
            }
            if let Some(path) = v.source.virtiofs_source.as_deref() {
                let field = format!("{at}.source.virtiofs_source");
                plain_absolute(path).map_err(|why| format!("microvm_template.{field} {path:?} {why}"))?;
                if let Allow::Only(allowed) = &self.virtiofs_paths
                    && !allowed.iter().any(|p| path_within(path, p))
                {
                    return Err(self.refusal(&field, path, &self.virtiofs_paths, VIRTIOFS_VAR, "host directories"));
                }
            }
        }
        if let Allow::Only(prefixes) = &self.image_prefixes {
            for (field, img) in &images {
                if !prefixes.iter().any(|p| img.starts_with(p.as_str())) {
                    return Err(self.refusal(field, img, &self.image_prefixes, IMAGES_VAR, "image prefixes"));
                }
            }
        }
        if let Allow::Only(bridges) = &self.bridges {
            for (i, nic) in t.interfaces.iter().enumerate() {
                if let Some(b) = nic.overrides.as_ref().and_then(|o| o.bridge_name.as_deref())
                    && !bridges.iter().any(|a| a == b)
                {
                    let field = format!("interfaces[{i}].overrides.bridge_name");
                    return Err(self.refusal(&field, b, &self.bridges, BRIDGES_VAR, "bridges"));
                }
            }
        }
        Ok(())
    }

    fn refusal(&self, field: &str, value: &str, allow: &Allow, var: &str, what: &str) -> String {
        format!(
            "microvm_template.{field} {value:?} is outside this deployment's spec policy (allowed {what}: {}); \
             use an allowed value, or have the operator widen {var}",
            allow.describe()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(env: &[(&str, &str)]) -> Result<SpecPolicy, ConfigError> {
        SpecPolicy::from_lookup(&|k| env.iter().find(|(key, _)| *key == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn paths_compare_by_component() {
        assert!(path_within("/srv/a", "/srv/a"));
        assert!(path_within("/srv/a/b", "/srv/a"));
        assert!(!path_within("/srv/ab", "/srv/a"));
        assert!(!path_within("/srv", "/srv/a"));
        assert!(path_within("/anything", "/"));
        for bad in ["srv", "/srv/", "/srv//a", "/srv/./a", "/srv/a/..", ""] {
            assert!(plain_absolute(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn settings_parse_with_defaults_and_refuse_nonsense() {
        assert_eq!(policy(&[]).unwrap(), SpecPolicy::default());
        let p = policy(&[(VIRTIOFS_VAR, "/srv/a, /data"), (BRIDGES_VAR, "*"), (IMAGES_VAR, "")]).unwrap();
        assert_eq!(p.virtiofs_paths, Allow::Only(vec!["/srv/a".into(), "/data".into()]));
        assert_eq!(p.bridges, Allow::Any);
        // Blank is unset: the default.
        assert_eq!(p.image_prefixes, Allow::Any);
        assert_eq!(
            policy(&[(IMAGES_VAR, "ghcr.io/acme/")]).unwrap().image_prefixes,
            Allow::Only(vec!["ghcr.io/acme/".into()])
        );
        assert!(policy(&[(VIRTIOFS_VAR, "srv")]).unwrap_err().0.contains("absolute"));
        assert!(policy(&[(VIRTIOFS_VAR, "/srv/../etc")]).unwrap_err().0.contains("plain absolute"));
        assert!(policy(&[(BRIDGES_VAR, "*,br0")]).unwrap_err().0.contains("only entry"));
        assert!(policy(&[(BRIDGES_VAR, "a-very-long-bridge-name")]).unwrap_err().0.contains("interface name"));
    }
}
