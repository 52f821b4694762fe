//! A pool's demand-based sizing (`autoscaling` in a PoolSpec) and the state its decisions
//! keep (`reconcile::sizing` decides, `reconcile::scale` reads and writes). Part of
//! [`crate::domain`]: parsed at the edge, pure.

use std::fmt;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::MAX_POOL_SIZE;

string_enum!(
    /// Why a pool has its desired size (`status.autoscaling.reason`, POOL_SCALED's `reason`).
    ScaleReason {
        Floor => "FLOOR",
        Ceiling => "CEILING",
        Demand => "DEMAND",
        Hint => "HINT",
        Static => "STATIC",
    }
);

/// A batch of claims seen at once (`reconcile::batches`): when it came (its median arrival,
/// seconds on the database's clock), its size, how many of its claims the idle buffer served,
/// that buffer, and whether it is confirmed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    #[serde(rename = "t")]
    pub at: f64,
    pub n: i32,
    #[serde(rename = "c")]
    pub covered: i32,
    #[serde(rename = "b")]
    pub buffer: i32,
    /// The slices after it held fewer arrivals: a batch, not a step's first seconds.
    #[serde(rename = "k", default)]
    pub confirmed: bool,
    /// It came while a hint was live: announced, so the hint's, not a surprise the idle
    /// buffer must be kept for.
    #[serde(rename = "h", default, skip_serializing_if = "std::ops::Not::not")]
    pub announced: bool,
}

/// What a pool's sizing keeps between decisions (the `pools.scaling` column; `reconcile::sizing`
/// decides from it and returns the next one). Pure data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ScalingState {
    /// The highest recommendation per bucket of the stabilization window: (bucket start, s).
    #[serde(default)]
    pub recs: Vec<(f64, i32)>,
    /// Moving average of the busy VMs (time constant: the demand window).
    #[serde(default)]
    pub busy_avg: f64,
    /// When the state was last updated (seconds on the database's clock).
    #[serde(default)]
    pub at: f64,
    /// Why the pool has its current desired size.
    #[serde(default)]
    pub reason: Option<ScaleReason>,
    /// The arrival rate the size was computed for (`reconcile::sizing::arrival_rate`).
    #[serde(default)]
    pub demand_per_second: f64,
    /// When the estimate last saw the demand change (seconds on the database's clock): its
    /// windows start no earlier.
    #[serde(default)]
    pub since: f64,
    /// Whether that change went up.
    #[serde(default)]
    pub rising: bool,
    #[serde(default)]
    pub claims_per_second: f64,
    #[serde(default)]
    pub refused_per_second: f64,
    #[serde(default)]
    pub provisioning_seconds: f64,
    #[serde(default)]
    pub expected_claims: i64,
    /// While a hint lasts: the demand part of the size when it was first seen, which the
    /// hint's claims not arrived yet add to (`reconcile::sizing::decide`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint_base: Option<i64>,
    /// While a hint lasts: the arrival rate when it was first seen. The pool's usual claims
    /// keep coming meanwhile; only the arrivals beyond that rate are the announced ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint_rate: Option<f64>,
    /// While a hint lasts: the claims it announced when last seen (a hint posted on a live one
    /// adds to them), so its claims not arrived yet only go down between posts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint_announced: Option<i64>,
    /// The batches (claims at once) seen over the batch memory (`reconcile::batches`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batches: Vec<Batch>,
    /// The idle buffer the size keeps for them (0: none).
    #[serde(default)]
    pub batch_buffer: i64,
    /// When a decision last saw requests waiting for a VM (seconds on the database's clock;
    /// 0: never): the size does not go down within a provisioning time of it
    /// (`reconcile::sizing::decide`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub waiting_at: f64,
    /// Whether the next passes must look at the pool again (demand measured, a hint, or a
    /// size above the floor); the sizing step skips the others (`pools_scaling_active`).
    #[serde(default)]
    pub active: bool,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn default_stabilization() -> i32 {
    300
}

/// A pool's demand-based sizing (`autoscaling` in a PoolSpec; `reconcile::sizing` decides).
/// Exactly one of `target_warm_ratio` and `buffer` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Autoscaling {
    /// The floor: the pool never works towards fewer VMs.
    #[schema(minimum = 0, maximum = 10000)]
    pub min: i32,
    /// The ceiling, counting every VM of the pool (leased, provisioning and available).
    #[schema(minimum = 1, maximum = 10000)]
    pub max: i32,
    /// The share of claims that should find a warm VM (0 < r < 1): the size is the smallest
    /// whose Erlang-B loss for the measured demand is at most 1 - r.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0001, maximum = 0.9999)]
    pub target_warm_ratio: Option<f64>,
    /// Idle VMs kept on top of the busy ones, instead of a warm ratio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 10000)]
    pub buffer: Option<i32>,
    /// The size goes down only to the highest recommendation of this window (0..=86400).
    #[serde(default = "default_stabilization")]
    #[schema(minimum = 0, maximum = 86400, default = 300)]
    pub scale_down_stabilization_seconds: i32,
}

impl Autoscaling {
    /// The size a pool starts from when autoscaling is switched on: its `size`, within the
    /// floor and the ceiling.
    pub fn initial_size(&self, size: i32) -> i32 {
        size.clamp(self.min, self.max.max(self.min))
    }

    /// Every rule of the block; `size` is the pool's (the starting point, any value).
    pub fn validate(&self) -> Result<(), String> {
        if !(0..=MAX_POOL_SIZE).contains(&self.min) {
            return Err(format!("autoscaling.min must be between 0 and {MAX_POOL_SIZE}, got {}", self.min));
        }
        if !(1..=MAX_POOL_SIZE).contains(&self.max) {
            return Err(format!("autoscaling.max must be between 1 and {MAX_POOL_SIZE}, got {}", self.max));
        }
        if self.min > self.max {
            return Err(format!("autoscaling.min ({}) must not exceed autoscaling.max ({})", self.min, self.max));
        }
        match (self.target_warm_ratio, self.buffer) {
            (Some(_), Some(_)) | (None, None) => {
                return Err("autoscaling needs exactly one of target_warm_ratio and buffer".into());
            }
            (Some(r), None) if !(r > 0.0 && r < 1.0) => {
                return Err(format!("autoscaling.target_warm_ratio must be above 0 and below 1, got {r}"));
            }
            (Some(r), None) if !(0.0001..=0.9999).contains(&r) => {
                return Err(format!("autoscaling.target_warm_ratio must be between 0.0001 and 0.9999, got {r}"));
            }
            (None, Some(b)) if !(0..=self.max).contains(&b) => {
                return Err(format!(
                    "autoscaling.buffer must be between 0 and autoscaling.max ({}), got {b}",
                    self.max
                ));
            }
            _ => {}
        }
        if !(0..=86_400).contains(&self.scale_down_stabilization_seconds) {
            return Err(format!(
                "autoscaling.scale_down_stabilization_seconds must be between 0 and 86400, got {}",
                self.scale_down_stabilization_seconds
            ));
        }
        Ok(())
    }
}
