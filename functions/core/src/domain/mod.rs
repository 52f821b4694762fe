//! Domain types, parsed at the edge: once a value of these types exists it is valid.
//!
//! Nothing here touches the database or the network. Validation errors are plain strings
//! naming the field, turned into INVALID_ARGUMENT by the caller.
//!
//! This file: names, references, ids, phases and strategies, the pool spec and its validation;
//! `autoscaling.rs`: the `autoscaling` block and the state its sizing keeps; `rollout.rs`:
//! the `rollout` block and a rollout's states.

use std::fmt;
use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::template::MicroVmTemplate;

use crate::rules::{Commands, MinSize, NOT_BLANK, PoolSize, schema_only};
pub use crate::rules::{MAX_COMMAND_CHARS, MAX_COMMANDS, MAX_POOL_SIZE, MAX_REQUEST_ID_BYTES};

/// A DNS-label-like name: pool, namespace, host. The one definition: [`validate_name`]
/// checks it, and the OpenAPI document states it through the schema-only types [`Name`] and
/// [`NameFilter`] (fields say `value_type = Name, inline`), so the two can never disagree.
pub const NAME_PATTERN: &str = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$";

/// Schema only: a name field, a string matching [`NAME_PATTERN`].
#[allow(dead_code)]
pub struct Name(String);

impl utoipa::PartialSchema for Name {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(NAME_PATTERN))
            .into()
    }
}

impl ToSchema for Name {}

/// Schema only: an optional name filter of a query string, a name or empty for "any".
#[allow(dead_code)]
pub struct NameFilter(String);

impl utoipa::PartialSchema for NameFilter {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let body = NAME_PATTERN.trim_start_matches('^').trim_end_matches('$');
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(format!("^({body})?$")))
            .into()
    }
}

impl ToSchema for NameFilter {}

/// Schema only: a phase filter of a query string, a [`Phase`] or empty for "any".
#[allow(dead_code)]
pub struct PhaseFilter(String);

impl utoipa::PartialSchema for PhaseFilter {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let names = std::iter::once("").chain(Phase::ALL.iter().map(|p| p.as_str()));
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(names))
            .into()
    }
}

impl ToSchema for PhaseFilter {}

static NAME_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(NAME_PATTERN).expect("static regex"));

/// Validates a DNS-label-like name (pool, namespace, host).
pub fn validate_name(field: &str, value: &str) -> Result<(), String> {
    if NAME_RE.is_match(value) {
        Ok(())
    } else {
        Err(format!(
            "{field} {value:?} is invalid: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        ))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"namespace": "default", "name": "ci"}))]
pub struct PoolRef {
    #[schema(value_type = Name, inline)]
    pub namespace: String,
    #[schema(value_type = Name, inline)]
    pub name: String,
}

impl PoolRef {
    pub fn parse(namespace: &str, name: &str) -> Result<PoolRef, String> {
        validate_name("namespace", namespace)?;
        validate_name("name", name)?;
        Ok(PoolRef { namespace: namespace.to_owned(), name: name.to_owned() })
    }
}

impl fmt::Display for PoolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A pool's strong entity tag (its `ETag`): its spec version (V25), quoted (`"42"`). Clients
/// treat it as opaque: they send back what they read, in `If-Match`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolEtag(pub i64);

impl fmt::Display for PoolEtag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0)
    }
}

/// An `If-Match` header (RFC 9110 §13.1.1), parsed: `*` (any current pool), or the spec
/// versions its strong entity tags name. A weak tag (`W/"…"`) never matches, since If-Match
/// compares strongly, and neither does a tag this server never made; both are well-formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IfMatch {
    Any,
    Versions(Vec<i64>),
}

