//! End-to-end tests of the fake flintlock server over real gRPC (port 0).

use std::collections::HashSet;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_proto::types::network_interface::IfaceType;
use flintlock_proto::types::{Kernel, MicroVm, MicroVmSpec, NetworkInterface, NetworkOverrides, Volume, VolumeSource};
use flintlock_proto::v1alpha1::micro_vm_client::MicroVmClient;
use flintlock_proto::v1alpha1::{CreateMicroVmRequest, DeleteMicroVmRequest, GetMicroVmRequest, ListMicroVMsRequest};
use flintlock_sim::{Sim, SimConfig, SimServer};
use tonic::transport::Channel;
use tonic::{Code, Request};

type Client = MicroVmClient<Channel>;

async fn start(config: SimConfig) -> (Sim, SimServer, Client) {
    let sim = Sim::new(config);
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.expect("serve");
    let client = MicroVmClient::connect(format!("http://{}", server.addr)).await.expect("connect");
    (sim, server, client)
}

async fn start_default() -> (Sim, SimServer, Client) {
    start(SimConfig::default()).await
}

fn spec(namespace: &str, id: &str) -> MicroVmSpec {
    MicroVmSpec {
        id: id.to_string(),
        namespace: namespace.to_string(),
        labels: [("team".to_string(), "a".to_string())].into(),
        kernel: Some(Kernel {
            image: "ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77".to_string(),
            filename: Some("boot/vmlinux".to_string()),
            add_network_config: true,
            ..Default::default()
        }),
        root_volume: Some(Volume {
            id: "root".to_string(),
            source: Some(VolumeSource {
                container_source: Some("ghcr.io/liquidmetal-dev/capmvm-k8s-os:1.23.5".into()),
                virtiofs_source: None,
            }),
            mount_point: Some("/".to_string()),
            ..Default::default()
        }),
        interfaces: vec![NetworkInterface {
            device_id: "eth1".to_string(),
            r#type: IfaceType::Tap as i32,
            overrides: Some(NetworkOverrides { bridge_name: Some("br0".to_string()) }),
            ..Default::default()
        }],
        uid: Some("CLIENT-UID-IGNORED".to_string()),
        provider: Some("firecracker".to_string()),
        ..Default::default()
    }
}

fn create_req(spec: MicroVmSpec) -> CreateMicroVmRequest {
    CreateMicroVmRequest { microvm: Some(spec), metadata: Default::default() }
}

async fn create(client: &mut Client, namespace: &str, id: &str) -> MicroVm {
    client
        .create_micro_vm(create_req(spec(namespace, id)))
        .await
        .expect("create")
        .into_inner()
        .microvm
        .expect("microvm")
}

fn uid(vm: &MicroVm) -> String {
    vm.spec.as_ref().unwrap().uid.clone().unwrap()
}

fn state(vm: &MicroVm) -> MicroVmState {
    MicroVmState::try_from(vm.status.as_ref().unwrap().state).unwrap()
}

async fn get(client: &mut Client, uid: &str) -> Result<MicroVm, tonic::Status> {
    client.get_micro_vm(GetMicroVmRequest { uid: uid.to_string() }).await.map(|r| r.into_inner().microvm.unwrap())
}

async fn list(client: &mut Client, namespace: &str, name: Option<&str>) -> Vec<MicroVm> {
    client
        .list_micro_v_ms(ListMicroVMsRequest { namespace: namespace.to_string(), name: name.map(str::to_string) })
        .await
        .expect("list")
        .into_inner()
        .microvm
}

async fn delete(client: &mut Client, uid: &str) -> Result<(), tonic::Status> {
    client.delete_micro_vm(DeleteMicroVmRequest { uid: uid.to_string() }).await.map(|_| ())
}

