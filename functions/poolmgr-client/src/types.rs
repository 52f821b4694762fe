//! The JSON objects of the HTTP contract (`shared/http-api.md`, "Objects"), as this client
//! reads and writes them.
//!
//! Defined here rather than shared with the server (`docs/design-notes.md`): the server
//! parses strictly (an unknown field is an error), a client must not — an object from a
//! newer server with a field this client does not know still reads, the field is ignored.
//! The integration tests check that every object read from a real server serializes back to
//! exactly the body the server sent, so a field missing here fails a test.
//!
//! `microvm_template` stays JSON (`serde_json::Value`): the contract defines it as flintlock's
//! MicroVMSpec with proto field names, validated by the server against flintlock's rules.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize, Serializer};

use crate::error::ValidationError;

/// Longest accepted `request_id`, in bytes (not characters).
pub const MAX_REQUEST_ID_BYTES: usize = 255;
/// Largest pool `size`.
pub const MAX_POOL_SIZE: i32 = 10_000;

/// A [`ValidationError`] from a format string.
macro_rules! verr {
    ($($t:tt)*) => { ValidationError::new(format!($($t)*)) };
}

/// RFC 3339 UTC with a `Z` and microseconds: the form the server writes.
fn ts<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Micros, true))
}

fn ts_opt<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => ts(t, s),
        None => s.serialize_none(),
    }
}

