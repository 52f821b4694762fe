//! The JSON objects of the HTTP contract (`shared/http-api.md`, "Objects"), built from rows.
//!
//! Only this module decides what a client sees: host secrets are never copied into a view.
//! Each object also derives its OpenAPI schema (`utoipa::ToSchema`), so the document served
//! at `/openapi.json` describes exactly these types; an `Option` field that is always
//! serialized (as `null` when empty) is marked `required` and is nullable. Every object
//! derives `Deserialize` too, so the integration tests read bodies as these types (and check
//! they serialize back to exactly the wire body); timestamps read any RFC 3339 form and
//! write the contract's.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize, Serializer};
use utoipa::ToSchema;

use crate::domain::{PoolRef, PoolSpec};
use crate::store::{EventRow, HostRow, LeaseRow, LeaseView, PoolRow, PoolStatus, VmRow};

/// RFC 3339 UTC with a `Z` and microseconds, the contract's timestamp form.
pub fn ts<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Micros, true))
}

fn ts_opt<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => ts(t, s),
        None => s.serialize_none(),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct LeaseRecord {
    pub lease_id: String,
    pub vm_uid: String,
    pub pool: PoolRef,
    #[serde(serialize_with = "ts")]
    pub claimed_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub last_heartbeat_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub expires_at: DateTime<Utc>,
    /// `null` when the claim had none.
    #[schema(required)]
    pub request_id: Option<String>,
}

impl LeaseRecord {
    pub fn new(lease: &LeaseRow, vm: Option<&VmRow>) -> LeaseRecord {
        LeaseRecord {
            lease_id: lease.lease_id.clone(),
            vm_uid: vm.and_then(|v| v.uid.clone()).unwrap_or_default(),
            pool: lease.pool_ref(),
            claimed_at: lease.claimed_at,
            last_heartbeat_at: lease.last_heartbeat_at,
            expires_at: lease.expires_at,
            request_id: lease.request_id.clone(),
        }
    }

    pub fn from_view(v: &LeaseView) -> LeaseRecord {
        LeaseRecord::new(&v.lease, v.vm.as_ref())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct HostInfo {
    pub name: String,
    pub address: String,
}

/// One entry of a VM's `network_interfaces`, keyed by the template's `device_id`: what
/// flintlock reported when the VM booted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct NetworkInterfaceStatus {
    pub host_device_name: String,
    pub index: i64,
    pub mac_address: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ClaimedVm {
    pub id: String,
    pub uid: String,
    pub flintlock_host: HostInfo,
    #[schema(value_type = std::collections::BTreeMap<String, NetworkInterfaceStatus>)]
    pub network_interfaces: serde_json::Value,
}

/// The answer of `POST /v1/claims`, for a fresh claim and a replay alike.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = ClaimVMResponse)]
pub struct ClaimResponse {
    pub lease: LeaseRecord,
    pub vm: ClaimedVm,
    pub replayed: bool,
}

impl ClaimResponse {
    /// Built from stored data only: the VM's interfaces were recorded at provisioning, so the
    /// claim path never calls flintlock.
    pub fn new(view: &LeaseView, vm: &VmRow, replayed: bool) -> ClaimResponse {
        ClaimResponse {
            lease: LeaseRecord::new(&view.lease, Some(vm)),
            vm: ClaimedVm {
                id: vm.id.clone(),
                uid: vm.uid.clone().unwrap_or_default(),
                flintlock_host: HostInfo {
                    name: vm.flintlock_host.clone(),
                    address: view.host.as_ref().map(|h| h.address.clone()).unwrap_or_default(),
                },
                network_interfaces: vm.network_interfaces.clone(),
            },
            replayed,
        }
    }
}

/// Live VM counts of a pool: the schema of [`crate::store::PoolStatus`], which is serialized
/// as is (the Router test validates real pools against it).
#[derive(ToSchema)]
#[schema(as = PoolStatus)]
#[allow(dead_code)]
pub struct PoolStatusView {
    available: i64,
    /// PRE_LEASE_HOOK_RUNNING, or LEASED without a committed lease row.
    claiming: i64,
    leased: i64,
    provisioning: i64,
    quarantined: i64,
    deleting: i64,
    /// What the pool works towards: the autoscaler's size, else the spec's `size`.
    desired_size: i32,
    /// Why, and what was measured; `null` without an autoscaling block.
    #[schema(required)]
    autoscaling: Option<AutoscalingStatus>,
    /// The pool's last rollout; `null` when none ever ran.
    #[schema(required)]
    rollout: Option<RolloutStatus>,
}

/// An autoscaled pool's last sizing decision and what it was made from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct AutoscalingStatus {
    pub reason: crate::domain::ScaleReason,
    /// Claims that took a VM, per second, over the demand window.
    pub claims_per_second: f64,
    /// Claims refused for want of a VM, per second (each request once).
    pub refused_per_second: f64,
    /// The p90 of recent VMs' creation to AVAILABLE (the default until one was measured).
    pub provisioning_seconds: f64,
    /// Announced claims (`POST …/expect`) not arrived yet.
    pub expected_claims: i64,
    /// Idle VMs kept for batches of claims at once (a CI matrix) while they keep coming; 0
    /// when none were seen lately.
    #[serde(default)]
    pub batch_buffer: i64,
}

/// `POST …/expect`'s answer: until when the hint lasts and the size the pool now works towards.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Expected {
    #[serde(serialize_with = "ts")]
    pub expected_until: DateTime<Utc>,
    pub desired_size: i32,
}

