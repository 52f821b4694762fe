//! A pool's `microvm_template`: flintlock's MicroVMSpec as JSON with proto field names.
//!
//! Parsed strictly (unknown fields are refused with their name) and validated against the
//! rules flintlock itself applies, so a bad template fails at pool create instead of on every
//! provisioning attempt. Fields poolmgr owns (`id`, `uid`, `namespace`) are not accepted;
//! `allow_guest_agent` is always forced on.

use std::collections::BTreeMap;

use flintlock_proto::types as pb;
use serde::{Deserialize, Serialize};
use utoipa::openapi::schema::{AllOfBuilder, AnyOfBuilder, ArrayBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::{ObjectBuilder, RefOr};
use utoipa::{PartialSchema, ToSchema};

use crate::rules::{
    CIDR, Cidr, DEFAULT_MEMORY_IN_MB, DEFAULT_PROVIDER, DEFAULT_VCPU, DEVICE_ID, DeviceId, GUEST_MAC, GuestMac,
    IP_ADDRESS, IpAddress, MEMORY_IN_MB, MemoryInMb, NOT_BLANK, NonEmpty, NotBlank, PROVIDERS, Provider, VCPU, Vcpu,
    null, object, reference, schema_only, string,
};

/// Rules no schema can state: volume ids are unique across `root_volume` and
/// `additional_volumes`; interface `device_id`s are unique; at most one additional volume uses
/// `virtiofs_source`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = MicroVMTemplate)]
pub struct MicroVmTemplate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vcpu>)]
    pub vcpu: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<MemoryInMb>)]
    pub memory_in_mb: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<Kernel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<Initrd>,
    /// Required unless there is an initrd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<RootVolume>)]
    pub root_volume: Option<Volume>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<AdditionalVolume>)]
    pub additional_volumes: Vec<Volume>,
    /// At least one.
    #[serde(default)]
    #[schema(min_items = 1, required)]
    pub interfaces: Vec<NetworkInterface>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Accepted for compatibility; flintlock drops labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Provider>)]
    pub provider: Option<String>,
    /// Always forced to true: hooks need the guest agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_guest_agent: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Kernel {
    #[serde(default)]
    #[schema(value_type = NotBlank, required)]
    pub image: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cmdline: BTreeMap<String, String>,
    /// The kernel's path in the image, e.g. `boot/vmlinux`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = NonEmpty, required)]
    pub filename: Option<String>,
    #[serde(default)]
    pub add_network_config: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Initrd {
    #[serde(default)]
    #[schema(value_type = NotBlank, required)]
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filename: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Volume {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub is_read_only: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_point: Option<String>,
    #[serde(default)]
    pub source: VolumeSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_in_mb: Option<i32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtiofs_source: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub enum IfaceType {
    #[serde(rename = "MACVTAP")]
    Macvtap,
    /// Our default (flintlock's is MACVTAP, which its default provider rejects).
    #[default]
    #[serde(rename = "TAP")]
    Tap,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkInterface {
    #[schema(value_type = DeviceId)]
    pub device_id: String,
    #[serde(default, rename = "type")]
    pub kind: IfaceType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<GuestMac>)]
    pub guest_mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<StaticAddress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overrides: Option<NetworkOverrides>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StaticAddress {
    #[schema(value_type = Cidr)]
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Cidr>)]
    pub gateway: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<IpAddress>)]
    pub nameservers: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkOverrides {
    /// flintlock dereferences it without a check: required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = NonEmpty, required)]
    pub bridge_name: Option<String>,
}