/// Checks a pool, namespace or host name against the contract's pattern
/// `[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?`; the error names `field`.
pub fn validate_name(field: &str, value: &str) -> Result<(), ValidationError> {
    let b = value.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let ok = (1..=63).contains(&b.len())
        && inner(&b[0])
        && inner(&b[b.len() - 1])
        && b.iter().all(|c| inner(c) || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(ValidationError::new(format!(
            "{field} {value:?} is invalid: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        )))
    }
}

/// A pool: namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PoolRef {
    /// The namespace (`default` unless chosen).
    pub namespace: String,
    /// The pool's name within its namespace.
    pub name: String,
}

impl PoolRef {
    /// Both parts checked against the name pattern.
    pub fn new(namespace: &str, name: &str) -> Result<PoolRef, ValidationError> {
        validate_name("namespace", namespace)?;
        validate_name("name", name)?;
        Ok(PoolRef { namespace: namespace.to_owned(), name: name.to_owned() })
    }

    /// `NAMESPACE/NAME`, or `NAME` in namespace `default`.
    pub fn parse(s: &str) -> Result<PoolRef, ValidationError> {
        let (ns, name) = s.split_once('/').unwrap_or(("default", s));
        PoolRef::new(ns, name).map_err(|e| ValidationError::new(format!("pool {s:?}: {e}")))
    }
}

impl fmt::Display for PoolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl std::str::FromStr for PoolRef {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<PoolRef, ValidationError> {
        PoolRef::parse(s)
    }
}

macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[non_exhaustive]
        pub enum $name { $(#[doc = concat!("`", $text, "`")] #[serde(rename = $text)] $variant),+ }

        impl $name {
            /// Every value this client knows, in the contract's order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            /// From the wire name (exact case).
            pub fn parse(s: &str) -> Option<$name> {
                match s { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

wire_enum!(
    /// A VM's phase.
    Phase {
        Provisioning => "PROVISIONING",
        CreateHookRunning => "CREATE_HOOK_RUNNING",
        Available => "AVAILABLE",
        PreLeaseHookRunning => "PRE_LEASE_HOOK_RUNNING",
        Leased => "LEASED",
        Deleting => "DELETING",
        Quarantined => "QUARANTINED",
        Failed => "FAILED",
    }
);

wire_enum!(
    /// How a pool is refilled.
    Strategy {
        ImmediateOnLease => "IMMEDIATE_ON_LEASE",
        MinSizeThreshold => "MIN_SIZE_THRESHOLD",
        ReplaceOnDelete => "REPLACE_ON_DELETE",
    }
);

wire_enum!(
    /// What happens to a VM whose hook failed.
    HookFailurePolicy {
        DeleteAndReplace => "DELETE_AND_REPLACE",
        Quarantine => "QUARANTINE",
    }
);

wire_enum!(
    /// Whether a host can run hooks: `auto` asks its ServerInfo, the others declare it.
    HostExec {
        Auto => "auto",
        Enabled => "enabled",
        Disabled => "disabled",
    }
);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
/// How a pool is refilled: the strategy and its threshold.
pub struct Replenishment {
    /// The strategy.
    pub strategy: Strategy,
    /// MIN_SIZE_THRESHOLD only (and required there): 1..=size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_size: Option<i32>,
}

/// A pool's desired state. Fields the contract gives a default may be left `None` (or empty)
/// and are then left to the server; the server always answers with every field set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolSpec {
    /// `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The pool's name within its namespace.
    pub name: String,
    /// How many VMs the pool keeps (the strategy's starting point under autoscaling); 0..=10000.
    pub size: i32,
    #[serde(default)]
    /// The flintlock hosts the pool's VMs are placed on.
    pub flintlock_hosts: Vec<String>,
    /// How the pool is refilled.
    pub replenishment: Replenishment,
    /// flintlock's MicroVMSpec as JSON (proto field names); validated by the server.
    pub microvm_template: serde_json::Value,
    #[serde(default)]
    /// Commands run in a new VM before it becomes AVAILABLE.
    pub create_commands: Vec<String>,
    #[serde(default)]
    /// Commands run in a VM at each claim, before the lease is written.
    pub pre_lease_commands: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// What happens to a VM whose hook failed; `DELETE_AND_REPLACE` when absent.
    pub hook_failure_policy: Option<HookFailurePolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How often a lease holder is expected to heartbeat; 30 when absent.
    pub heartbeat_interval_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How long a heartbeat keeps a lease; 120 when absent (at least the interval).
    pub heartbeat_expiry_seconds: Option<i32>,
    /// A lease is never extended past `claimed_at` + this; `None`: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lease_seconds: Option<i32>,
    /// Demand-based sizing; `None`: `size` is the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// How a template change reaches the warm VMs; `None`: it applies to new VMs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutPolicy>,
}

/// A pool's rollout policy (the contract's `rollout` block). A field left `None` gets the
/// server's default; the server answers with every field set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RolloutPolicy {
    /// A count (`2`) or a percentage of the target (`"25%"`); default `"25%"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<serde_json::Value>,
    /// A count or a percentage; default `0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<serde_json::Value>,
    /// `CURRENT` (default) or `ANY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_preference: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Stale VMs that claims will not consume within this many seconds are replaced actively.
    pub window_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Seconds a rollout may go without progress before it halts.
    pub progress_deadline_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Failed boots of the new revision before the rollout halts.
    pub failure_threshold: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Whether a halted rollout goes back to the previous revision by itself.
    pub auto_rollback: Option<bool>,
}

/// Where a pool's last rollout stands (`status.rollout`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RolloutStatus {
    /// `PROGRESSING`, `PAUSED`, `HALTED`, `ROLLED_BACK` or `COMPLETE`.
    pub state: String,
    /// The revision most warm VMs come from.
    pub current_revision: i32,
    /// The revision the rollout moves to.
    pub target_revision: i32,
    /// VMs per revision and status (`available`, `leased`, `provisioning`, …).
    pub by_revision: BTreeMap<String, BTreeMap<String, i64>>,
    /// LEASED VMs of an older revision (replaced once released).
    pub stale_leased: i64,
    /// VMs booted above the target to make room.
    pub extra_boots: i32,
    /// Why the rollout halted, when it did.
    pub halted_reason: Option<String>,
}

/// One kept revision of a pool (`GET …/revisions`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Revision {
    /// The revision's number.
    pub revision: i32,
    /// The pool's spec at that revision.
    pub spec: PoolSpec,
    #[serde(serialize_with = "ts")]
    /// When the revision was made.
    pub created_at: DateTime<Utc>,
    /// Whether a rollout to it completed.
    pub rolled_out: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
/// The kept revisions of a pool (`GET …/revisions`), newest first.
pub struct RevisionList {
    /// The revisions, newest first.
    pub revisions: Vec<Revision>,
}

/// A pool's demand-based sizing (the contract's `autoscaling` block): exactly one of
/// `target_warm_ratio` and `buffer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Autoscaling {
    /// The fewest VMs the pool shrinks to.
    pub min: i32,
    /// Counts every VM of the pool: leased, provisioning and available.
    pub max: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// The share of the pool kept idle (0 < r < 1).
    pub target_warm_ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Idle VMs kept on top of the demand.
    pub buffer: Option<i32>,
    /// 300 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_stabilization_seconds: Option<i32>,
}

impl Autoscaling {
    /// The contract's rules on the block, checked before anything is sent.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if !(0..=MAX_POOL_SIZE).contains(&self.min) {
            return Err(verr!("autoscaling.min must be between 0 and {MAX_POOL_SIZE}, got {}", self.min));
        }
        if !(1..=MAX_POOL_SIZE).contains(&self.max) || self.min > self.max {
            return Err(verr!(
                "autoscaling.max must be between 1 and {MAX_POOL_SIZE} and at least autoscaling.min ({}), got {}",
                self.min,
                self.max
            ));
        }
        match (self.target_warm_ratio, self.buffer) {
            (Some(r), None) if r > 0.0 && r < 1.0 => Ok(()),
            (Some(r), None) => Err(verr!("autoscaling.target_warm_ratio must be above 0 and below 1, got {r}")),
            (None, Some(b)) if (0..=self.max).contains(&b) => Ok(()),
            (None, Some(b)) => Err(verr!("autoscaling.buffer must be between 0 and autoscaling.max, got {b}")),
            _ => Err("autoscaling needs exactly one of target_warm_ratio and buffer".into()),
        }
    }
}

impl PoolSpec {
    /// The pool this spec names (namespace `default` when absent).
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.namespace.clone().unwrap_or_else(|| "default".into()), name: self.name.clone() }
    }

    /// The contract's rules on a PoolSpec's own fields (`shared/http-api.md`, "PoolSpec"),
    /// checked before anything is sent; the error names the field. The server checks these
    /// again, and also the template and that the hosts are registered.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if let Some(ns) = &self.namespace {
            validate_name("namespace", ns)?;
        }
        validate_name("name", &self.name)?;
        if !(0..=MAX_POOL_SIZE).contains(&self.size) {
            return Err(verr!("size must be between 0 and {MAX_POOL_SIZE}, got {}", self.size));
        }
        for h in &self.flintlock_hosts {
            validate_name("flintlock_hosts entry", h)?;
        }
        match (self.replenishment.strategy, self.replenishment.min_size) {
            (Strategy::MinSizeThreshold, None) => {
                return Err("replenishment.min_size is required for MIN_SIZE_THRESHOLD".into());
            }
            (Strategy::MinSizeThreshold, Some(m)) if m < 1 || m > self.size => {
                return Err(verr!("replenishment.min_size must be between 1 and size ({}), got {m}", self.size));
            }
            _ => {}
        }
        let interval = self.heartbeat_interval_seconds.unwrap_or(30);
        if interval < 1 {
            return Err("heartbeat_interval_seconds must be at least 1".into());
        }
        if let Some(e) = self.heartbeat_expiry_seconds
            && (e < 1 || e < interval)
        {
            return Err(verr!(
                "heartbeat_expiry_seconds must be at least 1 and at least heartbeat_interval_seconds ({interval})"
            ));
        }
        if !self.microvm_template.is_object() {
            return Err("microvm_template must be an object (flintlock's MicroVMSpec as JSON)".into());
        }
        if let Some(a) = &self.autoscaling {
            a.validate()?;
        }
        Ok(())
    }
}

