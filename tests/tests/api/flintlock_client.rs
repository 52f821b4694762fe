//! The flintlock client's ServerInfo, exec and readiness calls against flintlock-sim over
//! real gRPC (the host "sim" that `TestApp` registers).

use std::time::{Duration, Instant};

use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_sim::{ExecCall, ExecRule, Sim, SimConfig};
use poolmgr_core::domain::Phase;
use poolmgr_core::flintlock::{Endpoint, ExecOutcome, Flintlock, FlintlockError, exec_supported};
use poolmgr_core::store;
use poolmgr_tests::{SIM_HOST, TestApp};

async fn sim_host(app: &TestApp) -> Endpoint {
    let conn = app.conn().await;
    store::host_get(&**conn, SIM_HOST).await.unwrap().expect("host sim").0.endpoint()
}

/// A VM in the simulator with the guest agent on (the template forces it), CREATED.
async fn ready_vm(app: &TestApp) -> String {
    let uid = app.seed_vm("exec", Phase::Available).await.uid.expect("uid");
    // A bound against a hang, not a timing check.
    let deadline = Instant::now() + Duration::from_secs(60);
    while app.sim.vm(&uid).and_then(|vm| vm.status).map(|s| s.state) != Some(MicroVmState::Created as i32) {
        assert!(Instant::now() < deadline, "{uid} never CREATED");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    uid
}

// ---- ServerInfo and the version gate -----------------------------------------

#[tokio::test]
async fn server_info_reports_version_and_exec() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let info = app.state.flintlock.server_info(&host).await.expect("server info");
    assert_eq!((info.version.as_str(), info.exec_enabled), ("v0.16.0", true));
    assert!(info.response.contains("\"v0.16.0\"") && info.response.contains("enabled: true"), "{}", info.response);
    assert_eq!(exec_supported(&info), Ok(()));
    assert_eq!(app.sim.calls("ServerInfo"), 1);

    app.sim.set_server_info("v0.15.2-3-gabc1234");
    let info = app.state.flintlock.server_info(&host).await.unwrap();
    assert_eq!(info.version, "v0.15.2-3-gabc1234");
    assert_eq!(exec_supported(&info), Ok(()));

    app.sim.set_server_info("v0.14.1");
    let info = app.state.flintlock.server_info(&host).await.unwrap();
    assert_eq!(exec_supported(&info), Err("flintlock v0.14.1 is older than v0.15.2".into()));

    app.sim.set_server_info("undefined");
    let info = app.state.flintlock.server_info(&host).await.unwrap();
    assert!(exec_supported(&info).unwrap_err().contains("not semver"));

    app.sim.set_server_info("v0.16.0");
    app.sim.set_exec_enabled(false);
    let info = app.state.flintlock.server_info(&host).await.unwrap();
    assert!(!info.exec_enabled);
    assert_eq!(exec_supported(&info), Err("exec API disabled: start flintlockd with --enable-exec-api".into()));
}

#[tokio::test]
async fn server_info_unimplemented_is_unsupported() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    app.sim.set_server_info_unimplemented(true);
    match app.state.flintlock.server_info(&host).await {
        Err(FlintlockError::Unsupported { host, message }) => {
            assert_eq!(host, SIM_HOST);
            assert_eq!(message, "flintlock older than v0.15.0 (no ServerInfo)");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    // Other failures keep their usual kind.
    app.sim.set_server_info_unimplemented(false);
    app.sim.set_unavailable(true);
    assert!(matches!(app.state.flintlock.server_info(&host).await, Err(FlintlockError::Unavailable { .. })));
}

// ---- exec ------------------------------------------------------------------

#[tokio::test]
async fn exec_sends_one_shell_start_and_collects_output() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let uid = ready_vm(&app).await;
    app.sim.set_exec_rule(
        "setup.sh",
        ExecRule { exit_code: 0, stdout: "one\ntwo\n".into(), stderr: "careful\n".into(), ..Default::default() },
    );
    let out = app
        .state
        .flintlock
        .exec(&host, &uid, "cd /srv && ./setup.sh --with 'quoted arg'", Duration::from_millis(2500))
        .await
        .expect("exec");
    assert_eq!(out, ExecOutcome { exit_code: 0, stdout: "one\ntwo\n".into(), stderr: "careful\n".into() });
    assert_eq!(
        app.sim.exec_calls(),
        vec![ExecCall {
            uid: uid.clone(),
            cmd: "cd /srv && ./setup.sh --with 'quoted arg'".into(),
            shell: true,
            timeout_seconds: 3,
        }]
    );
    assert_eq!(app.sim.calls("ExecCommand"), 1);
}

