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

/// Longest accepted `request_id`, in bytes (not characters).
pub const MAX_REQUEST_ID_BYTES: usize = 255;
/// Largest pool `size`.
pub const MAX_POOL_SIZE: i32 = 10_000;

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
pub fn validate_name(field: &str, value: &str) -> Result<(), String> {
    let b = value.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let ok = (1..=63).contains(&b.len())
        && inner(&b[0])
        && inner(&b[b.len() - 1])
        && b.iter().all(|c| inner(c) || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{field} {value:?} is invalid: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        ))
    }
}

/// A pool: namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PoolRef {
    pub namespace: String,
    pub name: String,
}

impl PoolRef {
    /// Both parts checked against the name pattern.
    pub fn new(namespace: &str, name: &str) -> Result<PoolRef, String> {
        validate_name("namespace", namespace)?;
        validate_name("name", name)?;
        Ok(PoolRef { namespace: namespace.to_owned(), name: name.to_owned() })
    }

    /// `NAMESPACE/NAME`, or `NAME` in namespace `default`.
    pub fn parse(s: &str) -> Result<PoolRef, String> {
        let (ns, name) = s.split_once('/').unwrap_or(("default", s));
        PoolRef::new(ns, name).map_err(|e| format!("pool {s:?}: {e}"))
    }
}

impl fmt::Display for PoolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl std::str::FromStr for PoolRef {
    type Err = String;
    fn from_str(s: &str) -> Result<PoolRef, String> {
        PoolRef::parse(s)
    }
}

macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name { $(#[serde(rename = $text)] $variant),+ }

        impl $name {
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
pub struct Replenishment {
    pub strategy: Strategy,
    /// MIN_SIZE_THRESHOLD only (and required there): 1..=size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_size: Option<i32>,
}

/// A pool's desired state. Fields the contract gives a default may be left `None` (or empty)
/// and are then left to the server; the server always answers with every field set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSpec {
    /// `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    pub size: i32,
    #[serde(default)]
    pub flintlock_hosts: Vec<String>,
    pub replenishment: Replenishment,
    /// flintlock's MicroVMSpec as JSON (proto field names); validated by the server.
    pub microvm_template: serde_json::Value,
    #[serde(default)]
    pub create_commands: Vec<String>,
    #[serde(default)]
    pub pre_lease_commands: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook_failure_policy: Option<HookFailurePolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    pub window_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_threshold: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_rollback: Option<bool>,
}

/// Where a pool's last rollout stands (`status.rollout`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStatus {
    /// `PROGRESSING`, `PAUSED`, `HALTED`, `ROLLED_BACK` or `COMPLETE`.
    pub state: String,
    pub current_revision: i32,
    pub target_revision: i32,
    /// VMs per revision and status (`available`, `leased`, `provisioning`, …).
    pub by_revision: BTreeMap<String, BTreeMap<String, i64>>,
    pub stale_leased: i64,
    pub extra_boots: i32,
    pub halted_reason: Option<String>,
}

/// One kept revision of a pool (`GET …/revisions`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Revision {
    pub revision: i32,
    pub spec: PoolSpec,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    pub rolled_out: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RevisionList {
    pub revisions: Vec<Revision>,
}

/// A pool's demand-based sizing (the contract's `autoscaling` block): exactly one of
/// `target_warm_ratio` and `buffer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Autoscaling {
    pub min: i32,
    /// Counts every VM of the pool: leased, provisioning and available.
    pub max: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_warm_ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<i32>,
    /// 300 when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_stabilization_seconds: Option<i32>,
}