/// A pool's live VM counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolStatus {
    /// VMs ready to be claimed.
    pub available: i64,
    /// PRE_LEASE_HOOK_RUNNING, or LEASED without a committed lease.
    pub claiming: i64,
    /// VMs under a lease.
    pub leased: i64,
    /// VMs being created or running their create hook.
    pub provisioning: i64,
    /// VMs set aside after a failed hook.
    pub quarantined: i64,
    /// VMs being deleted.
    pub deleting: i64,
}

/// An autoscaled pool's last sizing decision and what it was made from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AutoscalingStatus {
    /// `FLOOR`, `CEILING`, `DEMAND`, `HINT` or `STATIC`.
    pub reason: String,
    /// Claims per second, measured.
    pub claims_per_second: f64,
    /// Claims refused (no VM) per second, measured.
    pub refused_per_second: f64,
    /// How long a VM takes to become AVAILABLE, measured.
    pub provisioning_seconds: f64,
    /// Claims announced by demand hints and not yet seen.
    pub expected_claims: i64,
    /// Idle VMs kept for batches of claims at once while they keep coming (0 from servers
    /// that do not send it).
    #[serde(default)]
    pub batch_buffer: i64,
}

/// A pool's status: its live VM counts, what it works towards and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolStatusFull {
    #[serde(flatten)]
    /// The live VM counts (also reachable through `Deref`).
    pub counts: PoolStatus,
    /// The autoscaler's size, else the spec's `size` (absent from older servers: 0).
    #[serde(default)]
    pub desired_size: i32,
    #[serde(default)]
    /// The autoscaler's last decision; `None` without an autoscaling block.
    pub autoscaling: Option<AutoscalingStatus>,
    /// `None` when no rollout ever ran (and from older servers).
    #[serde(default)]
    pub rollout: Option<RolloutStatus>,
}