/// A pool's status: its live VM counts, its desired size, and the autoscaler's view.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PoolStatusOut {
    #[serde(flatten)]
    pub counts: PoolStatus,
    pub desired_size: i32,
    pub autoscaling: Option<AutoscalingStatus>,
    /// The pool's last rollout; `null` when none ever ran.
    #[serde(default)]
    pub rollout: Option<RolloutStatus>,
}

/// Where a pool's rollout stands (`status.rollout`, issue 24).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct RolloutStatus {
    pub state: crate::domain::RolloutState,
    /// The revision the warm VMs are on until the rollout is done (then the target).
    pub current_revision: i32,
    /// The pool's revision: what the rollout works towards.
    pub target_revision: i32,
    /// The pool's VMs by revision and status (`available`, `claiming`, `leased`,
    /// `provisioning`, `quarantined`, `failed`).
    pub by_revision: std::collections::BTreeMap<String, std::collections::BTreeMap<String, i64>>,
    /// Leased (or being claimed) VMs of another revision: never touched, gone on release.
    pub stale_leased: i64,
    /// Stale AVAILABLE VMs the rollout retired: boots no claim needed.
    pub extra_boots: i32,
    #[schema(required)]
    pub halted_reason: Option<String>,
}

impl RolloutStatus {
    fn new(row: &PoolRow) -> Option<RolloutStatus> {
        let state = row.rollout_state?;
        let by_revision = row.by_revision.clone().unwrap_or_default();
        let target = row.target_revision();
        let stale_leased = by_revision
            .iter()
            .filter(|(rev, _)| rev.parse::<i32>().ok() != Some(target))
            .map(|(_, c)| c.get("leased").copied().unwrap_or(0) + c.get("claiming").copied().unwrap_or(0))
            .sum();
        let under_way = row.rollout_event_id.is_some() || state == crate::domain::RolloutState::Halted;
        Some(RolloutStatus {
            state,
            current_revision: if under_way { row.rollout_from.unwrap_or(target) } else { target },
            target_revision: target,
            by_revision,
            stale_leased,
            extra_boots: row.rollout_extra_boots,
            halted_reason: row.rollout_halted_reason.clone(),
        })
    }
}

/// The counts read through: `pool.status.available`.
impl std::ops::Deref for PoolStatusOut {
    type Target = PoolStatus;
    fn deref(&self) -> &PoolStatus {
        &self.counts
    }
}