impl IfMatch {
    /// The field's values (one per header line), as a comma-separated list together.
    pub fn parse<'a>(values: impl IntoIterator<Item = &'a str>) -> Result<IfMatch, String> {
        let joined = values.into_iter().collect::<Vec<_>>().join(",");
        let bad = |why: &str| {
            format!("If-Match {joined:?}: {why}; send \"*\" or the ETag a GET of the pool answered (e.g. \"42\")")
        };
        let mut rest = joined.trim_matches([' ', '\t']);
        if rest == "*" {
            return Ok(IfMatch::Any);
        }
        let mut versions = Vec::new();
        let mut tags = 0;
        loop {
            rest = rest.trim_start_matches([' ', '\t', ',']);
            if rest.is_empty() {
                break;
            }
            let (weak, tail) = match rest.strip_prefix("W/") {
                Some(t) => (true, t),
                None => (false, rest),
            };
            let Some(tail) = tail.strip_prefix('"') else {
                return Err(bad("an entity tag is a quoted string"));
            };
            let Some(end) = tail.find('"') else { return Err(bad("an entity tag has no closing quote")) };
            let tag = &tail[..end];
            // etagc = %x21 / %x23-7E / obs-text: no controls, spaces or quotes.
            if tag.chars().any(|c| c.is_control() || c == ' ') {
                return Err(bad("an entity tag holds no spaces or control characters"));
            }
            // Strong comparison is byte-for-byte on the opaque tag (RFC 9110 §8.8.3.2): only
            // a tag spelled exactly as this server spells its ETags names a version, so "042"
            // or "+42" (which parse as 42) match nothing.
            if !weak
                && let Ok(v) = tag.parse::<i64>()
                && v.to_string() == tag
            {
                versions.push(v);
            }
            tags += 1;
            rest = tail[end + 1..].trim_start_matches([' ', '\t']);
            if !rest.is_empty() && !rest.starts_with(',') {
                return Err(bad("entity tags are separated by commas"));
            }
        }
        if tags == 0 {
            return Err(bad("it is empty"));
        }
        Ok(IfMatch::Versions(versions))
    }

    /// The spec versions an update is conditioned on; `None` for `*` (any existing pool).
    pub fn versions(&self) -> Option<&[i64]> {
        match self {
            IfMatch::Any => None,
            IfMatch::Versions(v) => Some(v),
        }
    }
}

/// A client-chosen idempotency key: non-empty, at most 255 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(String);

