//! CreateMicroVM processing: the §2.2 pipeline of flintlock-api.md (cleaning,
//! conversion defaults, struct validation, provider checks, meta-data and the
//! firecracker `eth0` injection) and the §2.3 normalisation of what is echoed.

use std::collections::HashMap;
use std::net::IpAddr;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_proto::types::network_interface::IfaceType;
use flintlock_proto::types::{
    Initrd, Kernel, MicroVm, MicroVmSpec, MicroVmStatus, NetworkInterface, StaticAddress, Volume, VolumeSource,
};
use tonic::Status;

pub(crate) const PROVIDER_FIRECRACKER: &str = "firecracker";
pub(crate) const PROVIDER_CLOUDHYPERVISOR: &str = "cloudhypervisor";

const METADATA_KEY: &str = "meta-data";
const VALIDATION_PREFIX: &str =
    "creating microvm: an error occurred when attempting to validate microvm spec: validation failures found: ";

/// Runs the CreateMicroVM pipeline on the request's spec and returns the record
/// to store (version 1, PENDING, retry 0, empty status maps). `new_uid` is
/// called exactly once, after validation, like flintlock does.
pub(crate) fn build_microvm(spec: Option<MicroVmSpec>, new_uid: impl FnOnce() -> String) -> Result<MicroVm, Status> {
    // 1. spec present.
    let mut spec =
        spec.ok_or_else(|| Status::invalid_argument("invalid create microvm request: MicroVMSpec required"))?;

    // 2. Clean image references.
    if let Some(kernel) = spec.kernel.as_mut() {
        kernel.image = clean_image(&kernel.image);
    }
    if let Some(initrd) = spec.initrd.as_mut() {
        initrd.image = clean_image(&initrd.image);
    }
    for vol in spec.root_volume.iter_mut().chain(spec.additional_volumes.iter_mut()) {
        if let Some(src) = vol.source.as_mut()
            && let Some(image) = src.container_source.as_mut()
        {
            *image = clean_image(image);
        }
    }

    // 3. Proto -> model conversion with defaults.
    if spec.id.is_empty() {
        return Err(Status::unknown("converting request: creating vmid from spec: name is required"));
    }
    if spec.namespace.is_empty() {
        spec.namespace = "default".to_string();
    }
    if spec.vcpu == 0 {
        spec.vcpu = 2;
    }
    if spec.memory_in_mb == 0 {
        spec.memory_in_mb = 1024;
    }
    let kernel = spec.kernel.take().unwrap_or_default();

    // 4. Struct validation; every failure is reported.
    let failures = validate(&spec, &kernel);
    if !failures.is_empty() {
        return Err(Status::unknown(format!("{VALIDATION_PREFIX}{}", failures.join("\n"))));
    }

    // 5. Provider.
    let provider = spec.provider.as_deref().filter(|p| !p.is_empty()).unwrap_or(PROVIDER_FIRECRACKER).to_string();
    if provider != PROVIDER_FIRECRACKER && provider != PROVIDER_CLOUDHYPERVISOR {
        return Err(Status::unknown(format!("creating microvm: microvm provider {provider} isn't available")));
    }

    // 6. uid.
    let uid = new_uid();

    // 8. Provider capabilities.
    if provider == PROVIDER_FIRECRACKER {
        if spec.interfaces.iter().any(|i| i.r#type == IfaceType::Macvtap as i32) {
            return Err(Status::unknown(
                "creating microvm: macvtap network interfaces not supported by the microvm provider",
            ));
        }
        if spec.root_volume.iter().chain(spec.additional_volumes.iter()).any(is_virtiofs) {
            return Err(Status::unknown("creating microvm: virtiofs not supported by the microvm provider"));
        }
    }

    // 9. meta-data.
    let mut metadata = std::mem::take(&mut spec.metadata);
    add_instance_data(&mut metadata, &uid)?;

    // 10. Firecracker metadata NIC.
    let mut interfaces: Vec<NetworkInterface> =
        std::mem::take(&mut spec.interfaces).into_iter().map(normalise_interface).collect();
    if provider == PROVIDER_FIRECRACKER && !interfaces.iter().any(|i| i.device_id == "eth0") {
        interfaces.insert(0, metadata_interface());
    }

    // 11. Stored record.
    let root_volume = spec.root_volume.take().filter(|v| !volume_is_empty(v)).map(normalise_volume);
    Ok(MicroVm {
        version: 1,
        spec: Some(MicroVmSpec {
            id: spec.id,
            namespace: spec.namespace,
            labels: HashMap::new(),
            vcpu: spec.vcpu,
            memory_in_mb: spec.memory_in_mb,
            kernel: Some(Kernel {
                image: kernel.image,
                cmdline: kernel.cmdline,
                filename: Some(kernel.filename.unwrap_or_default()),
                add_network_config: kernel.add_network_config,
            }),
            initrd: spec.initrd.map(|i| Initrd { image: i.image, filename: Some(i.filename.unwrap_or_default()) }),
            root_volume,
            additional_volumes: spec.additional_volumes.into_iter().map(normalise_volume).collect(),
            interfaces,
            metadata,
            created_at: None,
            updated_at: None,
            deleted_at: None,
            uid: Some(uid),
            provider: None,
            allow_guest_agent: spec.allow_guest_agent,
        }),
        status: Some(MicroVmStatus { state: MicroVmState::Pending as i32, ..Default::default() }),
    })
}

