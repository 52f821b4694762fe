//! End-to-end tests of the sim's ServerInfo RPC and MicroVMExec service over
//! real gRPC (port 0).

use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use flintlock_proto::exec::exec_command_request::Payload as Req;
use flintlock_proto::exec::exec_command_response::Payload as Resp;
use flintlock_proto::exec::micro_vm_exec_client::MicroVmExecClient;
use flintlock_proto::exec::{ExecCommandRequest, ExecStart};
use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_proto::types::network_interface::IfaceType;
use flintlock_proto::types::{Kernel, MicroVmSpec, NetworkInterface, Volume, VolumeSource};
use flintlock_proto::v1alpha1::micro_vm_client::MicroVmClient;
use flintlock_proto::v1alpha1::{CreateMicroVmRequest, DeleteMicroVmRequest, GetMicroVmRequest};
use flintlock_sim::{ExecCall, ExecRule, Sim, SimConfig, SimServer};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

type VmClient = MicroVmClient<Channel>;
type ExecClient = MicroVmExecClient<Channel>;

struct Env {
    sim: Sim,
    server: SimServer,
    vms: VmClient,
    exec: ExecClient,
}

async fn start(config: SimConfig) -> Env {
    let sim = Sim::new(config);
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.expect("serve");
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.expect("connect");
    Env { sim, server, vms: MicroVmClient::new(channel.clone()), exec: MicroVmExecClient::new(channel) }
}

async fn start_default() -> Env {
    start(SimConfig { boot_delay: Duration::from_millis(20), ..Default::default() }).await
}

fn spec(id: &str, allow_guest_agent: bool) -> MicroVmSpec {
    MicroVmSpec {
        id: id.to_string(),
        namespace: "ns".to_string(),
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
            ..Default::default()
        }),
        interfaces: vec![NetworkInterface {
            device_id: "eth1".to_string(),
            r#type: IfaceType::Tap as i32,
            ..Default::default()
        }],
        allow_guest_agent,
        ..Default::default()
    }
}

/// Creates a VM through gRPC and returns its uid (without waiting for boot).
async fn create(env: &mut Env, id: &str, allow_guest_agent: bool) -> String {
    let vm = env
        .vms
        .create_micro_vm(CreateMicroVmRequest {
            microvm: Some(spec(id, allow_guest_agent)),
            metadata: Default::default(),
        })
        .await
        .expect("create")
        .into_inner()
        .microvm
        .unwrap();
    vm.spec.unwrap().uid.unwrap()
}