/// Polls Get until `pred` holds (or panics after 5 s).
async fn wait_for(client: &mut Client, uid: &str, pred: impl Fn(&Result<MicroVm, tonic::Status>) -> bool) {
    for _ in 0..250 {
        if pred(&get(client, uid).await) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("condition not reached for {uid}");
}

fn is_ulid(s: &str) -> bool {
    s.len() == 26
        && s.chars().all(|c| c.is_ascii_digit() || c.is_ascii_uppercase())
        && ulid::Ulid::from_string(s).is_ok()
}

#[tokio::test]
async fn create_pending_then_created() {
    let (sim, _server, mut client) = start_default().await;
    let vm = create(&mut client, "ns1", "vm1").await;
    let u = uid(&vm);
    assert!(is_ulid(&u), "uid {u} is not a ULID");
    assert_ne!(u, "CLIENT-UID-IGNORED");
    assert_eq!(vm.version, 1);
    assert_eq!(state(&vm), MicroVmState::Pending);
    let status = vm.status.as_ref().unwrap();
    assert_eq!(status.retry, 0);
    assert!(status.network_interfaces.is_empty());
    assert!(status.volumes.is_empty());

    let spec = vm.spec.as_ref().unwrap();
    assert_eq!(spec.namespace, "ns1");
    assert_eq!(spec.id, "vm1");
    assert_eq!(spec.vcpu, 2);
    assert_eq!(spec.memory_in_mb, 1024);
    assert!(spec.labels.is_empty(), "labels must be dropped");
    assert!(spec.provider.is_none());
    assert!(spec.created_at.is_none());
    // Injected eth0 first, client's eth1 second, overrides not echoed.
    assert_eq!(spec.interfaces.len(), 2);
    let eth0 = &spec.interfaces[0];
    assert_eq!(eth0.device_id, "eth0");
    assert_eq!(eth0.r#type, IfaceType::Tap as i32);
    assert_eq!(eth0.guest_mac.as_deref(), Some("AA:FF:00:00:00:01"));
    assert_eq!(eth0.address.as_ref().unwrap().address, "169.254.0.1/16");
    assert_eq!(spec.interfaces[1].device_id, "eth1");
    assert_eq!(spec.interfaces[1].guest_mac.as_deref(), Some(""));
    assert!(spec.interfaces[1].overrides.is_none());
    let root = spec.root_volume.as_ref().unwrap();
    assert!(root.mount_point.is_none());
    assert_eq!(root.partition_id.as_deref(), Some(""));
    assert_eq!(root.size_in_mb, Some(0));
    // meta-data injected with the uid.
    let md = BASE64.decode(&spec.metadata["meta-data"]).unwrap();
    assert_eq!(String::from_utf8(md).unwrap(), format!("instance_id: {u}\n"));

    // Same record via Get while pending.
    let got = get(&mut client, &u).await.unwrap();
    assert_eq!(got, vm);

    wait_for(&mut client, &u, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Created)).await;
    let vm = get(&mut client, &u).await.unwrap();
    assert_eq!(vm.version, 2);
    let status = vm.status.as_ref().unwrap();
    assert_eq!(status.retry, 0);
    assert_eq!(status.vsock_path, "");
    let mut keys: Vec<_> = status.network_interfaces.keys().cloned().collect();
    keys.sort();
    assert_eq!(keys, ["eth0", "eth1"]);
    for ni in status.network_interfaces.values() {
        assert!(ni.host_device_name.starts_with("fltap"));
        assert_eq!(ni.host_device_name.len(), "fltap".len() + 7);
        assert!(ni.index > 0);
        assert_eq!(ni.mac_address.len(), 17);
    }
    assert!(status.volumes.contains_key("root"));
    assert!(status.kernel_mount.is_some());
    assert_eq!(sim.vm(&u).unwrap(), vm);
    assert_eq!(sim.calls("CreateMicroVM"), 1);
}

#[tokio::test]
async fn guest_agent_gets_vsock_path_and_defaults_apply() {
    let (_sim, _server, mut client) = start_default().await;
    let mut s = spec("", "agent");
    s.allow_guest_agent = true;
    s.provider = None;
    s.interfaces[0].device_id = "eth0".to_string();
    let vm = client.create_micro_vm(create_req(s)).await.unwrap().into_inner().microvm.unwrap();
    let spec = vm.spec.as_ref().unwrap();
    assert_eq!(spec.namespace, "default");
    assert!(spec.allow_guest_agent);
    // Client already has eth0: nothing injected.
    assert_eq!(spec.interfaces.len(), 1);
    let u = uid(&vm);
    wait_for(&mut client, &u, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Created)).await;
    let vm = get(&mut client, &u).await.unwrap();
    assert_eq!(vm.status.unwrap().vsock_path, format!("/var/lib/flintlock/vm/default/agent/{u}/guest-agent.vsock"));
}