/// The interface flintlock's firecracker provider prepends for the metadata service.
fn metadata_interface() -> NetworkInterface {
    NetworkInterface {
        device_id: "eth0".to_string(),
        r#type: IfaceType::Tap as i32,
        guest_mac: Some("AA:FF:00:00:00:01".to_string()),
        address: Some(StaticAddress { address: "169.254.0.1/16".to_string(), gateway: None, nameservers: Vec::new() }),
        overrides: None,
    }
}

/// Strips surrounding whitespace and every control character (flintlock v0.9.0+).
fn clean_image(s: &str) -> String {
    s.trim().chars().filter(|c| !c.is_control()).collect()
}

fn field_error(key: &str, field: &str, tag: &str) -> String {
    format!("Key: '{key}' Error:Field validation for '{field}' failed on the '{tag}' tag")
}

/// go-playground/validator style checks over the converted spec, in the order
/// of the fields of flintlock's `models.MicroVMSpec`, struct-level check last.
fn validate(spec: &MicroVmSpec, kernel: &Kernel) -> Vec<String> {
    let mut errs = Vec::new();

    // Kernel (omitempty: skipped entirely when the kernel is empty).
    let kernel_filename = kernel.filename.as_deref().unwrap_or("");
    let kernel_empty = kernel.image.is_empty()
        && kernel.cmdline.is_empty()
        && kernel_filename.is_empty()
        && !kernel.add_network_config;
    if !kernel_empty {
        if kernel.image.is_empty() {
            errs.push(field_error("MicroVM.Spec.Kernel.Image", "Image", "required"));
        } else if !valid_image_ref(&kernel.image) {
            errs.push(field_error("MicroVM.Spec.Kernel.Image", "Image", "imageURI"));
        }
        if kernel_filename.is_empty() {
            errs.push(field_error("MicroVM.Spec.Kernel.Filename", "Filename", "required"));
        }
    }

    // Initrd.
    if let Some(initrd) = &spec.initrd
        && !valid_image_ref(&initrd.image)
    {
        errs.push(field_error("MicroVM.Spec.Initrd.Image", "Image", "imageURI"));
    }

    // VCPU / memory.
    if spec.vcpu < 1 {
        errs.push(field_error("MicroVM.Spec.VCPU", "VCPU", "gte"));
    } else if spec.vcpu > 64 {
        errs.push(field_error("MicroVM.Spec.VCPU", "VCPU", "lte"));
    }
    if spec.memory_in_mb < 1024 {
        errs.push(field_error("MicroVM.Spec.MemoryInMb", "MemoryInMb", "gte"));
    } else if spec.memory_in_mb > 32768 {
        errs.push(field_error("MicroVM.Spec.MemoryInMb", "MemoryInMb", "lte"));
    }

    // Network interfaces.
    if spec.interfaces.is_empty() {
        errs.push(field_error("MicroVM.Spec.NetworkInterfaces", "NetworkInterfaces", "required"));
    }
    for (i, iface) in spec.interfaces.iter().enumerate() {
        let prefix = format!("MicroVM.Spec.NetworkInterfaces[{i}]");
        let name = &iface.device_id;
        if name.is_empty() {
            errs.push(field_error(&format!("{prefix}.GuestDeviceName"), "GuestDeviceName", "required"));
        } else if name.contains(['/', '@']) {
            errs.push(field_error(&format!("{prefix}.GuestDeviceName"), "GuestDeviceName", "excludesall"));
        } else if !valid_device_name(name) {
            errs.push(field_error(&format!("{prefix}.GuestDeviceName"), "GuestDeviceName", "guestDeviceName"));
        }
        if let Some(mac) = iface.guest_mac.as_deref()
            && !mac.is_empty()
            && !valid_mac(mac)
        {
            errs.push(field_error(&format!("{prefix}.GuestMAC"), "GuestMAC", "mac"));
        }
        if IfaceType::try_from(iface.r#type).is_err() {
            errs.push(field_error(&format!("{prefix}.Type"), "Type", "oneof"));
        }
        if let Some(addr) = &iface.address {
            let aprefix = format!("{prefix}.StaticAddress");
            if !valid_cidr(&addr.address) {
                errs.push(field_error(&format!("{aprefix}.Address"), "Address", "cidr"));
            }
            if let Some(gw) = addr.gateway.as_deref()
                && !valid_cidr(gw)
            {
                errs.push(field_error(&format!("{aprefix}.Gateway"), "Gateway", "cidr"));
            }
            for (j, ns) in addr.nameservers.iter().enumerate() {
                if ns.parse::<IpAddr>().is_err() {
                    errs.push(field_error(&format!("{aprefix}.Nameservers[{j}]"), &format!("Nameservers[{j}]"), "ip"));
                }
            }
        }
    }

    // Root volume.
    if spec.root_volume.as_ref().is_some_and(is_virtiofs) {
        errs.push(field_error("MicroVM.Spec.RootVolume", "RootVolume", "novirtiofs"));
    }

    // Additional volumes.
    if spec.additional_volumes.iter().filter(|v| is_virtiofs(v)).count() > 1 {
        errs.push(field_error("MicroVM.Spec.AdditionalVolumes", "AdditionalVolumes", "onlyOneVirtioFS"));
    }
    if spec.additional_volumes.iter().any(|v| {
        v.source.as_ref().is_some_and(|s| {
            s.container_source.as_deref().is_some_and(|c| !c.is_empty())
                && s.virtiofs_source.as_deref().is_some_and(|p| !p.is_empty())
        })
    }) {
        errs.push(field_error("MicroVM.Spec.AdditionalVolumes", "AdditionalVolumes", "multipleVolSources"));
    }

    // Struct level: root volume or initrd.
    if spec.initrd.is_none() && spec.root_volume.as_ref().is_none_or(volume_is_empty) {
        errs.push(field_error("MicroVM.Spec.root_volume", "root_volume", "volumeOrInitrdRequired"));
    }

    errs
}