#[tokio::test]
async fn exec_non_zero_exit_is_a_result() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let uid = ready_vm(&app).await;
    app.sim.set_exec_rule("false", ExecRule { exit_code: 1, stderr: "nope\n".into(), ..Default::default() });
    let out = app.state.flintlock.exec(&host, &uid, "false", Duration::from_secs(5)).await.unwrap();
    assert_eq!((out.exit_code, out.stderr.as_str()), (1, "nope\n"));

    // The guest-side timeout kill comes back as 143: after the 1 s limit, long before the
    // hour the command would take (the bound is that far off so a busy machine cannot fail it).
    app.sim.set_exec_rule("sleep", ExecRule { duration: Duration::from_secs(3600), ..Default::default() });
    let t = Instant::now();
    let out = app.state.flintlock.exec(&host, &uid, "sleep 3600", Duration::from_secs(1)).await.unwrap();
    assert_eq!(out.exit_code, 143);
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
}

#[tokio::test]
async fn exec_error_message_is_an_exec_error() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let uid = ready_vm(&app).await;
    app.sim.set_exec_rule("sudo", ExecRule { error: Some("unknown user ghost".into()), ..Default::default() });
    match app.state.flintlock.exec(&host, &uid, "sudo -u ghost id", Duration::from_secs(5)).await {
        Err(FlintlockError::Exec { host, message }) => {
            assert_eq!(host, SIM_HOST);
            assert_eq!(message, "unknown user ghost");
        }
        other => panic!("expected an exec error, got {other:?}"),
    }
}

#[tokio::test]
async fn exec_output_is_capped_at_64_kib() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let uid = ready_vm(&app).await;
    let line = format!("{}\n", "x".repeat(1023));
    app.sim.set_exec_rule(
        "flood",
        ExecRule { stdout: line.repeat(100), stderr: line.repeat(80), exit_code: 2, ..Default::default() },
    );
    let out = app.state.flintlock.exec(&host, &uid, "flood", Duration::from_secs(5)).await.unwrap();
    assert_eq!(out.exit_code, 2);
    assert_eq!(out.stdout.len(), 64 * 1024);
    assert_eq!(out.stderr.len(), 64 * 1024);
}

#[tokio::test]
async fn exec_errors_keep_their_kind() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let fl = &app.state.flintlock;

    // Unknown uid: flintlock's "not found".
    let err = fl.exec(&host, "01JUNKNOWNUID0000000000000", "true", Duration::from_secs(5)).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");

    // No guest agent.
    let plain = app.sim.insert_vm("poolmgr-default", "plain", MicroVmState::Created);
    match fl.exec(&host, &plain, "true", Duration::from_secs(5)).await {
        Err(FlintlockError::Rpc { code: tonic_code, message, .. }) => {
            assert_eq!(format!("{tonic_code:?}"), "FailedPrecondition");
            assert_eq!(message, "microvm was not created with guest agent access enabled");
        }
        other => panic!("expected FAILED_PRECONDITION, got {other:?}"),
    }

    // Exec API off.
    let uid = ready_vm(&app).await;
    app.sim.set_exec_enabled(false);
    assert!(matches!(
        fl.exec(&host, &uid, "true", Duration::from_secs(5)).await,
        Err(FlintlockError::Unsupported { .. })
    ));
    app.sim.set_exec_enabled(true);

    // Host unavailable.
    app.sim.set_unavailable(true);
    assert!(matches!(
        fl.exec(&host, &uid, "true", Duration::from_secs(5)).await,
        Err(FlintlockError::Unavailable { .. })
    ));
}