#[tokio::test]
async fn duplicate_ids_allowed() {
    let (sim, _server, mut client) = start_default().await;
    let a = create(&mut client, "ns", "same").await;
    let b = create(&mut client, "ns", "same").await;
    assert_ne!(uid(&a), uid(&b));
    assert_eq!(list(&mut client, "ns", Some("same")).await.len(), 2);
    assert_eq!(sim.vms().len(), 2);
}

#[tokio::test]
async fn list_filters_and_shuffles() {
    let (sim, _server, mut client) =
        start(SimConfig { boot_delay: Duration::from_secs(3600), ..Default::default() }).await;
    for i in 0..20 {
        create(&mut client, "pool", &format!("vm{i}")).await;
    }
    let foreign = sim.insert_vm("other", "vm0", MicroVmState::Created);
    let deleting = sim.insert_vm("other", "gone-soon", MicroVmState::Deleting);

    assert_eq!(list(&mut client, "", None).await.len(), 22);
    assert_eq!(list(&mut client, "pool", None).await.len(), 20);
    assert_eq!(list(&mut client, "pool", Some("")).await.len(), 20);
    assert_eq!(list(&mut client, "other", None).await.len(), 2);
    assert_eq!(list(&mut client, "nope", None).await.len(), 0);
    assert_eq!(list(&mut client, "", Some("vm0")).await.len(), 2);
    let vm0_other = list(&mut client, "other", Some("vm0")).await;
    assert_eq!(vm0_other.len(), 1);
    assert_eq!(uid(&vm0_other[0]), foreign);
    assert_eq!(state(&vm0_other[0]), MicroVmState::Created);
    // Prefixes don't match: exact filters only.
    assert_eq!(list(&mut client, "poo", None).await.len(), 0);
    assert_eq!(list(&mut client, "pool", Some("vm")).await.len(), 0);
    // Every state is listed.
    let states: HashSet<_> = list(&mut client, "other", None).await.iter().map(state).collect();
    assert!(states.contains(&MicroVmState::Deleting));
    assert_eq!(state(&get(&mut client, &deleting).await.unwrap()), MicroVmState::Deleting);

    let mut orders = HashSet::new();
    for _ in 0..10 {
        let order: Vec<String> = list(&mut client, "pool", None).await.iter().map(uid).collect();
        orders.insert(order);
    }
    assert!(orders.len() > 1, "list order never varied");
}

#[tokio::test]
async fn stream_requires_namespace_and_ignores_name() {
    let (sim, _server, mut client) = start_default().await;
    create(&mut client, "s", "a").await;
    create(&mut client, "s", "b").await;
    sim.insert_vm("t", "c", MicroVmState::Pending);

    let err =
        client.list_micro_v_ms_stream(ListMicroVMsRequest { namespace: String::new(), name: None }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "invalid request");

    let mut stream = client
        .list_micro_v_ms_stream(ListMicroVMsRequest { namespace: "s".to_string(), name: Some("a".to_string()) })
        .await
        .unwrap()
        .into_inner();
    let mut ids = Vec::new();
    while let Some(msg) = stream.message().await.unwrap() {
        ids.push(msg.microvm.unwrap().spec.unwrap().id);
    }
    ids.sort();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(sim.calls("ListMicroVMsStream"), 2);
}