impl Autoscaling {
    /// The contract's rules on the block, checked before anything is sent.
    pub fn validate(&self) -> Result<(), String> {
        if !(0..=MAX_POOL_SIZE).contains(&self.min) {
            return Err(format!("autoscaling.min must be between 0 and {MAX_POOL_SIZE}, got {}", self.min));
        }
        if !(1..=MAX_POOL_SIZE).contains(&self.max) || self.min > self.max {
            return Err(format!(
                "autoscaling.max must be between 1 and {MAX_POOL_SIZE} and at least autoscaling.min ({}), got {}",
                self.min, self.max
            ));
        }
        match (self.target_warm_ratio, self.buffer) {
            (Some(r), None) if r > 0.0 && r < 1.0 => Ok(()),
            (Some(r), None) => Err(format!("autoscaling.target_warm_ratio must be above 0 and below 1, got {r}")),
            (None, Some(b)) if (0..=self.max).contains(&b) => Ok(()),
            (None, Some(b)) => Err(format!("autoscaling.buffer must be between 0 and autoscaling.max, got {b}")),
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
    pub fn validate(&self) -> Result<(), String> {
        if let Some(ns) = &self.namespace {
            validate_name("namespace", ns)?;
        }
        validate_name("name", &self.name)?;
        if !(0..=MAX_POOL_SIZE).contains(&self.size) {
            return Err(format!("size must be between 0 and {MAX_POOL_SIZE}, got {}", self.size));
        }
        for h in &self.flintlock_hosts {
            validate_name("flintlock_hosts entry", h)?;
        }
        match (self.replenishment.strategy, self.replenishment.min_size) {
            (Strategy::MinSizeThreshold, None) => {
                return Err("replenishment.min_size is required for MIN_SIZE_THRESHOLD".into());
            }
            (Strategy::MinSizeThreshold, Some(m)) if m < 1 || m > self.size => {
                return Err(format!("replenishment.min_size must be between 1 and size ({}), got {m}", self.size));
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
            return Err(format!(
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
pub struct PoolStatus {
    pub available: i64,
    /// PRE_LEASE_HOOK_RUNNING, or LEASED without a committed lease.
    pub claiming: i64,
    pub leased: i64,
    pub provisioning: i64,
    pub quarantined: i64,
    pub deleting: i64,
}

/// An autoscaled pool's last sizing decision and what it was made from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoscalingStatus {
    /// `FLOOR`, `CEILING`, `DEMAND`, `HINT` or `STATIC`.
    pub reason: String,
    pub claims_per_second: f64,
    pub refused_per_second: f64,
    pub provisioning_seconds: f64,
    pub expected_claims: i64,
}

/// A pool's status: its live VM counts, what it works towards and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStatusFull {
    #[serde(flatten)]
    pub counts: PoolStatus,
    /// The autoscaler's size, else the spec's `size` (absent from older servers: 0).
    #[serde(default)]
    pub desired_size: i32,
    #[serde(default)]
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
pub struct ExpectRequest {
    pub claims: i32,
    pub within_seconds: i32,
}

impl ExpectRequest {
    /// The contract's bounds: `claims` 1..=10000, `within_seconds` 1..=3600.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_POOL_SIZE).contains(&self.claims) {
            return Err(format!("claims must be between 1 and {MAX_POOL_SIZE}, got {}", self.claims));
        }
        if !(1..=3600).contains(&self.within_seconds) {
            return Err(format!("within_seconds must be between 1 and 3600, got {}", self.within_seconds));
        }
        Ok(())
    }
}

/// `POST …/expect`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expected {
    pub expected_until: DateTime<Utc>,
    pub desired_size: i32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pool {
    pub spec: PoolSpec,
    /// Bumped by each change of `microvm_template` or `create_commands` (1 from older servers).
    #[serde(default = "first_revision")]
    pub revision: i32,
    pub status: PoolStatusFull,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub updated_at: DateTime<Utc>,
}

/// A lease (the contract's LeaseRecord).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub lease_id: String,
    pub vm_uid: String,
    pub pool: PoolRef,
    #[serde(serialize_with = "ts")]
    pub claimed_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub last_heartbeat_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
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
pub struct ClaimRequest {
    pub pool: PoolRef,
    /// The idempotency key: a claim with the id of a live lease returns that lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostAddress {
    pub name: String,
    pub address: String,
}

/// One of a claimed VM's interfaces, keyed by the template's `device_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkInterfaceStatus {
    pub host_device_name: String,
    pub index: i64,
    pub mac_address: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimedVm {
    pub id: String,
    pub uid: String,
    pub flintlock_host: HostAddress,
    pub network_interfaces: BTreeMap<String, NetworkInterfaceStatus>,
}

/// The answer of `POST /v1/claims`, for a fresh claim and a replay alike.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimResponse {
    pub lease: Lease,
    pub vm: ClaimedVm,
    /// `true` when an earlier claim with the same `request_id` created this lease.
    pub replayed: bool,
}

/// The answer of `POST /v1/leases/{lease_id}/heartbeat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub lease: Lease,
}

/// One page of `GET /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseList {
    pub leases: Vec<Lease>,
    /// Pass back as `page_token`; empty on the last page.
    pub next_page_token: String,
}

/// Filters and paging of `GET /v1/leases`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseQuery {
    pub pool: Option<PoolRef>,
    pub page_size: Option<i64>,
    pub page_token: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolList {
    pub pools: Vec<Pool>,
    /// Empty on the last page (and from a server that does not paginate).
    #[serde(default)]
    pub next_page_token: String,
}

/// A VM poolmgr manages (the contract's VMRecord).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vm {
    pub id: String,
    /// flintlock's uid; `None` until its create call returned.
    pub uid: Option<String>,
    pub pool: PoolRef,
    pub flintlock_host: String,
    pub phase: Phase,
    pub lease_id: Option<String>,
    /// The pool's revision the VM was created from (1 from older servers).
    #[serde(default = "first_revision")]
    pub revision: i32,
    pub network_interfaces: BTreeMap<String, NetworkInterfaceStatus>,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub updated_at: DateTime<Utc>,
}

fn first_revision() -> i32 {
    1
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmList {
    pub vms: Vec<Vm>,
    /// Empty on the last page (and from a server that does not paginate).
    #[serde(default)]
    pub next_page_token: String,
}

/// Filters of `GET /v1/vms`: a pool, or a namespace; a phase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmQuery {
    pub namespace: Option<String>,
    /// With `namespace` (the pool's own namespace when built by [`VmQuery::pool`]).
    pub pool: Option<String>,
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
pub struct HostTls {
    pub insecure: bool,
    pub ca_pem: Option<String>,
    pub cert_pem: Option<String>,
    pub key_pem: Option<String>,
}

/// The body of `POST /v1/hosts` and `PUT /v1/hosts/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostSpec {
    pub name: String,
    /// flintlockd's gRPC address, `host:port`.
    pub address: String,
    pub tls: HostTls,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub basic_auth_token: Option<String>,
    /// `auto` (the server's default) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<HostExec>,
}

/// A flintlock host. Secrets are never returned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    pub name: String,
    pub address: String,
    pub tls: HostTls,
    pub basic_auth_token: Option<String>,
    pub cordoned: bool,
    pub cordoned_reason: Option<String>,
    #[serde(serialize_with = "ts_opt")]
    pub cordoned_at: Option<DateTime<Utc>>,
    pub vm_count: i64,
    pub exec: HostExec,
    pub flintlock_version: Option<String>,
    pub exec_unavailable_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostList {
    pub hosts: Vec<Host>,
    /// Empty on the last page (and from a server that does not paginate).
    #[serde(default)]
    pub next_page_token: String,
}

/// One event of the feed. `kind` is the contract's `type` (`VM_CLAIMED`, …), kept as text
/// so types added by a newer server still read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub id: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub pool: PoolRef,
    pub vm_id: Option<String>,
    pub lease_id: Option<String>,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    pub payload: serde_json::Value,
}