#[tokio::test]
async fn exec_client_deadline_cancels_the_command() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let uid = ready_vm(&app).await;
    app.sim.set_exec_rule("hang", ExecRule { duration: Duration::from_secs(3600), ..Default::default() });
    let t = Instant::now();
    // timeout 0 = no guest-side limit; the client deadline is 0 + 5 s.
    match app.state.flintlock.exec(&host, &uid, "hang", Duration::ZERO).await {
        Err(FlintlockError::Unavailable { .. }) => {}
        other => panic!("expected the client deadline, got {other:?}"),
    }
    // At the 5 s deadline, not the hour (the upper bound is that far off so a busy machine
    // cannot fail it).
    let took = t.elapsed();
    assert!(took >= Duration::from_secs(5) && took < Duration::from_secs(60), "{took:?}");
    assert_eq!(app.sim.exec_calls()[0].timeout_seconds, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while app.sim.exec_running() != 0 {
        assert!(Instant::now() < deadline, "the simulated command outlived the cancelled call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn exec_and_server_info_carry_basic_auth() {
    let app = TestApp::spawn().await;
    let sim = Sim::new(SimConfig {
        boot_delay: Duration::from_millis(10),
        delete_delay: Duration::from_millis(10),
        basic_auth_token: Some("s3cret".into()),
    });
    let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let uid = sim.insert_vm("ns", "vm", MicroVmState::Created);
    let mut host = sim_host(&app).await;
    host.name = "authed".into();
    host.address = server.addr.to_string();
    host.basic_auth_token = Some("s3cret".into());
    let fl = Flintlock::new(Duration::from_secs(3));

    assert!(fl.server_info(&host).await.is_ok());
    // Auth passed: the VM (seeded without guest agent) fails the precondition instead.
    let err = fl.exec(&host, &uid, "true", Duration::from_secs(5)).await.unwrap_err();
    assert!(err.to_string().contains("guest agent access"), "{err}");

    host.basic_auth_token = Some("wrong".into());
    let err = fl.server_info(&host).await.unwrap_err();
    assert!(err.to_string().contains("Unauthenticated"), "{err}");
    let err = fl.exec(&host, &uid, "true", Duration::from_secs(5)).await.unwrap_err();
    assert!(err.to_string().contains("Unauthenticated"), "{err}");
    assert_eq!(sim.calls("ExecCommand"), 2);
}

// ---- wait_ready ------------------------------------------------------------

#[tokio::test]
async fn wait_ready_is_one_probe_until_the_agent_is_up() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    // Each moment is held for as long as the test needs it (issue 14 item 15), never caught
    // by a sleep: a VM that boots in an hour stays PENDING, and the agent answers only once
    // the test shortens its delay.
    app.sim.set_boot_delay(Duration::from_secs(3600));
    app.sim.set_guest_agent_delay(Duration::from_secs(3600));
    let fl = &app.state.flintlock;

    // Still PENDING: not ready.
    let pending = app.seed_vm("exec", Phase::Provisioning).await.uid.unwrap();
    let before = app.sim.calls("ExecCommand");
    assert!(!fl.wait_ready(&host, &pending, Duration::from_secs(1)).await.unwrap());
    assert_eq!(app.sim.calls("ExecCommand"), before + 1, "exactly one probe per call");

    // CREATED but the agent is not up: still not ready, one probe each time.
    app.sim.set_boot_delay(Duration::ZERO);
    let uid = app.seed_vm("exec", Phase::Provisioning).await.uid.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while app.sim.vm(&uid).and_then(|vm| vm.status).map(|s| s.state) != Some(MicroVmState::Created as i32) {
        assert!(Instant::now() < deadline, "{uid} never CREATED");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..2 {
        let calls = app.sim.calls("ExecCommand");
        assert!(!fl.wait_ready(&host, &uid, Duration::from_secs(1)).await.expect("no permanent error"));
        assert_eq!(app.sim.calls("ExecCommand"), calls + 1);
    }
    // The agent comes up: the next probe finds it.
    app.sim.set_guest_agent_delay(Duration::ZERO);
    let calls = app.sim.calls("ExecCommand");
    assert!(fl.wait_ready(&host, &uid, Duration::from_secs(1)).await.expect("no permanent error"));
    assert_eq!(app.sim.calls("ExecCommand"), calls + 1);
    let probes: Vec<ExecCall> = app.sim.exec_calls();
    assert!(probes.iter().all(|c| c.cmd == "true" && c.shell && c.uid == uid), "{probes:?}");

    // Any exit code counts as ready; an agent error before it does not.
    app.sim.set_exec_rule("true", ExecRule { exit_code: 7, ..Default::default() });
    assert!(fl.wait_ready(&host, &uid, Duration::from_secs(1)).await.unwrap());
    app.sim.set_exec_rule("true", ExecRule { error: Some("agent busy".into()), ..Default::default() });
    assert!(!fl.wait_ready(&host, &uid, Duration::from_secs(1)).await.unwrap());

    // A probe that hangs is cut at per_attempt and counts as not ready.
    app.sim.set_exec_rule("true", ExecRule { duration: Duration::from_secs(60), ..Default::default() });
    let t = Instant::now();
    assert!(!fl.wait_ready(&host, &uid, Duration::from_millis(300)).await.unwrap());
    assert!(t.elapsed() < Duration::from_secs(30), "cut at 300 ms, not after the 60 s probe: {:?}", t.elapsed());

    // An unreachable host is a transport error, not the agent's answer (issue 23 finding 3):
    // the caller retries later without counting it against the agent.
    app.sim.clear_exec_rules();
    app.sim.set_unavailable(true);
    let err = fl.wait_ready(&host, &uid, Duration::from_secs(1)).await.unwrap_err();
    assert!(err.is_transport(), "{err:?}");
}

#[tokio::test]
async fn wait_ready_permanent_failures_are_errors() {
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    let fl = &app.state.flintlock;

    let err = fl.wait_ready(&host, "01JUNKNOWNUID0000000000000", Duration::from_secs(1)).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");

    let plain = app.sim.insert_vm("poolmgr-default", "plain", MicroVmState::Created);
    let err = fl.wait_ready(&host, &plain, Duration::from_secs(1)).await.unwrap_err();
    assert!(err.to_string().contains("guest agent access"), "{err}");

    let uid = ready_vm(&app).await;
    app.sim.set_exec_enabled(false);
    assert!(matches!(
        fl.wait_ready(&host, &uid, Duration::from_secs(1)).await,
        Err(FlintlockError::Unsupported { .. })
    ));
}

// ---- Large hosts -------------------------------------------------------------

/// A host with more VMs than gRPC's default 4 MiB answer holds is listed whole: at 10,000
/// pools of 10 on 4 hosts (25,000 VMs each, 16 MiB) the orphan scan and `poolmgr-check`
/// failed with OutOfRange ("decoded message length too large").
#[tokio::test]
async fn a_host_list_larger_than_grpcs_default_message_limit_is_read_whole() {
    use prost::Message;
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    for i in 0..12_000 {
        app.sim.insert_vm("big-host", &format!("vm-{i}"), MicroVmState::Created);
    }
    let vms = Flintlock::new(Duration::from_secs(30)).list(&host, "big-host", None).await.expect("list");
    assert_eq!(vms.len(), 12_000);
    let bytes: usize = vms.iter().map(|vm| vm.encoded_len()).sum();
    assert!(
        bytes > 4 << 20,
        "the answer ({bytes} bytes) must exceed gRPC's default limit for this test to mean anything"
    );
}

/// Issue 25 item 11: an answer larger than the client reads fails the call with OutOfRange and
/// a message that says what to do, instead of being read into a function's memory whatever
/// its size (the limit was 256 MiB in a 256 MB function). Here the limit is lowered to 1 MiB.
#[tokio::test]
async fn a_host_list_larger_than_the_client_reads_fails_and_says_why() {
    use prost::Message;
    let app = TestApp::spawn().await;
    let host = sim_host(&app).await;
    for i in 0..5_000 {
        app.sim.insert_vm("big-host", &format!("vm-{i}"), MicroVmState::Created);
    }
    let whole = Flintlock::new(Duration::from_secs(30)).list(&host, "big-host", None).await.expect("list");
    let bytes: usize = whole.iter().map(|vm| vm.encoded_len()).sum();
    assert!(bytes > 1 << 20, "the answer ({bytes} bytes) must exceed the lowered limit for this test to mean anything");
    let err = Flintlock::new(Duration::from_secs(30))
        .with_max_response(1 << 20)
        .list(&host, "big-host", None)
        .await
        .expect_err("an answer over the limit");
    match &err {
        FlintlockError::Rpc { code, message, .. } => {
            assert_eq!(format!("{code:?}"), "OutOfRange", "{message}");
            assert!(message.contains("spread the VMs over more hosts"), "{message}");
        }
        other => panic!("expected OutOfRange, got {other:?}"),
    }
}