impl RequestId {
    /// `Ok(None)` for an empty id: the claim is then not retriable.
    pub fn parse(raw: &str) -> Result<Option<RequestId>, String> {
        if raw.is_empty() {
            return Ok(None);
        }
        if raw.len() > MAX_REQUEST_ID_BYTES {
            return Err(format!(
                "request_id is {} bytes long; at most {MAX_REQUEST_ID_BYTES} bytes are allowed",
                raw.len()
            ));
        }
        Ok(Some(RequestId(raw.to_owned())))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A random (version 4) UUID from the thread's CSPRNG (`rand`'s ChaCha generator, seeded and
/// reseeded from the OS): as unguessable as one drawn from the OS generator each time, without
/// a `getrandom` system call per id — the claim path makes two (the lease id and the request's
/// `x-request-id`).
pub fn random_uuid() -> uuid::Uuid {
    uuid::Builder::from_random_bytes(rand::random()).into_uuid()
}

/// A lease id: 122 random bits ([`random_uuid`]), so it cannot be guessed. Not a
/// capability on its own (it appears in logs): lease routes also check who claimed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseId(String);

impl LeaseId {
    pub fn generate() -> LeaseId {
        LeaseId(random_uuid().to_string())
    }

    pub fn parse(raw: &str) -> Result<LeaseId, String> {
        if !crate::rules::LEASE_ID.is_match(raw) {
            return Err(format!("lease id {raw:?} is malformed"));
        }
        Ok(LeaseId(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name { $(#[serde(rename = $text)] $variant),+ }

        // By hand: utoipa's derive cannot read a `rename` written by a macro.
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::Type::String)
                    .enum_values(Some([$($text),+]))
                    .into()
            }
        }

        impl ToSchema for $name {}

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

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

string_enum!(
    /// VM phases. DELETING is terminal: nothing moves a VM out of it.
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

string_enum!(
    Strategy {
        ImmediateOnLease => "IMMEDIATE_ON_LEASE",
        MinSizeThreshold => "MIN_SIZE_THRESHOLD",
        ReplaceOnDelete => "REPLACE_ON_DELETE",
    }
);

string_enum!(
    HookFailurePolicy {
        DeleteAndReplace => "DELETE_AND_REPLACE",
        Quarantine => "QUARANTINE",
    }
);

string_enum!(
    /// What the exec gate believes about a host (the Host object's `exec`): `auto` asks the
    /// host's ServerInfo; `enabled` / `disabled` is an admin's declaration that overrides it,
    /// so a misread ServerInfo (its field numbers are unpublished) can never lock hooks out.
    HostExec {
        Auto => "auto",
        Enabled => "enabled",
        Disabled => "disabled",
    }
);

impl HostExec {
    /// The default of a HostSpec without `exec`.
    pub fn auto() -> HostExec {
        HostExec::Auto
    }
}

string_enum!(
    EventType {
        VmProvisioned => "VM_PROVISIONED",
        VmAvailable => "VM_AVAILABLE",
        VmClaimed => "VM_CLAIMED",
        VmReleased => "VM_RELEASED",
        VmExpiringSoon => "VM_EXPIRING_SOON",
        VmDeletedDueToExpiry => "VM_DELETED_DUE_TO_EXPIRY",
        VmDeletedOnRelease => "VM_DELETED_ON_RELEASE",
        VmHookFailed => "VM_HOOK_FAILED",
        VmDeletedOnPoolDelete => "VM_DELETED_ON_POOL_DELETE",
        VmDeletedOnScaleDown => "VM_DELETED_ON_SCALE_DOWN",
        VmDiscarded => "VM_DISCARDED",
        VmAdopted => "VM_ADOPTED",
        VmOrphanDeleted => "VM_ORPHAN_DELETED",
        VmLost => "VM_LOST",
        PoolReplenishing => "POOL_REPLENISHING",
        PoolSizeBelowTarget => "POOL_SIZE_BELOW_TARGET",
        PoolScaled => "POOL_SCALED",
        RolloutStarted => "ROLLOUT_STARTED",
        VmDeletedForRollout => "VM_DELETED_FOR_ROLLOUT",
        RolloutHalted => "ROLLOUT_HALTED",
        RolloutRolledBack => "ROLLOUT_ROLLED_BACK",
        PoolRolloutCompleted => "POOL_ROLLOUT_COMPLETED",
        // Issue 25 item 3: an admin's change, with `by` (the principal) in the payload. Host
        // and principal events belong to no pool: their `pool` is empty.
        PoolCreated => "POOL_CREATED",
        PoolUpdated => "POOL_UPDATED",
        PoolDeleted => "POOL_DELETED",
        RolloutPaused => "ROLLOUT_PAUSED",
        RolloutResumed => "ROLLOUT_RESUMED",
        HostRegistered => "HOST_REGISTERED",
        HostUpdated => "HOST_UPDATED",
        HostRemoved => "HOST_REMOVED",
        HostCordoned => "HOST_CORDONED",
        HostUncordoned => "HOST_UNCORDONED",
        PrincipalLimitsSet => "PRINCIPAL_LIMITS_SET",
        PrincipalLimitsRemoved => "PRINCIPAL_LIMITS_REMOVED",
    }
);

/// The pool of an event that belongs to none (a host's, a principal's): empty.
pub fn no_pool() -> PoolRef {
    PoolRef { namespace: String::new(), name: String::new() }
}

mod autoscaling;
mod rollout;

pub use autoscaling::{Autoscaling, Batch, ScaleReason, ScalingState};
pub use rollout::{ClaimPreference, RolloutPolicy, RolloutState, VmQuantity};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Replenishment {
    pub strategy: Strategy,
    /// MIN_SIZE_THRESHOLD only (and required there): 1..=size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<MinSize>)]
    pub min_size: Option<i32>,
}

schema_only! {
    /// A [`Replenishment`] as [`PoolSpec::validate`] accepts it: `min_size` is required by
    /// MIN_SIZE_THRESHOLD and refused by the other strategies.
    ReplenishmentRules [Replenishment] = utoipa::openapi::schema::AllOfBuilder::new()
        .item(crate::rules::reference::<Replenishment>())
        .item(
            utoipa::openapi::schema::OneOfBuilder::new()
                .item(
                    utoipa::openapi::ObjectBuilder::new()
                        .property("strategy", crate::rules::string().enum_values(Some([Strategy::MinSizeThreshold.as_str()])))
                        .property("min_size", utoipa::openapi::ObjectBuilder::new().schema_type(utoipa::openapi::Type::Integer))
                        .required("min_size"),
                )
                .item(
                    utoipa::openapi::ObjectBuilder::new()
                        .property(
                            "strategy",
                            crate::rules::string().enum_values(Some(
                                Strategy::ALL.iter().filter(|s| **s != Strategy::MinSizeThreshold).map(|s| s.as_str()),
                            )),
                        )
                        .property("min_size", crate::rules::null()),
                ),
        );

    /// A PoolSpec's `flintlock_hosts`: registered host names, each at most once.
    HostNames [HostName] = utoipa::openapi::schema::ArrayBuilder::new()
        .items(crate::rules::reference::<HostName>())
        .unique_items(true)
        .description(Some("Registered host names (`POST /v1/hosts`), each at most once; VMs are placed on these"));
}

fn default_namespace() -> String {
    "default".into()
}
fn default_policy() -> HookFailurePolicy {
    HookFailurePolicy::DeleteAndReplace
}
fn default_interval() -> i32 {
    30
}
fn default_expiry() -> i32 {
    120
}

/// A pool's desired state, exactly the contract's PoolSpec JSON.
///
/// Rules no schema can state: `replenishment.min_size` ≤ `size`; `heartbeat_expiry_seconds`
/// ≥ `heartbeat_interval_seconds`; `flintlock_hosts` must be registered (and able to exec
/// when there are commands); on PUT, `namespace` and `name` must match the path. And one rule
/// it could state but does not: a template with a static MAC or address (a `guest_mac` that
/// is not empty, an `address`) needs `size` ≤ 1, a strategy other than IMMEDIATE_ON_LEASE and
/// hook_failure_policy DELETE_AND_REPLACE. As an `anyOf` around the whole body it made
/// schemathesis's coverage phase try 2 valid pool bodies instead of ~160.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({
    "namespace": "default", "name": "ci", "size": 2, "flintlock_hosts": ["local"],
    "replenishment": {"strategy": "REPLACE_ON_DELETE"},
    "microvm_template": {
        "kernel": {"image": "ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77", "filename": "boot/vmlinux"},
        "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
        "interfaces": [{"device_id": "eth1", "type": "TAP"}]
    },
    "heartbeat_interval_seconds": 30, "heartbeat_expiry_seconds": 120
}))]
pub struct PoolSpec {
    #[serde(default = "default_namespace")]
    #[schema(value_type = Name, inline, default = "default")]
    pub namespace: String,
    #[schema(value_type = Name, inline)]
    pub name: String,
    #[schema(value_type = PoolSize, inline)]
    pub size: i32,
    #[serde(default)]
    #[schema(value_type = HostNames, inline)]
    pub flintlock_hosts: Vec<String>,
    #[schema(value_type = ReplenishmentRules, inline)]
    pub replenishment: Replenishment,
    #[schema(value_type = crate::template::TemplateRules, inline)]
    pub microvm_template: MicroVmTemplate,
    /// Run once in each new VM, through flintlock's guest agent.
    #[serde(default)]
    #[schema(value_type = Commands, inline)]
    pub create_commands: Vec<String>,
    /// Run in the VM on every claim, before it is handed out.
    #[serde(default)]
    #[schema(value_type = Commands, inline)]
    pub pre_lease_commands: Vec<String>,
    #[serde(default = "default_policy")]
    #[schema(default = "DELETE_AND_REPLACE")]
    pub hook_failure_policy: HookFailurePolicy,
    #[serde(default = "default_interval")]
    #[schema(minimum = 1, default = 30)]
    pub heartbeat_interval_seconds: i32,
    /// At least `heartbeat_interval_seconds`.
    #[serde(default = "default_expiry")]
    #[schema(minimum = 1, default = 120)]
    pub heartbeat_expiry_seconds: i32,
    /// A lease is never extended past `claimed_at` + this (its claim's first deadline
    /// included); absent or null: heartbeats extend it for ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 31536000, example = 7200)]
    pub max_lease_seconds: Option<i32>,
    /// Demand-based sizing; absent or null: `size` is the target, as without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// How a template change reaches the warm VMs; absent or null: it applies to new VMs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutPolicy>,
}

/// The longest `max_lease_seconds`: a year.
pub const MAX_LEASE_SECONDS: i32 = 31_536_000;

/// A pool's VMs counted by phase, as the API's pool status, the pool gauges and the
/// replenishment strategies count them (reference-behaviour §4.2). Pure data: the store's
/// `VM_COUNTS_OF_POOL_P` is the one definition of what each count holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct VmCounts {
    pub available: i64,
    /// PRE_LEASE_HOOK_RUNNING, or LEASED without a committed lease row.
    pub claiming: i64,
    /// LEASED with a committed lease row.
    pub leased: i64,
    /// PROVISIONING and CREATE_HOOK_RUNNING.
    pub provisioning: i64,
    pub quarantined: i64,
    pub deleting: i64,
    /// Every row, in any phase (FAILED included).
    pub rows: i64,
}

/// A host name in a PoolSpec (schema only).
#[allow(dead_code)]
pub struct HostName(String);

impl utoipa::PartialSchema for HostName {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let mut schema = <Name as utoipa::PartialSchema>::schema();
        if let utoipa::openapi::RefOr::T(utoipa::openapi::schema::Schema::Object(o)) = &mut schema {
            o.description = Some("A host name in a PoolSpec (schema only).".into());
        }
        schema
    }
}

