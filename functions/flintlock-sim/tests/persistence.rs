//! The simulator's optional state file (`Sim::open`, `flintlock-sim --state-file`): VMs
//! survive a restart like flintlockd's do, including a SIGKILL of the real binary.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_proto::types::network_interface::IfaceType;
use flintlock_proto::types::{Kernel, MicroVm, MicroVmSpec, NetworkInterface, Volume, VolumeSource};
use flintlock_proto::v1alpha1::micro_vm_client::MicroVmClient;
use flintlock_proto::v1alpha1::{CreateMicroVmRequest, DeleteMicroVmRequest, GetMicroVmRequest, ListMicroVMsRequest};
use flintlock_sim::{Sim, SimConfig};
use tonic::transport::Channel;

type Client = MicroVmClient<Channel>;

fn config(boot_ms: u64) -> SimConfig {
    SimConfig {
        boot_delay: Duration::from_millis(boot_ms),
        delete_delay: Duration::from_millis(20),
        basic_auth_token: None,
    }
}

/// A fresh directory for one test's state file.
fn state_path(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flintlock-sim-{test}-{}", ulid::Ulid::generate()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("sim.state")
}

fn spec(namespace: &str, id: &str) -> MicroVmSpec {
    MicroVmSpec {
        id: id.to_string(),
        namespace: namespace.to_string(),
        kernel: Some(Kernel {
            image: "ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77".to_string(),
            filename: Some("boot/vmlinux".to_string()),
            add_network_config: true,
            ..Default::default()
        }),
        root_volume: Some(Volume {
            id: "root".to_string(),
            source: Some(VolumeSource {
                container_source: Some("ghcr.io/liquidmetal-dev/ubuntu:22.04".into()),
                virtiofs_source: None,
            }),
            ..Default::default()
        }),
        interfaces: vec![NetworkInterface {
            device_id: "eth1".to_string(),
            r#type: IfaceType::Tap as i32,
            ..Default::default()
        }],
        ..Default::default()
    }
}