impl std::ops::Deref for PoolStatusFull {
    type Target = PoolStatus;
    fn deref(&self) -> &PoolStatus {
        &self.counts
    }
}

/// `POST …/expect`'s request: `claims` claims expected within `within_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ExpectRequest {
    /// How many claims are coming (1..=10000).
    pub claims: i32,
    /// Within how many seconds from now (1..=3600).
    pub within_seconds: i32,
}

impl ExpectRequest {
    /// The contract's bounds: `claims` 1..=10000, `within_seconds` 1..=3600.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if !(1..=MAX_POOL_SIZE).contains(&self.claims) {
            return Err(verr!("claims must be between 1 and {MAX_POOL_SIZE}, got {}", self.claims));
        }
        if !(1..=3600).contains(&self.within_seconds) {
            return Err(verr!("within_seconds must be between 1 and 3600, got {}", self.within_seconds));
        }
        Ok(())
    }
}

/// `POST …/expect`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Expected {
    /// Until when the hint counts.
    pub expected_until: DateTime<Utc>,
    /// The pool's desired size with the hint.
    pub desired_size: i32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
/// A pool: its spec, revision and live status.
pub struct Pool {
    /// The pool's desired state, every field set.
    pub spec: PoolSpec,
    /// Bumped by each change of `microvm_template` or `create_commands` (1 from older servers).
    #[serde(default = "first_revision")]
    pub revision: i32,
    /// Live counts, desired size and why.
    pub status: PoolStatusFull,
    #[serde(serialize_with = "ts")]
    /// When the pool was created.
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    /// When its spec last changed.
    pub updated_at: DateTime<Utc>,
}

/// A lease (the contract's LeaseRecord).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Lease {
    /// The lease's id.
    pub lease_id: String,
    /// The uid of the leased VM.
    pub vm_uid: String,
    /// The pool the VM came from.
    pub pool: PoolRef,
    #[serde(serialize_with = "ts")]
    /// When the lease was claimed.
    pub claimed_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    /// The last heartbeat (the claim's time before any).
    pub last_heartbeat_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    /// When the lease expires without another heartbeat.
    pub expires_at: DateTime<Utc>,
    /// `None` when the claim had none.
    pub request_id: Option<String>,
}

impl Lease {
    /// How long one heartbeat keeps the lease: the pool's `heartbeat_expiry_seconds`, as this
    /// lease's last heartbeat (or claim) set it.
    pub fn expiry_window(&self) -> std::time::Duration {
        (self.expires_at - self.last_heartbeat_at).to_std().unwrap_or_default()
    }
}

/// `POST /v1/claims` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The pool to claim from.
    pub pool: PoolRef,
    /// The idempotency key: a claim with the id of a live lease returns that lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
/// A flintlock host's name and gRPC address, as a claim returns it.
pub struct HostAddress {
    /// The host's name.
    pub name: String,
    /// flintlockd's address, `host:port`.
    pub address: String,
}