schema_only! {
    /// A [`MicroVmTemplate`] as [`MicroVmTemplate::validate`] accepts it: with a root volume
    /// or an initrd, and MACVTAP interfaces or virtiofs volumes only with a provider other than
    /// the default.
    TemplateRules [MicroVmTemplate] = AllOfBuilder::new()
        .item(reference::<MicroVmTemplate>())
        .item(
            AnyOfBuilder::new()
                .item(object([("root_volume", ObjectBuilder::new().schema_type(Type::Object))]).required("root_volume"))
                .item(object([("initrd", ObjectBuilder::new().schema_type(Type::Object))]).required("initrd")),
        )
        .item(
            AnyOfBuilder::new()
                .item(
                    object([("provider", string().enum_values(Some(PROVIDERS.into_iter().filter(|p| *p != DEFAULT_PROVIDER))))])
                        .required("provider"),
                )
                .item(
                    ObjectBuilder::new()
                        .property(
                            "interfaces",
                            ArrayBuilder::new().items(object([(
                                "type",
                                string().enum_values(Some([serde_json::to_value(IfaceType::Tap).unwrap_or_default()])),
                            )])),
                        )
                        .property(
                            "additional_volumes",
                            ArrayBuilder::new().items(object([("source", object([("virtiofs_source", null())]))])),
                        ),
                ),
        );

    /// The `root_volume`: a container image, never virtiofs.
    RootVolume [NotBlank] = volume_with_source(
        ObjectBuilder::new()
            .property("container_source", reference::<NotBlank>())
            .property("virtiofs_source", null())
            .required("container_source"),
    );

    /// An entry of `additional_volumes`: exactly one of `container_source` and
    /// `virtiofs_source`.
    AdditionalVolume [NotBlank] = volume_with_source(
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .property("container_source", reference::<NotBlank>())
                    .property("virtiofs_source", null())
                    .required("container_source"),
            )
            .item(
                ObjectBuilder::new()
                    .property("virtiofs_source", reference::<NotBlank>())
                    .property("container_source", null())
                    .required("virtiofs_source"),
            ),
    );
}

/// [`Volume`]'s own schema with its `source` replaced by `source` and required: one object, not
/// an `allOf` of `Volume` and a narrower `source`, which client generators cannot merge (they
/// dropped every operation whose body held an additional volume). Accepts exactly what that
/// `allOf` accepted: `Volume` is closed, and its other properties are unchanged.
fn volume_with_source(source: impl Into<RefOr<Schema>>) -> Schema {
    let RefOr::T(Schema::Object(mut volume)) = <Volume as PartialSchema>::schema() else {
        unreachable!("Volume derives an object schema")
    };
    volume.properties.insert("source".into(), source.into());
    if !volume.required.iter().any(|r| r == "source") {
        volume.required.push("source".into());
    }
    Schema::Object(volume)
}

impl MicroVmTemplate {
    fn provider(&self) -> &str {
        self.provider.as_deref().unwrap_or(DEFAULT_PROVIDER)
    }

    pub fn has_static_network(&self) -> bool {
        self.interfaces.iter().any(|i| i.guest_mac.as_deref().is_some_and(|m| !m.is_empty()) || i.address.is_some())
    }