fn is_virtiofs(v: &Volume) -> bool {
    v.source.as_ref().and_then(|s| s.virtiofs_source.as_deref()).is_some_and(|p| !p.is_empty())
}

fn volume_is_empty(v: &Volume) -> bool {
    let source_empty = v.source.as_ref().is_none_or(|s| {
        s.container_source.as_deref().unwrap_or("").is_empty() && s.virtiofs_source.as_deref().unwrap_or("").is_empty()
    });
    v.id.is_empty()
        && !v.is_read_only
        && source_empty
        && v.partition_id.as_deref().unwrap_or("").is_empty()
        && v.size_in_mb.unwrap_or(0) == 0
        && v.mount_point.as_deref().unwrap_or("").is_empty()
}

/// `^[a-z][a-z0-9_]*$`
pub(crate) fn valid_device_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some('a'..='z')) && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
}

/// Lenient approximation of containerd's `reference.Parse`: non-empty, no
/// scheme, no whitespace.
fn valid_image_ref(s: &str) -> bool {
    !s.is_empty() && !s.contains("://") && !s.chars().any(char::is_whitespace)
}

/// 6-octet MAC with `:` or `-` separators (the common forms of Go's `net.ParseMAC`).
fn valid_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    parts.len() == 6 && parts.iter().all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()))
}

fn valid_cidr(s: &str) -> bool {
    let Some((ip, prefix)) = s.split_once('/') else {
        return false;
    };
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return false;
    };
    let Ok(prefix) = prefix.parse::<u8>() else {
        return false;
    };
    match ip {
        IpAddr::V4(_) => prefix <= 32,
        IpAddr::V6(_) => prefix <= 128,
    }
}