/// One of a claimed VM's interfaces, keyed by the template's `device_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NetworkInterfaceStatus {
    /// The TAP device on the host.
    pub host_device_name: String,
    /// The interface's index.
    pub index: i64,
    /// The guest interface's MAC address.
    pub mac_address: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
/// The VM a claim leased.
pub struct ClaimedVm {
    /// poolmgr's id of the VM.
    pub id: String,
    /// flintlock's uid of the VM.
    pub uid: String,
    /// The host it runs on.
    pub flintlock_host: HostAddress,
    /// Its network interfaces, by the template's `device_id`.
    pub network_interfaces: BTreeMap<String, NetworkInterfaceStatus>,
}

/// The answer of `POST /v1/claims`, for a fresh claim and a replay alike.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ClaimResponse {
    /// The lease.
    pub lease: Lease,
    /// The leased VM.
    pub vm: ClaimedVm,
    /// `true` when an earlier claim with the same `request_id` created this lease.
    pub replayed: bool,
}

/// The answer of `POST /v1/leases/{lease_id}/heartbeat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HeartbeatResponse {
    /// The lease, with its new `expires_at`.
    pub lease: Lease,
}

/// One page of `GET /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LeaseList {
    /// The leases of this page.
    pub leases: Vec<Lease>,
    /// Pass back as `page_token`; empty on the last page.
    pub next_page_token: String,
}

/// Filters and paging of `GET /v1/leases`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseQuery {
    /// Only leases of this pool.
    pub pool: Option<PoolRef>,
    /// Leases per page (the server's default when absent).
    pub page_size: Option<i64>,
    /// The page to read (a previous page's `next_page_token`).
    pub page_token: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
/// One page of `GET /v1/pools`.
pub struct PoolList {
    /// The pools of this page.
    pub pools: Vec<Pool>,
    /// Empty on the last page (and from a server that does not paginate).
    #[serde(default)]
    pub next_page_token: String,
}

/// A VM poolmgr manages (the contract's VMRecord).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Vm {
    /// poolmgr's id of the VM.
    pub id: String,
    /// flintlock's uid; `None` until its create call returned.
    pub uid: Option<String>,
    /// The VM's pool.
    pub pool: PoolRef,
    /// The host it is placed on.
    pub flintlock_host: String,
    /// Where it is in its life.
    pub phase: Phase,
    /// Its lease, when LEASED.
    pub lease_id: Option<String>,
    /// The pool's revision the VM was created from (1 from older servers).
    #[serde(default = "first_revision")]
    pub revision: i32,
    /// Its network interfaces, by the template's `device_id`.
    pub network_interfaces: BTreeMap<String, NetworkInterfaceStatus>,
    #[serde(serialize_with = "ts")]
    /// When the VM row was created.
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

fn first_revision() -> i32 {
    1
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
/// One page of `GET /v1/vms`.
pub struct VmList {
    /// The VMs of this page.
    pub vms: Vec<Vm>,
    /// Empty on the last page (and from a server that does not paginate).
    #[serde(default)]
    pub next_page_token: String,
}

/// Filters of `GET /v1/vms`: a pool, or a namespace; a phase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VmQuery {
    /// Only VMs of pools in this namespace.
    pub namespace: Option<String>,
    /// With `namespace` (the pool's own namespace when built by [`VmQuery::pool`]).
    pub pool: Option<String>,
    /// Only VMs in this phase.
    pub phase: Option<Phase>,
}

impl VmQuery {
    /// The VMs of one pool.
    pub fn pool(p: &PoolRef) -> VmQuery {
        VmQuery { namespace: Some(p.namespace.clone()), pool: Some(p.name.clone()), phase: None }
    }
}

/// A host's TLS settings; `key_pem` is write-only (always `None` in answers).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HostTls {
    /// Plaintext gRPC (no TLS).
    pub insecure: bool,
    /// The CA that signed flintlockd's certificate (PEM).
    pub ca_pem: Option<String>,
    /// The client certificate for mutual TLS (PEM).
    pub cert_pem: Option<String>,
    /// The client key for mutual TLS (PEM); write-only.
    pub key_pem: Option<String>,
}