    /// The rules flintlock applies at CreateMicroVM, with the field named in the message.
    pub fn validate(&self) -> Result<(), String> {
        let vcpu = self.vcpu.unwrap_or(DEFAULT_VCPU);
        if !(VCPU.0..=VCPU.1).contains(&vcpu) {
            return Err(format!("microvm_template.vcpu must be between {} and {}, got {vcpu}", VCPU.0, VCPU.1));
        }
        let mem = self.memory_in_mb.unwrap_or(DEFAULT_MEMORY_IN_MB);
        if !(MEMORY_IN_MB.0..=MEMORY_IN_MB.1).contains(&mem) {
            return Err(format!(
                "microvm_template.memory_in_mb must be between {} and {}, got {mem}",
                MEMORY_IN_MB.0, MEMORY_IN_MB.1
            ));
        }
        let provider = self.provider();
        if !PROVIDERS.contains(&provider) {
            return Err(format!("microvm_template.provider {provider:?} is unknown: use {}", PROVIDERS.join(" or ")));
        }
        if let Some(k) = &self.kernel {
            if !NOT_BLANK.is_match(&k.image) {
                return Err("microvm_template.kernel.image is required".into());
            }
            if k.filename.as_deref().unwrap_or("").is_empty() {
                return Err("microvm_template.kernel.filename is required (e.g. \"boot/vmlinux\")".into());
            }
        }
        if let Some(i) = &self.initrd
            && !NOT_BLANK.is_match(&i.image)
        {
            return Err("microvm_template.initrd.image is required when initrd is set".into());
        }
        match &self.root_volume {
            None if self.initrd.is_none() => {
                return Err("microvm_template needs a root_volume or an initrd".into());
            }
            Some(v) if v.source.virtiofs_source.is_some() => {
                return Err("microvm_template.root_volume cannot use virtiofs_source".into());
            }
            _ => {}
        }
        if let Some(v) = &self.root_volume
            && v.source.container_source.as_deref().is_none_or(|s| !NOT_BLANK.is_match(s))
        {
            return Err("microvm_template.root_volume has no source: set source.container_source".into());
        }
        let mut ids = std::collections::HashSet::new();
        for (what, v) in self
            .root_volume
            .iter()
            .map(|v| ("root_volume".to_string(), v))
            .chain(self.additional_volumes.iter().enumerate().map(|(i, v)| (format!("additional_volumes[{i}]"), v)))
        {
            if !ids.insert(v.id.as_str()) {
                return Err(format!(
                    "microvm_template.{what}.id {:?} is used by another volume: volume ids must be unique",
                    v.id
                ));
            }
        }
        let mut virtiofs = 0;
        for (i, v) in self.additional_volumes.iter().enumerate() {
            let set = |s: &Option<String>| s.as_deref().is_some_and(|s| NOT_BLANK.is_match(s));
            if !set(&v.source.container_source) && !set(&v.source.virtiofs_source) {
                return Err(format!(
                    "microvm_template.additional_volumes[{i}] has no source: set source.container_source or source.virtiofs_source"
                ));
            }
            if v.source.container_source.is_some() && v.source.virtiofs_source.is_some() {
                return Err(format!(
                    "microvm_template.additional_volumes[{i}] sets both container_source and virtiofs_source"
                ));
            }
            if v.source.virtiofs_source.is_some() {
                virtiofs += 1;
            }
        }
        if virtiofs > 1 {
            return Err("microvm_template.additional_volumes may use virtiofs at most once".into());
        }
        if virtiofs > 0 && provider == DEFAULT_PROVIDER {
            return Err("microvm_template: virtiofs volumes need provider cloudhypervisor".into());
        }
        if self.interfaces.is_empty() {
            return Err("microvm_template.interfaces needs at least one interface".into());
        }
        let mut ids = std::collections::HashSet::new();
        for (i, nic) in self.interfaces.iter().enumerate() {
            let at = format!("microvm_template.interfaces[{i}]");
            if !DEVICE_ID.is_match(&nic.device_id) {
                return Err(format!("{at}.device_id {:?} must match {}", nic.device_id, DEVICE_ID.as_str()));
            }
            if !ids.insert(&nic.device_id) {
                return Err(format!("{at}.device_id {:?} is used twice", nic.device_id));
            }
            if nic.kind == IfaceType::Macvtap && provider == DEFAULT_PROVIDER {
                return Err(format!("{at}.type MACVTAP is not supported by firecracker: use TAP"));
            }
            if let Some(mac) = nic.guest_mac.as_deref()
                && !GUEST_MAC.is_match(mac)
            {
                return Err(format!("{at}.guest_mac {mac:?} is not a MAC address"));
            }
            if let Some(a) = &nic.address {
                if !CIDR.is_match(&a.address) {
                    return Err(format!("{at}.address.address {:?} must be in CIDR form", a.address));
                }
                if let Some(g) = &a.gateway
                    && !CIDR.is_match(g)
                {
                    return Err(format!("{at}.address.gateway {g:?} must be in CIDR form"));
                }
                for ns in &a.nameservers {
                    if !IP_ADDRESS.is_match(ns) {
                        return Err(format!("{at}.address.nameservers entry {ns:?} is not an IP address"));
                    }
                }
            }
            // flintlock dereferences bridge_name without checking: never send overrides without it.
            if let Some(o) = &nic.overrides
                && o.bridge_name.as_deref().unwrap_or("").is_empty()
            {
                return Err(format!("{at}.overrides needs bridge_name"));
            }
        }
        Ok(())
    }