impl ToSchema for HostName {}

impl PoolSpec {
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef { namespace: self.namespace.clone(), name: self.name.clone() }
    }

    /// Checks everything that needs no database. Host registration is checked by the store.
    pub fn validate(&self) -> Result<(), String> {
        validate_name("namespace", &self.namespace)?;
        validate_name("name", &self.name)?;
        if !(0..=MAX_POOL_SIZE).contains(&self.size) {
            return Err(format!("size must be between 0 and {MAX_POOL_SIZE}, got {}", self.size));
        }
        let mut seen = std::collections::HashSet::new();
        for h in &self.flintlock_hosts {
            validate_name("flintlock_hosts entry", h)?;
            if !seen.insert(h) {
                return Err(format!("flintlock_hosts lists {h:?} twice"));
            }
        }
        match (self.replenishment.strategy, self.replenishment.min_size) {
            (Strategy::MinSizeThreshold, None) => {
                return Err("replenishment.min_size is required for MIN_SIZE_THRESHOLD".into());
            }
            (Strategy::MinSizeThreshold, Some(m)) if m < 1 || m > self.size => {
                return Err(format!("replenishment.min_size must be between 1 and size ({}), got {m}", self.size));
            }
            (Strategy::MinSizeThreshold, Some(_)) => {}
            (s, Some(_)) => {
                return Err(format!("replenishment.min_size applies only to MIN_SIZE_THRESHOLD, not {s}"));
            }
            (_, None) => {}
        }
        for (field, cmds) in
            [("create_commands", &self.create_commands), ("pre_lease_commands", &self.pre_lease_commands)]
        {
            if cmds.len() > MAX_COMMANDS {
                return Err(format!("{field} has {} commands; at most {MAX_COMMANDS} are allowed", cmds.len()));
            }
            for (i, c) in cmds.iter().enumerate() {
                if !NOT_BLANK.is_match(c) {
                    return Err(format!("{field}[{i}] is empty"));
                }
                if c.chars().count() > MAX_COMMAND_CHARS {
                    return Err(format!("{field}[{i}] is longer than {MAX_COMMAND_CHARS} characters"));
                }
            }
        }
        if self.heartbeat_interval_seconds < 1 {
            return Err("heartbeat_interval_seconds must be at least 1".into());
        }
        if self.heartbeat_expiry_seconds < 1 || self.heartbeat_expiry_seconds < self.heartbeat_interval_seconds {
            return Err(format!(
                "heartbeat_expiry_seconds must be at least 1 and at least heartbeat_interval_seconds ({})",
                self.heartbeat_interval_seconds
            ));
        }
        if let Some(m) = self.max_lease_seconds
            && !(1..=MAX_LEASE_SECONDS).contains(&m)
        {
            return Err(format!("max_lease_seconds must be 1..={MAX_LEASE_SECONDS} (a year), or null for no bound"));
        }
        if let Some(r) = &self.rollout {
            r.validate()?;
        }
        if let Some(a) = &self.autoscaling {
            a.validate()?;
            // It refills only below min_size: a desired size raised by demand or a hint would
            // create nothing until the pool was nearly empty.
            if self.replenishment.strategy == Strategy::MinSizeThreshold {
                return Err("autoscaling applies to IMMEDIATE_ON_LEASE and REPLACE_ON_DELETE pools, not MIN_SIZE_THRESHOLD (which refills only below min_size)".into());
            }
            if self.microvm_template.has_static_network() {
                return Err("autoscaling cannot size a pool whose microvm_template sets guest_mac or a static address (such a pool holds at most one VM)".into());
            }
        }
        self.microvm_template.validate()?;
        // A static MAC or address can only exist once on the network: such a pool may hold at
        // most one VM and must never keep a broken one around or provision ahead of a claim.
        if self.microvm_template.has_static_network()
            && (self.size > 1
                || self.replenishment.strategy == Strategy::ImmediateOnLease
                || self.hook_failure_policy == HookFailurePolicy::Quarantine)
        {
            return Err("microvm_template.interfaces sets guest_mac or a static address: such a pool needs size <= 1, a strategy other than IMMEDIATE_ON_LEASE and hook_failure_policy DELETE_AND_REPLACE".into());
        }
        Ok(())
    }
}