/// The body of `POST /v1/hosts` and `PUT /v1/hosts/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HostSpec {
    /// The host's name (a DNS label).
    pub name: String,
    /// flintlockd's gRPC address, `host:port`.
    pub address: String,
    /// How to reach it: TLS or plaintext.
    pub tls: HostTls,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// flintlockd's basic-auth token; write-only.
    pub basic_auth_token: Option<String>,
    /// `auto` (the server's default) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<HostExec>,
}

/// A flintlock host. Secrets are never returned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Host {
    /// The host's name.
    pub name: String,
    /// flintlockd's gRPC address, `host:port`.
    pub address: String,
    /// Its TLS settings (`key_pem` never returned).
    pub tls: HostTls,
    /// Always `None`: the token is write-only.
    pub basic_auth_token: Option<String>,
    /// Whether new placements are stopped.
    pub cordoned: bool,
    /// Why it was cordoned.
    pub cordoned_reason: Option<String>,
    #[serde(serialize_with = "ts_opt")]
    /// When it was cordoned.
    pub cordoned_at: Option<DateTime<Utc>>,
    /// VMs on the host.
    pub vm_count: i64,
    /// Whether hooks may run there: `auto` asks the host's ServerInfo.
    pub exec: HostExec,
    /// flintlockd's version, from its ServerInfo.
    pub flintlock_version: Option<String>,
    /// Why hooks cannot run there, when they cannot.
    pub exec_unavailable_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
/// One page of `GET /v1/hosts`.
pub struct HostList {
    /// The hosts of this page.
    pub hosts: Vec<Host>,
    /// Empty on the last page (and from a server that does not paginate).
    #[serde(default)]
    pub next_page_token: String,
}

/// One event of the feed. `kind` is the contract's `type` (`VM_CLAIMED`, …), kept as text
/// so types added by a newer server still read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Event {
    /// The event's id: the feed's cursor.
    pub id: i64,
    #[serde(rename = "type")]
    /// The contract's `type` (`VM_CLAIMED`, …).
    pub kind: String,
    /// The pool it concerns.
    pub pool: PoolRef,
    /// The VM it concerns, if any.
    pub vm_id: Option<String>,
    /// The lease it concerns, if any.
    pub lease_id: Option<String>,
    #[serde(serialize_with = "ts")]
    /// When it happened.
    pub created_at: DateTime<Utc>,
    /// Type-specific details (`{}` for most; `by` for an admin's change).
    pub payload: serde_json::Value,
}

/// One answer of `GET /v1/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct EventList {
    /// The events, in id order.
    pub events: Vec<Event>,
    /// The cursor to pass as `after` next time.
    pub next_after: i64,
}

/// `GET /v1/events` parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventQuery {
    /// Events after this id (0: from the beginning).
    pub after: i64,
    /// Only events of this pool.
    pub pool: Option<PoolRef>,
    /// 1-1000; the server's default when absent.
    pub limit: Option<i64>,
    /// Long-poll up to this many seconds (≤ 20) when there is nothing new.
    pub wait_seconds: Option<u64>,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Health {
    /// `ok` when the server and its database answer.
    pub status: String,
}

// ---------------------------------------------------------------------------------------
// Constructors of the bodies and queries a caller writes (they are `#[non_exhaustive]`: a
// field the contract adds later is not a breaking change of this crate).
// ---------------------------------------------------------------------------------------

impl Replenishment {
    /// A strategy without `min_size` (set it for MIN_SIZE_THRESHOLD).
    pub fn new(strategy: Strategy) -> Replenishment {
        Replenishment { strategy, min_size: None }
    }

    /// MIN_SIZE_THRESHOLD with its `min_size`.
    pub fn min_size_threshold(min_size: i32) -> Replenishment {
        Replenishment { strategy: Strategy::MinSizeThreshold, min_size: Some(min_size) }
    }
}

