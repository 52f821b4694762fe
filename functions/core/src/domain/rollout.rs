//! A pool's rollout policy (`rollout` in a PoolSpec) and the states a rollout reports
//! (`reconcile::rollout` acts on them). Part of [`crate::domain`]: parsed at the edge, pure.

use std::fmt;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::MAX_POOL_SIZE;

string_enum!(
    /// Where a pool's rollout stands (`status.rollout.state`).
    RolloutState {
        Progressing => "PROGRESSING",
        Paused => "PAUSED",
        Halted => "HALTED",
        RolledBack => "ROLLED_BACK",
        Complete => "COMPLETE",
    }
);

string_enum!(
    /// Which VMs a claim takes while a rollout runs: the current revision's first (CURRENT),
    /// or any, stale ones used up first so the pool rolls by its claims (ANY).
    ClaimPreference {
        Current => "CURRENT",
        Any => "ANY",
    }
);

/// A count of VMs, or a percentage of the pool's target (`"25%"`), in a rollout policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmQuantity {
    Count(i32),
    Percent(i32),
}

impl VmQuantity {
    /// The count for a pool whose target is `target`: a percentage rounded up (`up`, as
    /// Kubernetes rounds a surge) or down (an unavailability).
    pub fn of(self, target: i32, up: bool) -> i32 {
        match self {
            VmQuantity::Count(n) => n,
            VmQuantity::Percent(p) => {
                let x = i64::from(target) * i64::from(p);
                (if up { (x + 99) / 100 } else { x / 100 }) as i32
            }
        }
    }
}

impl Serialize for VmQuantity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            VmQuantity::Count(n) => s.serialize_i32(*n),
            VmQuantity::Percent(p) => s.serialize_str(&format!("{p}%")),
        }
    }
}

impl<'de> Deserialize<'de> for VmQuantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::Number(n) => n
                .as_i64()
                .filter(|n| (0..=i64::from(MAX_POOL_SIZE)).contains(n))
                .map(|n| VmQuantity::Count(n as i32))
                .ok_or_else(|| {
                    D::Error::custom(format!(
                        "a rollout's max_surge and max_unavailable count must be a whole number from 0 to {MAX_POOL_SIZE}, got {n}"
                    ))
                }),
            serde_json::Value::String(t) => t
                .strip_suffix('%')
                .filter(|p| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()))
                .filter(|p| p.len() == 1 || !p.starts_with('0'))
                .and_then(|p| p.parse::<i32>().ok())
                .filter(|p| (0..=100).contains(p))
                .map(VmQuantity::Percent)
                .ok_or_else(|| {
                    D::Error::custom(format!(
                        "a rollout's max_surge and max_unavailable percentage must look like \"25%\" (0% to 100%), got {t:?}"
                    ))
                }),
            other => Err(D::Error::custom(format!("expected a count or a percentage such as \"25%\", got {other}"))),
        }
    }
}

impl utoipa::PartialSchema for VmQuantity {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::OneOfBuilder::new()
            .item(
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::Type::Integer)
                    .minimum(Some(0))
                    .maximum(Some(MAX_POOL_SIZE)),
            )
            .item(
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::Type::String)
                    .pattern(Some("^(100|[1-9]?[0-9])%$")),
            )
            .into()
    }
}

impl ToSchema for VmQuantity {}

fn default_surge() -> VmQuantity {
    VmQuantity::Percent(25)
}
fn default_unavailable() -> VmQuantity {
    VmQuantity::Count(0)
}
fn default_preference() -> ClaimPreference {
    ClaimPreference::Current
}
fn default_window() -> i32 {
    120
}
fn default_progress_deadline() -> i32 {
    600
}
fn default_failure_threshold() -> i32 {
    3
}
fn default_true() -> bool {
    true
}

/// How a change of a VM-shaping field reaches the warm VMs (`rollout` in a PoolSpec; absent:
/// no rollout, a change applies to new VMs only). The server's defaults never reduce the warm
/// capacity: new VMs first (up to `max_surge` above the target), stale ones retired as the new
/// ones become AVAILABLE.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutPolicy {
    /// New VMs made above the target while stale ones are replaced (a count or a percentage
    /// of the target, rounded up).
    #[serde(default = "default_surge")]
    pub max_surge: VmQuantity,
    /// Stale AVAILABLE VMs retired before their replacements are ready (rounded down).
    #[serde(default = "default_unavailable")]
    pub max_unavailable: VmQuantity,
    #[serde(default = "default_preference")]
    pub claim_preference: ClaimPreference,
    /// Stale VMs that claims will not consume within this many seconds are replaced actively.
    #[serde(default = "default_window")]
    #[schema(minimum = 0, maximum = 86400, default = 120)]
    pub window_seconds: i32,
    /// The rollout halts when no new VM became AVAILABLE for this long.
    #[serde(default = "default_progress_deadline")]
    #[schema(minimum = 1, maximum = 86400, default = 600)]
    pub progress_deadline_seconds: i32,
    /// The rollout halts after this many new VMs failed.
    #[serde(default = "default_failure_threshold")]
    #[schema(minimum = 1, maximum = 200, default = 3)]
    pub failure_threshold: i32,
    /// A halted rollout returns the pool to the last revision that rolled out.
    #[serde(default = "default_true")]
    #[schema(default = true)]
    pub auto_rollback: bool,
}

impl RolloutPolicy {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_surge.of(100, true) == 0 && self.max_unavailable.of(100, false) == 0 {
            return Err("rollout: max_surge and max_unavailable cannot both be 0 (nothing could be replaced)".into());
        }
        if !(0..=86400).contains(&self.window_seconds) {
            return Err(format!("rollout.window_seconds must be between 0 and 86400, got {}", self.window_seconds));
        }
        if !(1..=86400).contains(&self.progress_deadline_seconds) {
            return Err(format!(
                "rollout.progress_deadline_seconds must be between 1 and 86400, got {}",
                self.progress_deadline_seconds
            ));
        }
        if !(1..=200).contains(&self.failure_threshold) {
            return Err(format!("rollout.failure_threshold must be between 1 and 200, got {}", self.failure_threshold));
        }
        Ok(())
    }
}