async fn connect(addr: &str) -> Client {
    for _ in 0..100 {
        if let Ok(c) = MicroVmClient::connect(format!("http://{addr}")).await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("cannot connect to flintlock-sim at {addr}");
}

async fn create(client: &mut Client, namespace: &str, id: &str) -> MicroVm {
    let req = CreateMicroVmRequest { microvm: Some(spec(namespace, id)), metadata: Default::default() };
    client.create_micro_vm(req).await.expect("create").into_inner().microvm.expect("microvm")
}

fn uid(vm: &MicroVm) -> String {
    vm.spec.as_ref().unwrap().uid.clone().unwrap()
}

fn state(vm: &MicroVm) -> MicroVmState {
    MicroVmState::try_from(vm.status.as_ref().unwrap().state).unwrap()
}

async fn get(client: &mut Client, uid: &str) -> Option<MicroVm> {
    client.get_micro_vm(GetMicroVmRequest { uid: uid.to_string() }).await.ok().and_then(|r| r.into_inner().microvm)
}

async fn list_all(client: &mut Client) -> Vec<MicroVm> {
    client
        .list_micro_v_ms(ListMicroVMsRequest { namespace: String::new(), name: None })
        .await
        .expect("list")
        .into_inner()
        .microvm
}

/// Polls Get until the VM is in `want` (None = gone); panics after 5 s.
async fn wait_state(client: &mut Client, uid: &str, want: Option<MicroVmState>) {
    for _ in 0..250 {
        if get(client, uid).await.map(|vm| state(&vm)) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{uid} never reached {want:?}");
}

#[tokio::test]
async fn vms_survive_a_restart_with_their_state_and_status() {
    let path = state_path("restart");
    let sim = Sim::open(config(10), &path).expect("open");
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut client = connect(&server.addr.to_string()).await;
    let a = uid(&create(&mut client, "poolmgr-default", "ci-a").await);
    let b = uid(&create(&mut client, "poolmgr-default", "ci-b").await);
    wait_state(&mut client, &a, Some(MicroVmState::Created)).await;
    wait_state(&mut client, &b, Some(MicroVmState::Created)).await;
    let before_a = get(&mut client, &a).await.unwrap();
    server.shutdown().await;
    drop(sim);

    let sim = Sim::open(config(10), &path).expect("reopen");
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut client = connect(&server.addr.to_string()).await;
    let after_a = get(&mut client, &a).await.expect("VM a survived the restart");
    assert_eq!(after_a, before_a, "the record is unchanged: spec, status, interfaces, version");
    assert_eq!(list_all(&mut client).await.len(), 2);

    // New VMs after the restart get device indexes that do not collide with the old ones.
    let c = uid(&create(&mut client, "poolmgr-default", "ci-c").await);
    wait_state(&mut client, &c, Some(MicroVmState::Created)).await;
    let index = |vm: &MicroVm| vm.status.as_ref().unwrap().network_interfaces["eth1"].index;
    let after_b = get(&mut client, &b).await.unwrap();
    let after_c = get(&mut client, &c).await.unwrap();
    assert!(index(&after_c) > index(&after_a).max(index(&after_b)), "ifindex counter persisted");

    // A delete is persisted too: after the removal and a restart the VM stays gone.
    client.delete_micro_vm(DeleteMicroVmRequest { uid: a.clone() }).await.expect("delete");
    wait_state(&mut client, &a, None).await;
    server.shutdown().await;
    drop(sim);
    let sim = Sim::open(config(10), &path).expect("reopen again");
    let mut ids: Vec<String> = sim.vms().iter().map(uid).collect();
    ids.sort();
    let mut want = vec![b, c];
    want.sort();
    assert_eq!(ids, want);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn a_vm_pending_at_the_restart_boots_afterwards_and_a_deleting_one_is_removed() {
    let path = state_path("pending");
    // Boots take an hour: the VM is PENDING when the simulator goes away.
    let sim = Sim::open(config(3_600_000), &path).expect("open");
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut client = connect(&server.addr.to_string()).await;
    let pending = uid(&create(&mut client, "poolmgr-default", "ci-p").await);
    let doomed = sim.insert_vm("poolmgr-default", "ci-d", MicroVmState::Created);
    sim.set_delete_delay(Duration::from_secs(3600));
    client.delete_micro_vm(DeleteMicroVmRequest { uid: doomed.clone() }).await.expect("delete");
    assert_eq!(state(&get(&mut client, &pending).await.unwrap()), MicroVmState::Pending);
    assert_eq!(state(&get(&mut client, &doomed).await.unwrap()), MicroVmState::Deleting);
    server.shutdown().await;
    drop(sim);

    let sim = Sim::open(config(10), &path).expect("reopen");
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut client = connect(&server.addr.to_string()).await;
    wait_state(&mut client, &pending, Some(MicroVmState::Created)).await;
    wait_state(&mut client, &doomed, None).await;
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn a_state_file_that_is_not_one_is_refused_with_advice() {
    let path = state_path("corrupt");
    std::fs::write(&path, b"\xff\xff\xff\xff not protobuf").unwrap();
    let err = Sim::open(config(10), &path).expect_err("garbage is refused");
    assert!(err.to_string().contains("remove it to start empty"), "{err}");
    // A leftover temporary file of an interrupted write is ignored (and overwritten).
    std::fs::remove_file(&path).unwrap();
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    std::fs::write(&tmp, b"half a write").unwrap();
    let sim = Sim::open(config(10), &path).expect("open with a stale .tmp");
    assert!(sim.vms().is_empty());
    assert!(path.exists(), "the state file is written at open");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn without_a_state_file_nothing_is_written() {
    let sim = Sim::new(config(10));
    assert!(sim.state_file().is_none());
    sim.insert_vm("ns", "x", MicroVmState::Created);
}

/// The real binary on a fixed port; returns the child and the address it printed.
fn spawn_binary(path: &Path, listen: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flintlock-sim"))
        .args(["--listen", listen, "--boot-delay-ms", "20", "--state-file"])
        .arg(path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn flintlock-sim");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("read the listening line");
    let addr = line.trim().rsplit(' ').next().expect("address").to_string();
    assert!(line.starts_with("flintlock-sim listening on "), "unexpected first line: {line:?}");
    (child, addr)
}

#[tokio::test]
async fn the_binary_keeps_its_vms_across_sigkill() {
    let path = state_path("sigkill");
    let (mut child, addr) = spawn_binary(&path, "127.0.0.1:0");
    let mut client = connect(&addr).await;
    let mut uids = vec![];
    for i in 0..5 {
        uids.push(uid(&create(&mut client, "poolmgr-default", &format!("ci-{i}")).await));
    }
    wait_state(&mut client, &uids[0], Some(MicroVmState::Created)).await;
    child.kill().expect("SIGKILL");
    child.wait().unwrap();

    // Same port, same file: every VM whose create was answered is back.
    let (mut child, addr2) = spawn_binary(&path, &addr);
    assert_eq!(addr2, addr);
    let mut client = connect(&addr).await;
    let mut listed: Vec<String> = list_all(&mut client).await.iter().map(uid).collect();
    listed.sort();
    uids.sort();
    assert_eq!(listed, uids);
    for u in &uids {
        wait_state(&mut client, u, Some(MicroVmState::Created)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