#[tokio::test]
async fn delete_lifecycle() {
    let (sim, _server, mut client) =
        start(SimConfig { delete_delay: Duration::from_millis(300), ..Default::default() }).await;
    let vm = create(&mut client, "ns", "del").await;
    let u = uid(&vm);
    wait_for(&mut client, &u, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Created)).await;

    delete(&mut client, &u).await.unwrap();
    let vm = get(&mut client, &u).await.unwrap();
    assert_eq!(state(&vm), MicroVmState::Deleting);
    assert_eq!(vm.version, 3);
    assert_eq!(vm.status.as_ref().unwrap().retry, 0);
    // Repeat delete while the record exists is OK.
    delete(&mut client, &u).await.unwrap();
    assert_eq!(get(&mut client, &u).await.unwrap().version, 4);

    wait_for(&mut client, &u, |r| r.is_err()).await;
    let err = get(&mut client, &u).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert!(err.message().contains("not found"));
    assert!(sim.vm(&u).is_none());
    assert!(list(&mut client, "ns", None).await.is_empty());

    let err = delete(&mut client, &u).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(
        err.message(),
        format!("deleting microvm: checking to see if spec exists: microvm spec //{u} not found")
    );

    let err = delete(&mut client, "").await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "invalid request");
    assert_eq!(sim.calls("DeleteMicroVM"), 4);
}

#[tokio::test]
async fn delete_while_pending_never_boots() {
    let (sim, _server, mut client) = start(SimConfig {
        boot_delay: Duration::from_millis(200),
        delete_delay: Duration::from_secs(3600),
        ..Default::default()
    })
    .await;
    let u = uid(&create(&mut client, "ns", "p").await);
    delete(&mut client, &u).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(state(&sim.vm(&u).unwrap()), MicroVmState::Deleting);
}

#[tokio::test]
async fn get_errors() {
    let (_sim, _server, mut client) = start_default().await;
    let missing = "01HZZZZZZZZZZZZZZZZZZZZZZZ";
    let err = get(&mut client, missing).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(
        err.message(),
        format!(
            "getting microvm: error attempting to locate microvm with uid: {missing}: microvm spec //{missing} not found"
        )
    );
    let err = get(&mut client, "").await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
}

async fn create_err(client: &mut Client, spec: Option<MicroVmSpec>) -> tonic::Status {
    client.create_micro_vm(CreateMicroVmRequest { microvm: spec, metadata: Default::default() }).await.unwrap_err()
}

#[tokio::test]
async fn create_validation_errors() {
    let (sim, _server, mut client) = start_default().await;
    const PREFIX: &str =
        "creating microvm: an error occurred when attempting to validate microvm spec: validation failures found: ";

    let err = create_err(&mut client, None).await;
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "invalid create microvm request: MicroVMSpec required");

    let err = create_err(&mut client, Some(spec("ns", ""))).await;
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(err.message(), "converting request: creating vmid from spec: name is required");

    let mut s = spec("ns", "x");
    s.interfaces.clear();
    let err = create_err(&mut client, Some(s)).await;
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(
        err.message(),
        format!(
            "{PREFIX}Key: 'MicroVM.Spec.NetworkInterfaces' Error:Field validation for 'NetworkInterfaces' failed on the 'required' tag"
        )
    );

    let mut s = spec("ns", "x");
    s.vcpu = 65;
    let err = create_err(&mut client, Some(s)).await;
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(
        err.message(),
        format!("{PREFIX}Key: 'MicroVM.Spec.VCPU' Error:Field validation for 'VCPU' failed on the 'lte' tag")
    );

    // Multiple failures are newline-joined.
    let mut s = spec("ns", "x");
    s.memory_in_mb = 512;
    s.interfaces[0].device_id = "Eth1".to_string();
    s.kernel.as_mut().unwrap().filename = None;
    s.root_volume = None;
    let err = create_err(&mut client, Some(s)).await;
    let msg = err.message();
    assert!(msg.starts_with(PREFIX), "{msg}");
    assert!(msg.contains("'MicroVM.Spec.MemoryInMb'"), "{msg}");
    assert!(msg.contains("'MicroVM.Spec.NetworkInterfaces[0].GuestDeviceName'"), "{msg}");
    assert!(msg.contains("'MicroVM.Spec.Kernel.Filename'"), "{msg}");
    assert!(msg.contains("'volumeOrInitrdRequired'"), "{msg}");
    assert_eq!(msg.lines().count(), 4, "{msg}");

    let mut s = spec("ns", "x");
    s.interfaces[0].address = Some(flintlock_proto::types::StaticAddress {
        address: "10.0.0.2/24".to_string(),
        gateway: Some("10.0.0.1".to_string()),
        nameservers: vec!["1.1.1.1".to_string()],
    });
    let err = create_err(&mut client, Some(s)).await;
    assert!(err.message().contains("StaticAddress.Gateway"), "{}", err.message());

    let mut s = spec("ns", "x");
    s.interfaces[0].r#type = IfaceType::Macvtap as i32;
    let err = create_err(&mut client, Some(s)).await;
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(err.message(), "creating microvm: macvtap network interfaces not supported by the microvm provider");

    // Unset type = MACVTAP, also rejected.
    let mut s = spec("ns", "x");
    s.interfaces[0] = NetworkInterface { device_id: "eth1".to_string(), ..Default::default() };
    let err = create_err(&mut client, Some(s)).await;
    assert!(err.message().contains("macvtap"));

    let mut s = spec("ns", "x");
    s.provider = Some("qemu".to_string());
    let err = create_err(&mut client, Some(s)).await;
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(err.message(), "creating microvm: microvm provider qemu isn't available");

    // cloudhypervisor accepts MACVTAP and injects no eth0.
    let mut s = spec("ns", "ch");
    s.provider = Some("cloudhypervisor".to_string());
    s.interfaces[0].r#type = IfaceType::Macvtap as i32;
    let vm = client.create_micro_vm(create_req(s)).await.unwrap().into_inner().microvm.unwrap();
    assert_eq!(vm.spec.as_ref().unwrap().interfaces.len(), 1);

    assert_eq!(sim.vms().len(), 1, "failed creates must store nothing");
}