/// One answer of `GET /v1/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventList {
    pub events: Vec<Event>,
    /// The cursor to pass as `after` next time.
    pub next_after: i64,
}

/// `GET /v1/events` parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventQuery {
    /// Events after this id (0: from the beginning).
    pub after: i64,
    pub pool: Option<PoolRef>,
    /// 1-1000; the server's default when absent.
    pub limit: Option<i64>,
    /// Long-poll up to this many seconds (≤ 20) when there is nothing new.
    pub wait_seconds: Option<u64>,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
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
        assert!(with(&|v| v["replenishment"]["min_size"] = json!(3)).unwrap_err().contains("replenishment.min_size"));
        assert!(
            with(&|v| v["replenishment"] = json!({"strategy": "MIN_SIZE_THRESHOLD"})).unwrap_err().contains("min_size")
        );
        assert!(with(&|v| v["size"] = json!(10_001)).unwrap_err().contains("size"));
        assert!(with(&|v| v["name"] = json!("CI")).unwrap_err().contains("name"));
        assert!(with(&|v| v["flintlock_hosts"] = json!(["a_b"])).unwrap_err().contains("flintlock_hosts"));
        let e = with(&|v| {
            v["heartbeat_interval_seconds"] = json!(60);
            v["heartbeat_expiry_seconds"] = json!(30);
        })
        .unwrap_err();
        assert!(e.contains("heartbeat_expiry_seconds"), "{e}");
        assert!(with(&|v| v["microvm_template"] = json!([])).unwrap_err().contains("microvm_template"));
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