impl PoolStatusOut {
    pub fn new(row: &PoolRow, counts: PoolStatus) -> PoolStatusOut {
        let autoscaling = row.autoscaling.as_ref().map(|_| {
            let s = row.scaling.clone().unwrap_or_default();
            AutoscalingStatus {
                reason: s.reason.unwrap_or(crate::domain::ScaleReason::Static),
                claims_per_second: s.claims_per_second,
                refused_per_second: s.refused_per_second,
                provisioning_seconds: s.provisioning_seconds,
                expected_claims: s.expected_claims,
                batch_buffer: s.batch_buffer,
            }
        });
        PoolStatusOut { counts, desired_size: row.target_size(), autoscaling, rollout: RolloutStatus::new(row) }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Pool {
    pub spec: PoolSpec,
    /// Bumped by each change of `microvm_template` or `create_commands` (issue 24).
    #[serde(default = "first_revision")]
    #[schema(minimum = 1)]
    pub revision: i32,
    #[schema(value_type = PoolStatusView)]
    pub status: PoolStatusOut,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub updated_at: DateTime<Utc>,
}

impl Pool {
    pub fn new(row: &PoolRow, status: PoolStatus) -> Pool {
        Pool {
            spec: row.spec(),
            revision: row.revision,
            status: PoolStatusOut::new(row, status),
            created_at: row.created_at,
            updated_at: row.updated_at,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = VMRecord)]
pub struct VmRecord {
    pub id: String,
    /// flintlock's uid; `null` until the create call returned.
    #[schema(required)]
    pub uid: Option<String>,
    pub pool: PoolRef,
    pub flintlock_host: String,
    pub phase: crate::domain::Phase,
    #[schema(required)]
    pub lease_id: Option<String>,
    /// The pool's revision the VM was created from.
    #[serde(default = "first_revision")]
    #[schema(minimum = 1)]
    pub revision: i32,
    #[schema(value_type = std::collections::BTreeMap<String, NetworkInterfaceStatus>)]
    pub network_interfaces: serde_json::Value,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "ts")]
    pub updated_at: DateTime<Utc>,
}

/// A pool's or a VM's revision from a server before revisions existed.
fn first_revision() -> i32 {
    1
}

/// One kept revision of a pool: the spec that created it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Revision {
    #[schema(minimum = 1)]
    pub revision: i32,
    pub spec: PoolSpec,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    /// Every warm VM of the pool was of this revision at some point.
    pub rolled_out: bool,
}

impl From<&crate::store::RevisionRow> for Revision {
    fn from(r: &crate::store::RevisionRow) -> Self {
        Revision { revision: r.revision, spec: r.spec.clone(), created_at: r.created_at, rolled_out: r.rolled_out }
    }
}

/// `GET /v1/pools/{namespace}/{name}/revisions`: the last 10, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct RevisionList {
    pub revisions: Vec<Revision>,
}