/// Adds `instance_id: <uid>` to the base64 YAML `meta-data` item, creating it
/// when absent. (Simplified: an existing document lacking a top-level
/// `instance_id` gets the line appended rather than being re-marshalled.)
fn add_instance_data(metadata: &mut HashMap<String, String>, uid: &str) -> Result<(), Status> {
    let Some(existing) = metadata.get(METADATA_KEY) else {
        metadata.insert(METADATA_KEY.to_string(), BASE64.encode(format!("instance_id: {uid}\n")));
        return Ok(());
    };
    let raw = BASE64.decode(existing).map_err(|e| {
        Status::unknown(format!("creating microvm: adding instance data: decoding existing instance metadata: {e}"))
    })?;
    let mut text = String::from_utf8(raw).map_err(|_| {
        Status::unknown(
            "creating microvm: adding instance data: unmarshalling exists instance metadata: yaml: invalid leading UTF-8 octet",
        )
    })?;
    if text.lines().any(|l| l.starts_with("instance_id:")) {
        return Ok(());
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!("instance_id: {uid}\n"));
    metadata.insert(METADATA_KEY.to_string(), BASE64.encode(text));
    Ok(())
}

fn normalise_interface(i: NetworkInterface) -> NetworkInterface {
    NetworkInterface {
        device_id: i.device_id,
        r#type: i.r#type,
        guest_mac: Some(i.guest_mac.unwrap_or_default()),
        address: i.address,
        overrides: None,
    }
}

fn normalise_volume(v: Volume) -> Volume {
    let source = v.source.unwrap_or_default();
    Volume {
        id: v.id,
        is_read_only: v.is_read_only,
        mount_point: None,
        source: Some(VolumeSource {
            container_source: source.container_source,
            virtiofs_source: source.virtiofs_source,
        }),
        partition_id: Some(v.partition_id.unwrap_or_default()),
        size_in_mb: Some(v.size_in_mb.unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert!(valid_device_name("eth1"));
        assert!(valid_device_name("a_b9"));
        assert!(!valid_device_name("Eth1"));
        assert!(!valid_device_name("1eth"));
        assert!(!valid_device_name(""));
    }

    #[test]
    fn cidrs_and_macs() {
        assert!(valid_cidr("10.0.0.1/24"));
        assert!(valid_cidr("fd00::1/64"));
        assert!(!valid_cidr("10.0.0.1"));
        assert!(!valid_cidr("10.0.0.1/33"));
        assert!(valid_mac("AA:FF:00:00:00:01"));
        assert!(valid_mac("aa-ff-00-00-00-01"));
        assert!(!valid_mac("AA:FF:00:00:00"));
    }

    #[test]
    fn metadata_injection_and_patching() {
        let mut md = HashMap::new();
        add_instance_data(&mut md, "UID1").unwrap();
        let got = String::from_utf8(BASE64.decode(&md[METADATA_KEY]).unwrap()).unwrap();
        assert_eq!(got, "instance_id: UID1\n");

        let mut md = HashMap::from([(METADATA_KEY.to_string(), BASE64.encode("local_hostname: x"))]);
        add_instance_data(&mut md, "UID2").unwrap();
        let got = String::from_utf8(BASE64.decode(&md[METADATA_KEY]).unwrap()).unwrap();
        assert_eq!(got, "local_hostname: x\ninstance_id: UID2\n");

        let keep = BASE64.encode("instance_id: mine\n");
        let mut md = HashMap::from([(METADATA_KEY.to_string(), keep.clone())]);
        add_instance_data(&mut md, "UID3").unwrap();
        assert_eq!(md[METADATA_KEY], keep);

        let mut md = HashMap::from([(METADATA_KEY.to_string(), "!!!".to_string())]);
        let err = add_instance_data(&mut md, "UID4").unwrap_err();
        assert!(err.message().contains("decoding existing instance metadata"));
    }

    #[test]
    fn image_cleaning() {
        assert_eq!(clean_image("  ghcr.io/a/b:1\t\n"), "ghcr.io/a/b:1");
        assert_eq!(clean_image("ghcr.io/a\u{7}/b"), "ghcr.io/a/b");
    }
}