impl PoolSpec {
    /// A spec with the required fields; every optional one is left to the server (set the
    /// public fields to change them).
    pub fn new(
        namespace: &str,
        name: &str,
        size: i32,
        replenishment: Replenishment,
        microvm_template: serde_json::Value,
    ) -> PoolSpec {
        PoolSpec {
            namespace: Some(namespace.to_owned()),
            name: name.to_owned(),
            size,
            flintlock_hosts: Vec::new(),
            replenishment,
            microvm_template,
            create_commands: Vec::new(),
            pre_lease_commands: Vec::new(),
            hook_failure_policy: None,
            heartbeat_interval_seconds: None,
            heartbeat_expiry_seconds: None,
            max_lease_seconds: None,
            autoscaling: None,
            rollout: None,
        }
    }
}

impl Autoscaling {
    /// Sizing that keeps `target_warm_ratio` of the pool idle, between `min` and `max`.
    pub fn with_ratio(min: i32, max: i32, target_warm_ratio: f64) -> Autoscaling {
        Autoscaling {
            min,
            max,
            target_warm_ratio: Some(target_warm_ratio),
            buffer: None,
            scale_down_stabilization_seconds: None,
        }
    }

    /// Sizing that keeps `buffer` idle VMs on top of the demand, between `min` and `max`.
    pub fn with_buffer(min: i32, max: i32, buffer: i32) -> Autoscaling {
        Autoscaling { min, max, target_warm_ratio: None, buffer: Some(buffer), scale_down_stabilization_seconds: None }
    }
}

impl HostTls {
    /// Plaintext gRPC (`{"insecure": true}`).
    pub fn insecure() -> HostTls {
        HostTls { insecure: true, ..HostTls::default() }
    }

    /// TLS verified against `ca_pem` (add `cert_pem` and `key_pem` for mutual TLS).
    pub fn with_ca(ca_pem: impl Into<String>) -> HostTls {
        HostTls { insecure: false, ca_pem: Some(ca_pem.into()), ..HostTls::default() }
    }
}

impl HostSpec {
    /// A host at `address` (`host:port`) with these TLS settings, no basic-auth token and
    /// the server's `exec` default.
    pub fn new(name: &str, address: &str, tls: HostTls) -> HostSpec {
        HostSpec { name: name.to_owned(), address: address.to_owned(), tls, basic_auth_token: None, exec: None }
    }
}

impl ExpectRequest {
    /// `claims` claims expected within `within_seconds`.
    pub fn new(claims: i32, within_seconds: i32) -> ExpectRequest {
        ExpectRequest { claims, within_seconds }
    }
}

impl ClaimRequest {
    /// A claim from `pool` with `request_id` (`None`: not retriable, every call claims anew).
    pub fn new(pool: PoolRef, request_id: Option<String>) -> ClaimRequest {
        ClaimRequest { pool, request_id }
    }
}

impl LeaseQuery {
    /// Leases of `pool` (`None`: every pool the token sees).
    pub fn pool(pool: Option<PoolRef>) -> LeaseQuery {
        LeaseQuery { pool, ..LeaseQuery::default() }
    }

    /// With this many leases per page.
    pub fn with_page_size(mut self, n: i64) -> LeaseQuery {
        self.page_size = Some(n);
        self
    }

    /// From the page this token names.
    pub fn with_page_token(mut self, token: impl Into<String>) -> LeaseQuery {
        self.page_token = Some(token.into());
        self
    }
}

impl VmQuery {
    /// Only VMs of pools in `namespace`.
    pub fn namespace(namespace: &str) -> VmQuery {
        VmQuery { namespace: Some(namespace.to_owned()), ..VmQuery::default() }
    }

    /// Only VMs in `phase`.
    pub fn with_phase(mut self, phase: Phase) -> VmQuery {
        self.phase = Some(phase);
        self
    }
}

impl EventQuery {
    /// Events after the cursor `after` (0: from the oldest kept).
    pub fn after(after: i64) -> EventQuery {
        EventQuery { after, ..EventQuery::default() }
    }

    /// Only events of `pool`.
    pub fn with_pool(mut self, pool: Option<PoolRef>) -> EventQuery {
        self.pool = pool;
        self
    }

    /// At most `n` events per answer (1-1000).
    pub fn with_limit(mut self, n: i64) -> EventQuery {
        self.limit = Some(n);
        self
    }