#[tokio::test]
async fn fault_fail_creates() {
    let (sim, _server, mut client) = start_default().await;
    sim.fail_creates(2);
    for _ in 0..2 {
        let err = create_err(&mut client, Some(spec("ns", "f"))).await;
        assert_eq!(err.code(), Code::Unknown);
        assert_eq!(err.message(), "creating microvm: saving microvm spec: injected failure");
    }
    assert!(sim.vms().is_empty());
    create(&mut client, "ns", "f").await;
    assert_eq!(sim.vms().len(), 1);
    assert_eq!(sim.calls("CreateMicroVM"), 3);
}

#[tokio::test]
async fn fault_lose_create_replies() {
    let (sim, _server, mut client) = start_default().await;
    sim.lose_create_replies(1);
    let err = create_err(&mut client, Some(spec("ns", "lost"))).await;
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(err.message(), "injected: reply lost");
    // The VM exists anyway and boots.
    let found = list(&mut client, "ns", Some("lost")).await;
    assert_eq!(found.len(), 1);
    let u = uid(&found[0]);
    wait_for(&mut client, &u, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Created)).await;
    // Only one reply was lost.
    create(&mut client, "ns", "lost").await;
    assert_eq!(sim.vms().len(), 2);
}

#[tokio::test]
async fn fault_fail_deletes() {
    let (sim, _server, mut client) = start_default().await;
    let u = uid(&create(&mut client, "ns", "d").await);
    sim.fail_deletes(u32::MAX);
    for _ in 0..3 {
        let err = delete(&mut client, &u).await.unwrap_err();
        assert_eq!(err.code(), Code::Unknown);
        assert_eq!(err.message(), "deleting microvm: injected failure");
    }
    assert_ne!(state(&sim.vm(&u).unwrap()), MicroVmState::Deleting);
    sim.reset_faults();
    delete(&mut client, &u).await.unwrap();

    let u2 = uid(&create(&mut client, "ns", "d2").await);
    sim.fail_deletes(1);
    assert!(delete(&mut client, &u2).await.is_err());
    delete(&mut client, &u2).await.unwrap();
}