    /// The CreateMicroVM spec for one VM: our id, the managed namespace, guest agent on.
    pub fn to_spec(&self, id: &str, namespace: &str) -> pb::MicroVmSpec {
        fn volume(v: &Volume) -> pb::Volume {
            pb::Volume {
                id: v.id.clone(),
                is_read_only: v.is_read_only,
                mount_point: v.mount_point.clone(),
                source: Some(pb::VolumeSource {
                    container_source: v.source.container_source.clone(),
                    virtiofs_source: v.source.virtiofs_source.clone(),
                }),
                partition_id: v.partition_id.clone(),
                size_in_mb: v.size_in_mb,
            }
        }
        pb::MicroVmSpec {
            id: id.to_owned(),
            namespace: namespace.to_owned(),
            labels: Default::default(),
            vcpu: self.vcpu.unwrap_or(DEFAULT_VCPU),
            memory_in_mb: self.memory_in_mb.unwrap_or(DEFAULT_MEMORY_IN_MB),
            kernel: self.kernel.as_ref().map(|k| pb::Kernel {
                image: k.image.clone(),
                cmdline: k.cmdline.clone().into_iter().collect(),
                filename: k.filename.clone(),
                add_network_config: k.add_network_config,
            }),
            initrd: self.initrd.as_ref().map(|i| pb::Initrd { image: i.image.clone(), filename: i.filename.clone() }),
            root_volume: self.root_volume.as_ref().map(volume),
            additional_volumes: self.additional_volumes.iter().map(volume).collect(),
            interfaces: self
                .interfaces
                .iter()
                .map(|n| pb::NetworkInterface {
                    device_id: n.device_id.clone(),
                    r#type: match n.kind {
                        IfaceType::Macvtap => pb::network_interface::IfaceType::Macvtap as i32,
                        IfaceType::Tap => pb::network_interface::IfaceType::Tap as i32,
                    },
                    guest_mac: n.guest_mac.clone(),
                    address: n.address.as_ref().map(|a| pb::StaticAddress {
                        address: a.address.clone(),
                        gateway: a.gateway.clone(),
                        nameservers: a.nameservers.clone(),
                    }),
                    overrides: n
                        .overrides
                        .as_ref()
                        .map(|o| pb::NetworkOverrides { bridge_name: o.bridge_name.clone() }),
                })
                .collect(),
            metadata: self.metadata.clone().into_iter().collect(),
            created_at: None,
            updated_at: None,
            deleted_at: None,
            uid: None,
            provider: self.provider.clone(),
            allow_guest_agent: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_template() -> MicroVmTemplate {
        serde_json::from_value(serde_json::json!({
            "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/x/root:1"}},
            "kernel": {"image": "ghcr.io/x/kernel:1", "filename": "boot/vmlinux"},
            "interfaces": [{"device_id": "eth1", "type": "TAP"}]
        }))
        .unwrap()
    }

    /// Issue 14 item 16: a volume with no source (`{}`, or `[null, null]`, which serde's derive
    /// reads as an empty struct) and a volume id used twice are refused.
    #[test]
    fn volumes_need_a_source_and_unique_ids() {
        let extra = |v: serde_json::Value| {
            let mut t = serde_json::to_value(ok_template()).unwrap();
            t["additional_volumes"] = serde_json::json!([v]);
            serde_json::from_value::<MicroVmTemplate>(t).unwrap().validate()
        };
        for source in
            [serde_json::json!([null, null]), serde_json::json!({}), serde_json::json!({"container_source": " "})]
        {
            let e = extra(serde_json::json!({"id": "data", "source": source})).unwrap_err();
            assert!(e.contains("additional_volumes[0] has no source"), "{e}");
        }
        let e = extra(serde_json::json!({"id": "root", "source": {"container_source": "img"}})).unwrap_err();
        assert!(e.contains("additional_volumes[0].id \"root\" is used by another volume"), "{e}");
        extra(serde_json::json!({"id": "data", "source": {"container_source": "img"}})).unwrap();

        let mut t = ok_template();
        t.root_volume.as_mut().unwrap().source = VolumeSource::default();
        assert!(t.validate().unwrap_err().contains("root_volume has no source"));
    }

    #[test]
    fn valid_template_passes_and_forces_guest_agent() {
        let t = ok_template();
        t.validate().unwrap();
        let spec = t.to_spec("ci-1", "poolmgr-default");
        assert!(spec.allow_guest_agent);
        assert_eq!(spec.id, "ci-1");
        assert_eq!(spec.vcpu, 2);
    }

    #[test]
    fn template_rules() {
        let mut t = ok_template();
        t.interfaces.clear();
        assert!(t.validate().unwrap_err().contains("interfaces"));
        let mut t = ok_template();
        t.vcpu = Some(65);
        assert!(t.validate().unwrap_err().contains("vcpu"));
        let mut t = ok_template();
        t.interfaces[0].kind = IfaceType::Macvtap;
        assert!(t.validate().unwrap_err().contains("MACVTAP"));
        let mut t = ok_template();
        t.root_volume = None;
        assert!(t.validate().unwrap_err().contains("root_volume"));
        let mut t = ok_template();
        t.interfaces[0].overrides = Some(NetworkOverrides { bridge_name: None });
        assert!(t.validate().unwrap_err().contains("bridge_name"));
    }

    #[test]
    fn unknown_template_field_is_named() {
        let err = serde_json::from_value::<MicroVmTemplate>(serde_json::json!({"vcpus": 2})).unwrap_err().to_string();
        assert!(err.contains("vcpus"), "{err}");
    }
}