/// Text from outside poolmgr (a hook command's output, a flintlock host's error message) made
/// safe to store and show: every control character except newline and tab is written as
/// `\xNN`, and the text is cut to at most `max` bytes (plus a `…` marking the cut) on a
/// character boundary, never inside an escape. PostgreSQL refuses `\u0000` in jsonb (and NUL
/// in text); a terminal or a log line must not receive raw escape sequences.
///
/// `keep` says which end survives a cut: [`Keep::Head`] for a command, [`Keep::Tail`] for
/// output, whose last lines usually say what went wrong.
pub fn printable(s: &str, max: usize, keep: Keep) -> String {
    fn piece(c: char) -> std::borrow::Cow<'static, str> {
        if c.is_control() && c != '\n' && c != '\t' {
            format!("\\x{:02x}", u32::from(c)).into()
        } else {
            String::from(c).into()
        }
    }
    let mut len = 0;
    let mut cut = false;
    let mut pieces = Vec::new();
    let chars: Box<dyn Iterator<Item = char>> = match keep {
        Keep::Head => Box::new(s.chars()),
        Keep::Tail => Box::new(s.chars().rev()),
    };
    for c in chars {
        let p = piece(c);
        if len + p.len() > max {
            cut = true;
            break;
        }
        len += p.len();
        pieces.push(p);
    }
    let mut out = String::with_capacity(len + 3);
    match keep {
        Keep::Head => {
            pieces.iter().for_each(|p| out.push_str(p));
            if cut {
                out.push('…');
            }
        }
        Keep::Tail => {
            if cut {
                out.push('…');
            }
            pieces.iter().rev().for_each(|p| out.push_str(p));
        }
    }
    out
}