async fn wait_created(env: &mut Env, uid: &str) {
    for _ in 0..250 {
        let vm = env.vms.get_micro_vm(GetMicroVmRequest { uid: uid.to_string() }).await.unwrap().into_inner();
        if vm.microvm.unwrap().status.unwrap().state == MicroVmState::Created as i32 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{uid} never CREATED");
}

/// A CREATED VM with the guest agent enabled.
async fn ready_vm(env: &mut Env) -> String {
    let uid = create(env, "agent", true).await;
    wait_created(env, &uid).await;
    uid
}

fn shell(uid: &str, cmd: &str) -> ExecStart {
    ExecStart { uid: uid.to_string(), cmd: cmd.to_string(), shell: true, ..Default::default() }
}

/// Sends exactly `messages`, half-closes, and collects every response.
async fn exec_raw(client: &mut ExecClient, messages: Vec<ExecCommandRequest>) -> Result<Vec<Resp>, Status> {
    let mut stream = client.exec_command(futures::stream::iter(messages)).await?.into_inner();
    let mut out = Vec::new();
    while let Some(msg) = stream.message().await? {
        out.push(msg.payload.expect("payload"));
    }
    Ok(out)
}

async fn exec(client: &mut ExecClient, start: ExecStart) -> Result<Vec<Resp>, Status> {
    exec_raw(client, vec![ExecCommandRequest { payload: Some(Req::Start(start)) }]).await
}

fn exit_code(out: &[Resp]) -> i32 {
    match out.last() {
        Some(Resp::ExitCode(c)) => *c,
        other => panic!("last message is not an exit code: {other:?}"),
    }
}

fn joined(out: &[Resp], stdout: bool) -> String {
    let bytes: Vec<u8> = out
        .iter()
        .filter_map(|m| match (m, stdout) {
            (Resp::Stdout(b), true) | (Resp::Stderr(b), false) => Some(b.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    String::from_utf8(bytes).unwrap()
}

// ---- ServerInfo ------------------------------------------------------------

#[tokio::test]
async fn server_info_defaults() {
    let mut env = start_default().await;
    let info = env.vms.server_info(()).await.expect("server info").into_inner();
    let version = info.version.unwrap();
    assert_eq!(version.version, "v0.16.0");
    assert!(!version.build_date.is_empty() && version.build_date != "undefined");
    assert!(!version.commit_hash.is_empty() && version.commit_hash != "undefined");
    let exec = info.exec.unwrap();
    assert!(exec.enabled);
    assert_eq!(exec.address, env.server.addr.to_string());
    let ssh = info.ssh_proxy.unwrap();
    assert!(!ssh.enabled);
    assert_eq!(ssh.address, "");
    let uptime = info.uptime.unwrap();
    assert!(uptime.seconds >= 0 && uptime.nanos >= 0);
    assert_eq!(env.sim.calls("ServerInfo"), 1);
}

#[tokio::test]
async fn server_info_version_is_configurable() {
    let mut env = start_default().await;
    env.sim.set_server_info("v0.15.2-3-gabc1234");
    let info = env.vms.server_info(()).await.unwrap().into_inner();
    assert_eq!(info.version.unwrap().version, "v0.15.2-3-gabc1234");

    env.sim.set_server_info("undefined");
    let v = env.vms.server_info(()).await.unwrap().into_inner().version.unwrap();
    assert_eq!(
        (v.version.as_str(), v.build_date.as_str(), v.commit_hash.as_str()),
        ("undefined", "undefined", "undefined")
    );
}

#[tokio::test]
async fn server_info_unimplemented_emulates_old_flintlock() {
    let mut env = start_default().await;
    env.sim.set_server_info_unimplemented(true);
    let err = env.vms.server_info(()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    assert_eq!(env.sim.calls("ServerInfo"), 1);
    env.sim.set_server_info_unimplemented(false);
    env.vms.server_info(()).await.expect("back on");
    assert_eq!(env.sim.calls("ServerInfo"), 2);
}

#[tokio::test]
async fn exec_disabled_is_unimplemented_and_reported() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_enabled(false);
    let info = env.vms.server_info(()).await.unwrap().into_inner();
    let exec_info = info.exec.unwrap();
    assert!(!exec_info.enabled);
    assert_eq!(exec_info.address, "");
    let err = exec(&mut env.exec, shell(&uid, "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    assert_eq!(env.sim.calls("ExecCommand"), 1);
    assert!(env.sim.exec_calls().is_empty());

    env.sim.set_exec_enabled(true);
    assert_eq!(exit_code(&exec(&mut env.exec, shell(&uid, "true")).await.unwrap()), 0);
    assert_eq!(env.sim.calls("ExecCommand"), 2);
}

// ---- ExecCommand validation ------------------------------------------------

#[tokio::test]
async fn first_message_rules() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    let invalid = "first message must be a start message with uid and cmd set";

    let cases: Vec<Vec<ExecCommandRequest>> = vec![
        vec![ExecCommandRequest { payload: Some(Req::Stdin(b"hi".to_vec())) }],
        vec![ExecCommandRequest { payload: Some(Req::StdinEof(true)) }],
        vec![ExecCommandRequest { payload: None }],
        vec![ExecCommandRequest { payload: Some(Req::Start(shell("", "true"))) }],
        vec![ExecCommandRequest {
            payload: Some(Req::Start(ExecStart { uid: uid.clone(), cmd: String::new(), ..Default::default() })),
        }],
    ];
    for messages in cases {
        let err = exec_raw(&mut env.exec, messages.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{messages:?}: {err:?}");
        assert_eq!(err.message(), invalid);
    }

    // A half-close before any message.
    let err = exec_raw(&mut env.exec, vec![]).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert_eq!(err.message(), "receiving exec start message: EOF");
    assert!(env.sim.exec_calls().is_empty(), "rejected starts are not recorded");

    // shell with an empty cmd passes the check (an empty `sh -c` exits 0).
    let out = exec(&mut env.exec, shell(&uid, "")).await.expect("empty shell");
    assert_eq!(out, vec![Resp::ExitCode(0)]);
    assert_eq!(env.sim.calls("ExecCommand"), 7);
}

#[tokio::test]
async fn unknown_uid_is_unknown_not_found() {
    let mut env = start_default().await;
    let err = exec(&mut env.exec, shell("01NOPE", "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert!(err.message().starts_with("getting microvm: "), "{}", err.message());
    assert!(err.message().contains("01NOPE") && err.message().contains("not found"), "{}", err.message());
    assert!(env.sim.exec_calls().is_empty());
}

#[tokio::test]
async fn preconditions_are_failed_precondition() {
    let mut env = start_default().await;
    // No guest agent.
    let plain = create(&mut env, "plain", false).await;
    wait_created(&mut env, &plain).await;
    let err = exec(&mut env.exec, shell(&plain, "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(err.message(), "microvm was not created with guest agent access enabled");
    let seeded = env.sim.insert_vm("ns", "seeded", MicroVmState::Created);
    let err = exec(&mut env.exec, shell(&seeded, "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    // Still PENDING.
    env.sim.set_boot_delay(Duration::from_secs(3600));
    let pending = create(&mut env, "pending", true).await;
    let err = exec(&mut env.exec, shell(&pending, "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(err.message(), "microvm is not ready (state: pending)");

    // DELETING.
    env.sim.set_boot_delay(Duration::from_millis(10));
    env.sim.set_delete_delay(Duration::from_secs(3600));
    let doomed = ready_vm(&mut env).await;
    env.vms.delete_micro_vm(DeleteMicroVmRequest { uid: doomed.clone() }).await.unwrap();
    let err = exec(&mut env.exec, shell(&doomed, "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(err.message(), "microvm is not ready (state: deleting)");

    // FAILED.
    env.sim.set_vms_end_failed(true);
    let failed = create(&mut env, "failed", true).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let err = exec(&mut env.exec, shell(&failed, "true")).await.unwrap_err();
    assert_eq!(err.message(), "microvm is not ready (state: failed)");
    assert!(env.sim.exec_calls().is_empty());
}

#[tokio::test]
async fn exec_checks_basic_auth_and_unavailable() {
    let mut env = start(SimConfig {
        boot_delay: Duration::from_millis(10),
        basic_auth_token: Some("s3cret".into()),
        ..Default::default()
    })
    .await;
    let err = exec(&mut env.exec, shell("x", "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let err = env.vms.server_info(()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut req = Request::new(futures::stream::iter(vec![ExecCommandRequest {
        payload: Some(Req::Start(shell("01NOPE", "true"))),
    }]));
    req.metadata_mut().insert("authorization", format!("Basic {}", BASE64.encode("s3cret")).parse().unwrap());
    let err = env.exec.exec_command(req).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown, "auth passed, lookup failed: {err:?}");

    env.sim.set_unavailable(true);
    let err = exec(&mut env.exec, shell("x", "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(env.sim.calls("ExecCommand"), 3);
    assert_eq!(env.sim.calls("ServerInfo"), 1);
}

// ---- scripted outcomes -----------------------------------------------------

#[tokio::test]
async fn default_outcome_is_exit_zero_without_output() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    let out = exec(&mut env.exec, shell(&uid, "anything at all")).await.unwrap();
    assert_eq!(out, vec![Resp::ExitCode(0)]);
}

#[tokio::test]
async fn rules_script_output_and_exit_codes() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_rule(
        "provision",
        ExecRule {
            exit_code: 3,
            stdout: "line one\nline two\nline three\n".into(),
            stderr: "warn a\nwarn b\n".into(),
            ..Default::default()
        },
    );
    env.sim.set_exec_rule("prov", ExecRule { exit_code: 9, ..Default::default() });

    let out = exec(&mut env.exec, shell(&uid, "/opt/provision.sh --fast")).await.unwrap();
    assert_eq!(exit_code(&out), 3);
    assert_eq!(joined(&out, true), "line one\nline two\nline three\n");
    assert_eq!(joined(&out, false), "warn a\nwarn b\n");
    let stdout_chunks = out.iter().filter(|m| matches!(m, Resp::Stdout(_))).count();
    assert!(stdout_chunks >= 3, "output comes in several chunks: {out:?}");
    // stdout, then stderr, then the exit code.
    let last_stdout = out.iter().rposition(|m| matches!(m, Resp::Stdout(_))).unwrap();
    let first_stderr = out.iter().position(|m| matches!(m, Resp::Stderr(_))).unwrap();
    assert!(last_stdout < first_stderr);

    // First matching rule wins; "prov" only matches what "provision" does not.
    assert_eq!(exit_code(&exec(&mut env.exec, shell(&uid, "improv")).await.unwrap()), 9);

    // The pattern is matched against cmd + args joined with spaces.
    let start = ExecStart {
        uid: uid.clone(),
        cmd: "/bin/run".into(),
        args: vec!["provision".into(), "now".into()],
        ..Default::default()
    };
    assert_eq!(exit_code(&exec(&mut env.exec, start).await.unwrap()), 3);

    // Setting an existing pattern replaces its rule; clear removes all.
    env.sim.set_exec_rule("provision", ExecRule { exit_code: 4, ..Default::default() });
    assert_eq!(exit_code(&exec(&mut env.exec, shell(&uid, "provision")).await.unwrap()), 4);
    env.sim.clear_exec_rules();
    assert_eq!(exec(&mut env.exec, shell(&uid, "provision")).await.unwrap(), vec![Resp::ExitCode(0)]);
}

/// Issue 14 item 13: `Sim::set_exec_exit_code` is the in-process form of the binary's
/// `--exec-rule PATTERN=EXIT_CODE`: matching commands exit with that code (a failing one says
/// which rule failed it on stderr), the first matching rule wins, others exit 0.
#[tokio::test]
async fn exit_code_rules_fail_matching_commands_and_name_themselves() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_exit_code("setup --dry-run", 0);
    env.sim.set_exec_exit_code("setup", 3);

    let out = exec(&mut env.exec, shell(&uid, "/opt/setup --all")).await.unwrap();
    assert_eq!(out, vec![Resp::Stderr(b"flintlock-sim: exit 3 by --exec-rule setup=3\n".to_vec()), Resp::ExitCode(3)]);
    let out = exec(&mut env.exec, shell(&uid, "/opt/setup --dry-run")).await.unwrap();
    assert_eq!(out, vec![Resp::ExitCode(0)], "the first matching rule applies");
    let out = exec(&mut env.exec, shell(&uid, "echo ready")).await.unwrap();
    assert_eq!(out, vec![Resp::ExitCode(0)], "no rule matches");
}

/// Kills the spawned simulator however the test ends.
struct Spawned(std::process::Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 14 item 13: the `flintlock-sim` binary takes `--exec-rule PATTERN=EXIT_CODE`
/// (repeatable) and applies it to every VM's exec commands, as the local stack uses it
/// (`FLINTLOCK_SIM_ARGS` of scripts/dev.sh); a malformed rule stops it with a usage error.
#[tokio::test]
async fn the_binary_applies_exec_rules_from_its_command_line() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let bin = env!("CARGO_BIN_EXE_flintlock-sim");
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--boot-delay-ms", "20"])
        .args(["--exec-rule", "systemctl is-system-running=1", "--exec-rule=reset-state=42"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn flintlock-sim");
    let stdout = child.stdout.take().unwrap();
    let child = Spawned(child);
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).expect("read the listening line");
    assert!(line.starts_with("flintlock-sim listening on "), "unexpected first line: {line:?}");
    let addr = line.trim().rsplit(' ').next().unwrap().to_owned();

    let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.expect("connect");
    let (mut vms, mut exec_client) = (MicroVmClient::new(channel.clone()), MicroVmExecClient::new(channel));
    let created = vms
        .create_micro_vm(CreateMicroVmRequest { microvm: Some(spec("agent", true)), metadata: Default::default() })
        .await
        .expect("create")
        .into_inner();
    let uid = created.microvm.unwrap().spec.unwrap().uid.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let vm = vms.get_micro_vm(GetMicroVmRequest { uid: uid.clone() }).await.unwrap().into_inner();
        if vm.microvm.unwrap().status.unwrap().state == MicroVmState::Created as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "{uid} never CREATED");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let out = exec(&mut exec_client, shell(&uid, "systemctl is-system-running --wait")).await.unwrap();
    assert_eq!(exit_code(&out), 1);
    assert!(joined(&out, false).contains("--exec-rule systemctl is-system-running=1"), "{out:?}");
    assert_eq!(exit_code(&exec(&mut exec_client, shell(&uid, "rm -rf /tmp/job; reset-state")).await.unwrap()), 42);
    assert_eq!(exec(&mut exec_client, shell(&uid, "echo ready")).await.unwrap(), vec![Resp::ExitCode(0)]);
    drop(child);

    let bad = Command::new(bin).args(["--exec-rule", "setup=fail"]).output().expect("run flintlock-sim");
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--exec-rule \"setup=fail\""), "{bad:?}");
}

#[tokio::test]
async fn error_rule_sends_error_then_126() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_rule(
        "as-nobody",
        ExecRule { error: Some("looking up user \"ghost\": unknown user ghost".into()), ..Default::default() },
    );
    let out = exec(&mut env.exec, shell(&uid, "as-nobody id")).await.unwrap();
    assert_eq!(out, vec![Resp::Error("looking up user \"ghost\": unknown user ghost".into()), Resp::ExitCode(126)]);
}

#[tokio::test]
async fn duration_delays_the_exit_code() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_rule(
        "slow",
        ExecRule { stdout: "started\n".into(), duration: Duration::from_millis(300), ..Default::default() },
    );
    let t = Instant::now();
    let out = exec(&mut env.exec, shell(&uid, "slow job")).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    assert_eq!(out, vec![Resp::Stdout(b"started\n".to_vec()), Resp::ExitCode(0)]);
}

#[tokio::test]
async fn timeout_seconds_kills_with_143() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_rule("sleep", ExecRule { exit_code: 0, duration: Duration::from_secs(30), ..Default::default() });
    let t = Instant::now();
    let out = exec(&mut env.exec, ExecStart { timeout_seconds: 1, ..shell(&uid, "sleep 30") }).await.unwrap();
    let took = t.elapsed();
    assert_eq!(out, vec![Resp::ExitCode(143)]);
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(5), "{took:?}");

    // A duration within the limit is not cut.
    env.sim
        .set_exec_rule("quick", ExecRule { exit_code: 5, duration: Duration::from_millis(50), ..Default::default() });
    let out = exec(&mut env.exec, ExecStart { timeout_seconds: 1, ..shell(&uid, "quick") }).await.unwrap();
    assert_eq!(out, vec![Resp::ExitCode(5)]);
}

#[tokio::test]
async fn guest_agent_not_up_until_delay_passes() {
    let mut env = start_default().await;
    env.sim.set_guest_agent_delay(Duration::from_millis(500));
    let uid = ready_vm(&mut env).await;
    let err = exec(&mut env.exec, shell(&uid, "true")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unknown);
    assert!(err.message().ends_with("guest agent: handshake read: EOF"), "{}", err.message());
    assert!(err.message().starts_with("starting guest-agent exec session: "), "{}", err.message());

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match exec(&mut env.exec, shell(&uid, "true")).await {
            Ok(out) => {
                assert_eq!(out, vec![Resp::ExitCode(0)]);
                break;
            }
            Err(e) => {
                assert!(e.message().contains("handshake read: EOF"), "{e:?}");
                assert!(Instant::now() < deadline, "agent never came up");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // Refused attempts are recorded too (they got past the server's checks).
    assert!(env.sim.exec_calls().len() >= 2);

    // The delay is measured from boot, so a longer one applies to booted VMs again.
    env.sim.set_guest_agent_delay(Duration::from_secs(3600));
    let err = exec(&mut env.exec, shell(&uid, "true")).await.unwrap_err();
    assert!(err.message().contains("handshake read: EOF"));
    env.sim.set_guest_agent_delay(Duration::ZERO);
    exec(&mut env.exec, shell(&uid, "true")).await.expect("agent up");
}

#[tokio::test]
async fn exec_calls_are_recorded_in_order() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    exec(&mut env.exec, ExecStart { timeout_seconds: 7, ..shell(&uid, "first") }).await.unwrap();
    let _ = exec(&mut env.exec, shell("01NOPE", "ignored")).await.unwrap_err();
    let start =
        ExecStart { uid: uid.clone(), cmd: "echo".into(), args: vec!["a".into(), "b".into()], ..Default::default() };
    exec(&mut env.exec, start).await.unwrap();
    assert_eq!(
        env.sim.exec_calls(),
        vec![
            ExecCall { uid: uid.clone(), cmd: "first".into(), shell: true, timeout_seconds: 7 },
            ExecCall { uid: uid.clone(), cmd: "echo a b".into(), shell: false, timeout_seconds: 0 },
        ]
    );
    assert_eq!(env.sim.calls("ExecCommand"), 3);
}

#[tokio::test]
async fn client_cancel_stops_the_command() {
    let mut env = start_default().await;
    let uid = ready_vm(&mut env).await;
    env.sim.set_exec_rule(
        "hang",
        ExecRule { stdout: "waiting\n".into(), duration: Duration::from_secs(3600), ..Default::default() },
    );
    let mut stream = env
        .exec
        .exec_command(futures::stream::iter(vec![ExecCommandRequest {
            payload: Some(Req::Start(shell(&uid, "hang"))),
        }]))
        .await
        .expect("stream opens")
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.payload, Some(Resp::Stdout(b"waiting\n".to_vec())));
    assert_eq!(env.sim.exec_running(), 1);

    // Nothing else arrives: only the client's deadline ends a hang.
    assert!(tokio::time::timeout(Duration::from_millis(200), stream.message()).await.is_err());

    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(5);
    while env.sim.exec_running() != 0 {
        assert!(Instant::now() < deadline, "simulated command still running after cancel");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A command that finishes stops counting too.
    exec(&mut env.exec, shell(&uid, "true")).await.unwrap();
    while env.sim.exec_running() != 0 {
        assert!(Instant::now() < deadline, "finished command still counted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