    /// Long-poll up to `seconds` (≤ 20) when nothing is new.
    pub fn with_wait_seconds(mut self, seconds: Option<u64>) -> EventQuery {
        self.wait_seconds = seconds;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_follow_the_contract_pattern() {
        for ok in ["ci", "a", "a-b", "0", &"a".repeat(63)] {
            assert!(validate_name("n", ok).is_ok(), "{ok:?} refused");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a/b", "é", &"a".repeat(64)] {
            assert!(validate_name("n", bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn pool_refs_parse_with_a_default_namespace() {
        assert_eq!(PoolRef::parse("ci").unwrap().to_string(), "default/ci");
        assert_eq!(PoolRef::parse("team-a/ci").unwrap().to_string(), "team-a/ci");
        for bad in ["", "a/", "/b", "A/b", "a/b/c", "a_b"] {
            assert!(PoolRef::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn unknown_fields_from_a_newer_server_are_ignored() {
        let v = json!({"status": "ok", "build": "x"});
        let h: Health = serde_json::from_value(v).unwrap();
        assert_eq!(h.status, "ok");
    }

    #[test]
    fn a_spec_leaves_absent_defaults_to_the_server() {
        let spec: PoolSpec = serde_json::from_value(json!({
            "name": "ci", "size": 1, "replenishment": {"strategy": "REPLACE_ON_DELETE"},
            "microvm_template": {"interfaces": [{"device_id": "eth1"}]}
        }))
        .unwrap();
        let back = serde_json::to_value(&spec).unwrap();
        for absent in ["namespace", "hook_failure_policy", "heartbeat_interval_seconds", "heartbeat_expiry_seconds"] {
            assert!(back.get(absent).is_none(), "{absent} sent: {back}");
        }
        assert_eq!(spec.pool_ref().to_string(), "default/ci");
        spec.validate().unwrap();
    }

    #[test]
    fn spec_rules_name_the_field() {
        let base = json!({
            "name": "ci", "size": 2, "replenishment": {"strategy": "MIN_SIZE_THRESHOLD", "min_size": 1},
            "microvm_template": {}
        });
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = base.clone();
            f(&mut v);
            serde_json::from_value::<PoolSpec>(v).unwrap().validate()
        };
        with(&|_| {}).unwrap();
        assert!(
            with(&|v| v["replenishment"]["min_size"] = json!(3))
                .unwrap_err()
                .message()
                .contains("replenishment.min_size")
        );
        assert!(
            with(&|v| v["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD"}))
                .unwrap_err()
                .message()
                .contains("min_size")
        );
        assert!(with(&|v| v["size"] = json!(10_001)).unwrap_err().message().contains("size"));
        assert!(with(&|v| v["name"] = json!("CI")).unwrap_err().message().contains("name"));
        assert!(with(&|v| v["flintlock_hosts"] = json!(["a_b"])).unwrap_err().message().contains("flintlock_hosts"));
        let e = with(&|v| {
            v["heartbeat_interval_seconds"] = json!(60);
            v["heartbeat_expiry_seconds"] = json!(30);
        })
        .unwrap_err();
        assert!(e.message().contains("heartbeat_expiry_seconds"), "{e}");
        assert!(with(&|v| v["microvm_template"] = json!([])).unwrap_err().message().contains("microvm_template"));
    }

    #[test]
    fn timestamps_are_written_as_the_server_writes_them() {
        let lease: Lease = serde_json::from_value(json!({
            "lease_id": "l", "vm_uid": "u", "pool": {"namespace": "default", "name": "ci"},
            "claimed_at": "2026-01-02T03:04:05Z", "last_heartbeat_at": "2026-01-02T03:04:05.5Z",
            "expires_at": "2026-01-02T03:06:05.500000Z", "request_id": null
        }))
        .unwrap();
        let v = serde_json::to_value(&lease).unwrap();
        assert_eq!(v["claimed_at"], json!("2026-01-02T03:04:05.000000Z"));
        assert_eq!(v["request_id"], serde_json::Value::Null);
        assert_eq!(lease.expiry_window(), std::time::Duration::from_secs(120));
    }
}