/// Which end of a text [`printable`] keeps when it must cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    Head,
    Tail,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_match_headers() {
        assert_eq!(IfMatch::parse(["*"]).unwrap(), IfMatch::Any);
        assert_eq!(IfMatch::parse(["\"42\""]).unwrap(), IfMatch::Versions(vec![42]));
        assert_eq!(IfMatch::parse([" \"1\" , \"2\"", "\"3\""]).unwrap(), IfMatch::Versions(vec![1, 2, 3]));
        // Well-formed but never matching: weak, foreign.
        assert_eq!(IfMatch::parse(["W/\"42\", \"abc\", \"a,b\""]).unwrap(), IfMatch::Versions(vec![]));
        // Strong comparison is byte-for-byte: other spellings of 42 are not the ETag "42".
        for other in ["\"042\"", "\"+42\"", "\"-0\"", "\"00\""] {
            assert_eq!(IfMatch::parse([other]).unwrap(), IfMatch::Versions(vec![]), "{other}");
        }
        assert_eq!(IfMatch::parse(["\"0\", \"-3\""]).unwrap(), IfMatch::Versions(vec![0, -3]));
        for bad in ["", " ", "42", "\"42", "\"4 2\"", "\"1\" \"2\"", "*, \"1\"", "W/42"] {
            let e = IfMatch::parse([bad]).unwrap_err();
            assert!(e.starts_with("If-Match "), "{bad:?}: {e}");
        }
        assert_eq!(PoolEtag(42).to_string(), "\"42\"");
        assert_eq!(IfMatch::parse([PoolEtag(7).to_string().as_str()]).unwrap().versions(), Some(&[7][..]));
    }

    #[test]
    fn request_id_boundaries() {
        assert!(RequestId::parse(&"a".repeat(255)).unwrap().is_some());
        assert!(RequestId::parse(&"a".repeat(256)).is_err());
        // 128 two-byte characters are 256 bytes.
        assert!(RequestId::parse(&"é".repeat(128)).is_err());
        assert_eq!(RequestId::parse("").unwrap(), None);
    }

    #[test]
    fn names() {
        assert!(validate_name("n", "ci").is_ok());
        assert!(validate_name("n", "a").is_ok());
        assert!(validate_name("n", &"a".repeat(63)).is_ok());
        for bad in ["", "-a", "a-", "A", "a_b", "a/b", &"a".repeat(64)] {
            assert!(validate_name("n", bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn schema_name_patterns_are_the_validated_pattern() {
        use utoipa::PartialSchema;
        for schema in [PoolRef::schema(), HostName::schema()] {
            let json = serde_json::to_string(&schema).unwrap();
            let escaped = serde_json::to_string(NAME_PATTERN).unwrap();
            assert!(json.contains(&format!("\"pattern\":{escaped}")), "{json}");
        }
    }

    #[test]
    fn enum_schemas_list_the_wire_names() {
        use utoipa::PartialSchema;
        let schema = serde_json::to_value(Strategy::schema()).unwrap();
        assert_eq!(
            schema["enum"],
            serde_json::json!(["IMMEDIATE_ON_LEASE", "MIN_SIZE_THRESHOLD", "REPLACE_ON_DELETE"])
        );
    }

    #[test]
    fn phase_round_trip() {
        for p in Phase::ALL {
            assert_eq!(Phase::parse(p.as_str()), Some(*p));
        }
        assert_eq!(Phase::parse("nope"), None);
    }

    #[test]
    fn printable_escapes_control_characters_and_cuts_on_a_boundary() {
        assert_eq!(printable("ok\n\tdone", 100, Keep::Head), "ok\n\tdone");
        assert_eq!(printable("a\0b\x1b[31mc\r\u{85}", 100, Keep::Head), "a\\x00b\\x1b[31mc\\x0d\\x85");
        assert_eq!(printable("abcdef", 3, Keep::Head), "abc…");
        assert_eq!(printable("abcdef", 3, Keep::Tail), "…def");
        // Never half a character or half an escape.
        assert_eq!(printable("ééé", 5, Keep::Head), "éé…");
        assert_eq!(printable("a\0", 3, Keep::Head), "a…");
        assert_eq!(printable("\0z", 3, Keep::Tail), "…z");
        let long = "x".repeat(10_000);
        assert_eq!(printable(&long, 2048, Keep::Tail).len(), 2048 + '…'.len_utf8());
    }
}