impl From<&VmRow> for VmRecord {
    fn from(v: &VmRow) -> Self {
        VmRecord {
            id: v.id.clone(),
            uid: v.uid.clone(),
            pool: v.pool_ref(),
            flintlock_host: v.flintlock_host.clone(),
            phase: v.phase,
            lease_id: v.lease_id.clone(),
            revision: v.revision,
            network_interfaces: v.network_interfaces.clone(),
            created_at: v.created_at,
            updated_at: v.updated_at,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = HostTls)]
pub struct HostTlsView {
    pub insecure: bool,
    /// A CA certificate is public; it is returned so operators can see what is configured.
    #[schema(required)]
    pub ca_pem: Option<String>,
    #[schema(required)]
    pub cert_pem: Option<String>,
    /// Write-only: always null.
    #[schema(required)]
    pub key_pem: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Host {
    pub name: String,
    pub address: String,
    pub tls: HostTlsView,
    /// Write-only: always null.
    #[schema(required)]
    pub basic_auth_token: Option<String>,
    pub cordoned: bool,
    #[schema(required)]
    pub cordoned_reason: Option<String>,
    #[serde(serialize_with = "ts_opt")]
    #[schema(required)]
    pub cordoned_at: Option<DateTime<Utc>>,
    pub vm_count: i64,
    /// Whether the host can run hooks: `auto` asks its ServerInfo, `enabled` / `disabled` is an
    /// admin's declaration that overrides ServerInfo.
    pub exec: crate::domain::HostExec,
    /// The version its last ServerInfo probe reported (probed when a pool with hooks names
    /// the host), null if never probed.
    #[schema(required)]
    pub flintlock_version: Option<String>,
    /// Why this host cannot run hooks, null if it can or was never probed.
    #[schema(required)]
    pub exec_unavailable_reason: Option<String>,
}

impl Host {
    pub fn new(h: &HostRow, vm_count: i64) -> Host {
        Host {
            name: h.name.clone(),
            address: h.address.clone(),
            tls: HostTlsView {
                insecure: h.tls_insecure,
                ca_pem: h.ca_pem.clone(),
                cert_pem: h.cert_pem.clone(),
                key_pem: None,
            },
            basic_auth_token: None,
            cordoned: h.cordoned,
            cordoned_reason: h.cordoned_reason.clone(),
            cordoned_at: h.cordoned_at,
            vm_count,
            exec: h.exec,
            flintlock_version: h.flintlock_version.clone(),
            exec_unavailable_reason: h.exec_unavailable_reason.clone(),
        }
    }
}

/// An event's pool (schema only): a PoolRef, or both names empty for an event of no pool (a
/// host's or a principal's change, issue 25 item 3).
#[derive(ToSchema)]
#[allow(dead_code)]
struct EventPool {
    #[schema(example = "default")]
    namespace: String,
    #[schema(example = "ci")]
    name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Event {
    pub id: i64,
    #[serde(rename = "type")]
    #[schema(value_type = crate::domain::EventType)]
    pub kind: String,
    #[schema(value_type = EventPool)]
    pub pool: PoolRef,
    #[schema(required)]
    pub vm_id: Option<String>,
    #[schema(required)]
    pub lease_id: Option<String>,
    #[serde(serialize_with = "ts")]
    pub created_at: DateTime<Utc>,
    /// Details of the event, by type (free-form).
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
}

impl From<&EventRow> for Event {
    fn from(e: &EventRow) -> Self {
        Event {
            id: e.id,
            kind: e.kind.clone(),
            pool: PoolRef { namespace: e.pool_namespace.clone(), name: e.pool_name.clone() },
            vm_id: e.vm_id.clone(),
            lease_id: e.lease_id.clone(),
            created_at: e.created_at,
            payload: e.payload.clone(),
        }
    }
}

/// `POST /v1/leases/{lease_id}/heartbeat`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct HeartbeatResponse {
    pub lease: LeaseRecord,
}

/// `GET /v1/leases`: one page, ordered by `lease_id`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct LeaseList {
    pub leases: Vec<LeaseRecord>,
    /// Pass back as `page_token` for the next page; empty on the last page.
    pub next_page_token: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct PoolList {
    pub pools: Vec<Pool>,
    /// Pass it back as `page_token` for the next page; empty on the last.
    pub next_page_token: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct HostList {
    pub hosts: Vec<Host>,
    /// Pass it back as `page_token` for the next page; empty on the last.
    pub next_page_token: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct VmList {
    pub vms: Vec<VmRecord>,
    /// Pass it back as `page_token` for the next page; empty on the last.
    pub next_page_token: String,
}

/// `GET /v1/events`: events after the cursor, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct EventList {
    pub events: Vec<Event>,
    /// The id of the last event returned (or the `after` given, if none): the next `after`.
    pub next_after: i64,
}

/// `GET /livez`, `/readyz`, `/healthz`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Health {
    /// Always `ok`: a failed check answers 503 instead.
    #[schema(value_type = String, pattern = "^ok$")]
    pub status: String,
}

/// A client principal's scope and quota (`/v1/principals/{name}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct PrincipalLimits {
    /// The principal: a token's name.
    #[schema(example = "ci")]
    pub principal: String,
    /// Pool patterns it may claim from (`namespace/*`, `namespace/name`); `null`: every pool.
    #[schema(example = json!(["team-a/*", "shared/ci"]))]
    pub pools: Option<Vec<String>>,
    /// Live leases it may hold at once (claims running their pre-lease hook included);
    /// `null`: no quota.
    #[schema(example = 10)]
    pub max_live_leases: Option<i32>,
    /// What its quota counts now.
    pub live_leases: i64,
    #[serde(serialize_with = "ts")]
    pub updated_at: DateTime<Utc>,
    /// The admin who set them.
    pub updated_by: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct PrincipalLimitsList {
    pub principals: Vec<PrincipalLimits>,
}

impl PrincipalLimits {
    pub fn new(row: &crate::store::PrincipalLimitsRow, live_leases: i64) -> PrincipalLimits {
        PrincipalLimits {
            principal: row.principal.clone(),
            pools: row.pools.clone(),
            max_live_leases: row.max_live_leases,
            live_leases,
            updated_at: row.updated_at,
            updated_by: row.updated_by.clone(),
        }
    }
}