#[tokio::test]
async fn fault_vms_end_failed() {
    let (sim, _server, mut client) = start_default().await;
    sim.set_vms_end_failed(true);
    let bad = uid(&create(&mut client, "ns", "bad").await);
    sim.set_vms_end_failed(false);
    let good = uid(&create(&mut client, "ns", "good").await);
    wait_for(&mut client, &bad, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Failed)).await;
    wait_for(&mut client, &good, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Created)).await;
    let vm = sim.vm(&bad).unwrap();
    assert_eq!(vm.status.unwrap().retry, flintlock_sim::FAILED_RETRY);
    // FAILED VMs can be deleted.
    delete(&mut client, &bad).await.unwrap();
    wait_for(&mut client, &bad, |r| r.is_err()).await;
}

#[tokio::test]
async fn fault_unavailable() {
    let (sim, _server, mut client) = start_default().await;
    let u = uid(&create(&mut client, "ns", "x").await);
    sim.set_unavailable(true);
    let err = get(&mut client, &u).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(err.message(), "injected: server unavailable");
    let err = create_err(&mut client, Some(spec("ns", "y"))).await;
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(sim.vms().len(), 1);
    let err = client.list_micro_v_ms(ListMicroVMsRequest::default()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    sim.set_unavailable(false);
    get(&mut client, &u).await.unwrap();
    assert_eq!(sim.calls("GetMicroVM"), 2);
    assert_eq!(sim.calls("CreateMicroVM"), 2);
    assert_eq!(sim.calls("ListMicroVMs"), 1);
}

#[tokio::test]
async fn set_delays_take_effect() {
    let (sim, _server, mut client) = start(SimConfig {
        boot_delay: Duration::from_secs(3600),
        delete_delay: Duration::from_secs(3600),
        ..Default::default()
    })
    .await;
    let slow = uid(&create(&mut client, "ns", "slow").await);
    sim.set_boot_delay(Duration::from_millis(10));
    let fast = uid(&create(&mut client, "ns", "fast").await);
    wait_for(&mut client, &fast, |r| r.as_ref().is_ok_and(|vm| state(vm) == MicroVmState::Created)).await;
    assert_eq!(state(&sim.vm(&slow).unwrap()), MicroVmState::Pending);
    sim.set_delete_delay(Duration::from_millis(10));
    delete(&mut client, &fast).await.unwrap();
    wait_for(&mut client, &fast, |r| r.is_err()).await;
}

#[tokio::test]
async fn basic_auth() {
    let (sim, _server, mut client) =
        start(SimConfig { basic_auth_token: Some("s3cret".to_string()), ..Default::default() }).await;

    let list_with = |value: Option<&str>| {
        let mut req = Request::new(ListMicroVMsRequest::default());
        if let Some(v) = value {
            req.metadata_mut().insert("authorization", v.parse().unwrap());
        }
        req
    };

    let err = client.list_micro_v_ms(list_with(None)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert_eq!(
        err.message(),
        "could not extract token from request header: rpc error: code = Unauthenticated desc = Request unauthenticated with basic"
    );

    let err = client.list_micro_v_ms(list_with(Some("Basic"))).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(err.message().ends_with("desc = Bad authorization string"));

    let wrong = format!("Basic {}", BASE64.encode("nope"));
    let err = client.list_micro_v_ms(list_with(Some(&wrong))).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert_eq!(err.message(), "invalid auth token: failed basic authentication. Check the token supplied");

    let right = format!("Basic {}", BASE64.encode("s3cret"));
    client.list_micro_v_ms(list_with(Some(&right))).await.unwrap();
    let right_lower = format!("basic {}", BASE64.encode("s3cret"));
    client.list_micro_v_ms(list_with(Some(&right_lower))).await.unwrap();

    // Streaming calls are checked too.
    let err = client
        .list_micro_v_ms_stream(ListMicroVMsRequest { namespace: "ns".to_string(), name: None })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    // Creates without a token store nothing.
    let err = create_err(&mut client, Some(spec("ns", "x"))).await;
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(sim.vms().is_empty());
    assert_eq!(sim.calls("ListMicroVMs"), 5);
}

#[tokio::test]
async fn shutdown_stops_serving() {
    let (_sim, server, mut client) = start_default().await;
    let addr = server.addr;
    create(&mut client, "ns", "x").await;
    server.shutdown().await;
    assert!(MicroVmClient::connect(format!("http://{addr}")).await.is_err());
}
