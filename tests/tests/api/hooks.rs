//! Create and pre-lease hooks through flintlock's guest agent (MicroVMExec), and the
//! two-phase claim of the seed ADR.

use std::sync::Arc;
use std::time::Duration;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_sim::ExecRule;
use poolmgr_core::api::ClaimResponse;
use poolmgr_tests::*;
use serde_json::json;
use tokio::sync::Barrier;

fn hook_spec(name: &str, size: i32, create: &[&str], pre_lease: &[&str], policy: &str) -> serde_json::Value {
    let mut spec = pool_spec(name, size);
    spec["create_commands"] = json!(create);
    spec["pre_lease_commands"] = json!(pre_lease);
    spec["hook_failure_policy"] = json!(policy);
    spec
}

fn failing(exit_code: i32) -> ExecRule {
    ExecRule { exit_code, stderr: "boom".into(), ..Default::default() }
}

fn slow(ms: u64) -> ExecRule {
    ExecRule { duration: Duration::from_millis(ms), ..Default::default() }
}

/// A pool with a pre-lease hook and `n` AVAILABLE VMs whose simulated microVMs have booted.
async fn hook_pool(app: &TestApp, policy: &str, n: usize) -> Vec<poolmgr_core::store::VmRow> {
    app.post(ADMIN, "/v1/pools", hook_spec("ci", n as i32, &[], &["reset-state"], policy)).await.assert_ok(201);
    let vms = app.seed_available("ci", n).await;
    // Exec needs the microVM CREATED.
    tokio::time::sleep(Duration::from_millis(150)).await;
    vms
}

async fn wait_for(what: &str, f: impl AsyncFn() -> bool) {
    for _ in 0..200 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn a_pre_lease_hook_runs_on_the_vm_before_the_lease_is_written() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "DELETE_AND_REPLACE", 1).await;
    let b = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert_eq!(b.vm.id, vms[0].id);
    let calls = app.sim.exec_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].cmd, "reset-state");
    assert_eq!(calls[0].uid, vms[0].uid.clone().unwrap());
    assert!(calls[0].shell, "hooks run through sh -c");
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("LEASED"));
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
    assert!(app.state.metrics.render().contains("poolmgr_hook_duration_seconds_count{hook=\"pre_lease\""));
    // A replay does not rerun the hook.
    assert!(app.claimed(CLIENT_A, "ci", Some("r-1")).await.replayed);
    assert_eq!(app.sim.exec_calls().len(), 1);
}

#[tokio::test]
async fn a_failed_pre_lease_hook_quarantines_the_vm_under_quarantine() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    app.sim.set_exec_rule("reset-state", failing(3));
    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    r.assert_error(500, "INTERNAL");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("exited with 3"), "{}", r.body);
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("QUARANTINED"));
    assert!(app.sim.vm(vms[0].uid.as_deref().unwrap()).is_some(), "kept for inspection");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 1);
    assert_eq!(app.count_events("VM_CLAIMED").await, 0);
    assert_eq!(
        app.metric("poolmgr_hook_failures_total{hook=\"pre_lease\",pool_name=\"ci\",pool_namespace=\"default\"}"),
        1.0
    );
}

#[tokio::test]
async fn a_failed_pre_lease_hook_deletes_the_vm_under_delete_and_replace() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "DELETE_AND_REPLACE", 1).await;
    app.sim.set_exec_rule("reset-state", failing(1));
    app.claim(CLIENT_A, "ci", None).await.assert_error(500, "INTERNAL");
    assert_eq!(app.phase_of(&vms[0].id).await, None, "row removed after the flintlock delete");
    let uid = vms[0].uid.clone().unwrap();
    assert!(app.sim.vm(&uid).is_none_or(|m| m.status.is_some_and(|s| s.state == MicroVmState::Deleting as i32)));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 1);
}

#[tokio::test]
async fn a_hook_failure_then_a_retry_with_the_same_request_id_claims_fresh() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "QUARANTINE", 2).await;
    app.sim.set_exec_rule("reset-state", failing(1));
    app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_error(500, "INTERNAL");
    app.sim.clear_exec_rules();
    let b = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(!b.replayed, "the failed attempt left no request_id behind");
    let quarantined = app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'QUARANTINED'").await;
    assert_eq!(quarantined, 1);
    assert!(vms.iter().any(|v| v.id == b.vm.id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicate_request_ids_with_a_slow_hook_create_one_lease() {
    let app = Arc::new(TestApp::spawn().await);
    hook_pool(&app, "DELETE_AND_REPLACE", 4).await;
    app.sim.set_exec_rule("reset-state", slow(400));
    let barrier = Arc::new(Barrier::new(2));
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.claim(CLIENT_A, "ci", Some("dup")).await
            })
        })
        .collect();
    let mut bodies = vec![];
    for t in tasks {
        let r = t.await.unwrap();
        bodies.push(r.assert_ok_response(200).json::<ClaimResponse>());
    }
    assert_eq!(bodies[0].lease.lease_id, bodies[1].lease.lease_id, "both carry the winner's lease");
    let replayed: Vec<bool> = bodies.iter().map(|b| b.replayed).collect();
    assert!(replayed.contains(&true) && replayed.contains(&false), "{replayed:?}");
    assert_eq!(app.sim.exec_calls().len(), 2, "both ran the hook: the loser's VM went back");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 3, "the loser's VM is AVAILABLE again");
    assert_eq!(app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await, 0);
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"true\"}"),
        1.0
    );
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"false\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_force_deleted_during_the_hook_aborts_the_claim_and_leaves_nothing() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    app.sim.set_exec_rule("reset-state", slow(500));
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the hook to start", async || app.phase_of(&vms[0].id).await.as_deref() == Some("PRE_LEASE_HOOK_RUNNING"))
        .await;
    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);
    let r = claim.await.unwrap();
    r.assert_error(409, "ABORTED");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0, "not a hook failure");
    assert_eq!(app.count_events("VM_CLAIMED").await, 0);
    let phase = app.phase_of(&vms[0].id).await;
    assert!(phase.is_none() || phase.as_deref() == Some("DELETING"), "{phase:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_force_deleted_after_the_hook_before_the_lease_aborts_the_claim() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    let vm_id = vms[0].id.clone();
    app.sim.set_exec_rule("reset-state", slow(300));
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the hook to start", async || app.phase_of(&vm_id).await.as_deref() == Some("PRE_LEASE_HOOK_RUNNING"))
        .await;
    // Hold the VM row (the first transaction has committed) so the claim's second
    // transaction waits once the hook has run.
    let mut holder = app.db.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.execute("SELECT 1 FROM vms WHERE id = $1 FOR UPDATE", &[&vm_id]).await.unwrap();
    wait_for("the hook to finish", async || app.sim.exec_running() == 0).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    // What a forced pool delete does, committed while the claim waits for the row.
    tx.batch_execute(&format!(
        "UPDATE vms SET phase = 'DELETING', lease_id = NULL WHERE id = '{vm_id}';
         DELETE FROM pools WHERE namespace = 'default' AND name = 'ci';"
    ))
    .await
    .unwrap();
    tx.commit().await.unwrap();
    claim.await.unwrap().assert_error(409, "ABORTED");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.phase_of(&vm_id).await.as_deref(), Some("DELETING"), "left to its deleter");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vm_deleted_before_its_hook_runs_aborts_without_a_hook_failure() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    // The guest agent is slow to answer: the force delete lands before the command runs,
    // and flintlock then no longer knows the VM.
    app.sim.set_exec_rule("reset-state", slow(300));
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", None).await })
    };
    wait_for("the claim to take the VM", async || {
        app.phase_of(&vms[0].id).await.as_deref() == Some("PRE_LEASE_HOOK_RUNNING")
    })
    .await;
    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);
    claim.await.unwrap().assert_error(409, "ABORTED");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE phase NOT IN ('DELETING')").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_cancelled_during_its_hook_still_finishes_and_its_retry_replays() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 2).await;
    app.sim.set_exec_rule("reset-state", slow(400));
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the hook to start", async || app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await == 1).await;
    claim.abort(); // the client goes away mid-hook
    let _ = claim.await;
    wait_for("the detached claim to finish", async || app.count_phase("ci", "LEASED").await == 1).await;
    assert_eq!(app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await, 0, "nothing stuck");
    app.sim.clear_exec_rules();
    let r = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(r.replayed, "the retry finds the lease the cancelled call made");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 1);
    let _ = vms;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_cancelled_during_a_failing_hook_still_applies_the_policy() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    app.sim.set_exec_rule(
        "reset-state",
        ExecRule { exit_code: 2, duration: Duration::from_millis(400), ..Default::default() },
    );
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", None).await })
    };
    wait_for("the hook to start", async || app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await == 1).await;
    claim.abort();
    let _ = claim.await;
    wait_for("the policy", async || app.phase_of(&vms[0].id).await.as_deref() == Some("QUARANTINED")).await;
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 1);
}

#[tokio::test]
async fn a_claim_abandoned_mid_hook_is_recovered_by_the_reconcile_pass() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "DELETE_AND_REPLACE", 1).await;
    // A function that took the VM (first transaction) and died before finishing.
    {
        let conn = app.conn().await;
        let taken = poolmgr_core::store::vm_claim_for_hook(&**conn, &pool("ci")).await.unwrap();
        assert_eq!(taken.vm.unwrap().id, vms[0].id);
    }
    app.pass().await;
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("PRE_LEASE_HOOK_RUNNING"), "not before the timeout");
    app.advance_clock(Duration::from_secs(3600));
    app.pass().await;
    let phase = app.phase_of(&vms[0].id).await;
    assert!(phase.is_none() || phase.as_deref() == Some("DELETING"), "deleted, never handed out again: {phase:?}");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 1);
    app.claim(CLIENT_A, "ci", None).await.assert_error(429, "RESOURCE_EXHAUSTED");
}

#[tokio::test]
async fn create_hooks_run_in_order_after_the_guest_agent_answers() {
    let app = TestApp::spawn().await;
    app.sim.set_guest_agent_delay(Duration::from_millis(300));
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 2, &["echo one", "echo two"], &[], "DELETE_AND_REPLACE"))
        .await
        .assert_ok(201);
    app.settle(80, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    let calls: Vec<_> = app.sim.exec_calls().into_iter().filter(|c| c.cmd != "true").collect();
    assert_eq!(calls.len(), 4);
    for uid in calls.iter().map(|c| c.uid.clone()).collect::<std::collections::HashSet<_>>() {
        let mine: Vec<_> = calls.iter().filter(|c| c.uid == uid).map(|c| c.cmd.as_str()).collect();
        assert_eq!(mine, ["echo one", "echo two"], "in order, once each");
    }
    assert!(app.state.metrics.render().contains("poolmgr_hook_duration_seconds_count{hook=\"create\""));
}

async fn create_hook_failure_with_failing_delete(policy: &str, end_phase: &str) {
    let app = TestApp::spawn().await;
    app.sim.set_exec_rule("setup", failing(1));
    app.sim.fail_deletes(u32::MAX);
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &["setup"], &[], policy)).await.assert_ok(201);
    app.settle(60, "hook failure", || async { app.count_events("VM_HOOK_FAILED").await >= 1 }).await;
    let (id, uid): (String, String) = {
        let row = app.conn().await.query_one("SELECT id, uid FROM vms ORDER BY created_at LIMIT 1", &[]).await.unwrap();
        (row.get(0), row.get(1))
    };
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.phase_of(&id).await.as_deref(), Some(end_phase));
    assert!(app.sim.vm(&uid).is_some(), "the microVM still exists and still has its row: no orphan");
    assert!(
        app.metric("poolmgr_hook_failures_total{hook=\"create\",pool_name=\"ci\",pool_namespace=\"default\"}") >= 1.0
    );
    app.sim.reset_faults();
    app.sim.clear_exec_rules();
    if end_phase == "DELETING" {
        app.settle(60, "deleted once flintlock recovers", || async { app.phase_of(&id).await.is_none() }).await;
    }
    app.settle(80, "a healthy replacement", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
}

#[tokio::test]
async fn a_create_hook_failure_with_a_failing_delete_stays_deleting_under_delete_and_replace() {
    create_hook_failure_with_failing_delete("DELETE_AND_REPLACE", "DELETING").await;
}

#[tokio::test]
async fn a_create_hook_failure_with_a_failing_delete_is_quarantined_under_quarantine() {
    create_hook_failure_with_failing_delete("QUARANTINE", "QUARANTINED").await;
}

/// Output no shell script should print, but real ones do: about 60 KiB of progress noise with
/// NULs and terminal escapes, ending in the line that says what went wrong.
fn hostile_output() -> ExecRule {
    let noise = format!("{}\0\x1b[2K\r\n", "x".repeat(1000));
    ExecRule {
        exit_code: 3,
        stdout: "progress\0\n".repeat(100),
        stderr: format!("{}fatal: disk\0 gone \x1b[31mE42\x1b[0m\n", noise.repeat(60)),
        ..Default::default()
    }
}

/// How [`hostile_output`]'s stderr ends, as a failure reason shows it.
const OUTPUT_END: &str = "fatal: disk\\x00 gone \\x1b[31mE42\\x1b[0m";

/// What a hook failure reason must look like whatever the command printed: no control
/// character but newline and tab (PostgreSQL refuses a NUL in jsonb), a few KiB at most, and
/// the end of the output, escaped.
#[track_caller]
fn assert_clean_reason(reason: &str, command: &str) {
    assert!(reason.contains(&format!("`{command}` exited with 3: ")), "{reason:.200}");
    assert!(reason.contains("…"), "cut: {reason:.200}");
    assert!(reason.contains(OUTPUT_END), "the end of the output: {reason:.200}");
    assert!(!reason.chars().any(|c| c.is_control() && c != '\n' && c != '\t'), "{reason:?}");
    assert!(reason.len() <= 3 * 1024, "{} bytes", reason.len());
}

/// Issue 14 item 8: a create command whose stderr holds NULs and terminal escapes (and 60 KiB
/// of it): the VM gets the pool's policy, VM_HOOK_FAILED stores the end of the output escaped
/// and cut, the pass reports no error, and no pass reruns the command on that VM. Before, the
/// event's jsonb was refused: the pool's step failed before replenishment and every pass
/// reran the command.
#[tokio::test]
async fn a_create_hook_with_control_characters_in_its_output_fails_once_and_cleanly() {
    let app = TestApp::spawn().await;
    app.sim.set_exec_rule("setup", hostile_output());
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &["setup"], &[], "QUARANTINE")).await.assert_ok(201);
    app.settle(60, "the VM quarantined", || async { app.count_phase("ci", "QUARANTINED").await == 1 }).await;
    for _ in 0..3 {
        let r = app.pass().await;
        assert!(r.errors.is_empty(), "{:?}", r.errors);
    }
    let failed: Vec<_> = app.events("").await.events.into_iter().filter(|e| e.kind == "VM_HOOK_FAILED").collect();
    assert!(!failed.is_empty());
    for e in &failed {
        let reason = e.payload["reason"].as_str().unwrap();
        assert!(reason.starts_with("create command 0 ") && reason.ends_with(OUTPUT_END), "{reason:.100}");
        assert_clean_reason(reason, "setup");
    }
    let setups: Vec<_> = app.sim.exec_calls().into_iter().filter(|c| c.cmd == "setup").collect();
    let uids: std::collections::HashSet<_> = setups.iter().map(|c| c.uid.clone()).collect();
    assert_eq!(setups.len(), uids.len(), "the command ran once per VM, never again on the same VM");
    assert_eq!(setups.len(), failed.len(), "each run failed once, with its event");
}

/// Issue 14 item 8: a pre-lease command with the same output answers 500 INTERNAL naming
/// the hook failure (its output escaped and cut), and the VM gets the pool's policy: it is
/// not stranded in PRE_LEASE_HOOK_RUNNING. Before, the VM_HOOK_FAILED write was refused, the
/// claim answered an unexplained 500 and the VM stayed stuck until the abandon period.
#[tokio::test]
async fn a_pre_lease_hook_with_control_characters_in_its_output_applies_the_policy() {
    let app = TestApp::spawn().await;
    hook_pool(&app, "QUARANTINE", 2).await;
    app.sim.set_exec_rule("reset-state", hostile_output());
    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    r.assert_error(500, "INTERNAL");
    assert_clean_reason(r.body["error"]["message"].as_str().unwrap(), "reset-state");
    assert_eq!(app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await, 0, "no VM stranded mid-hook");
    assert_eq!(app.count_phase("ci", "QUARANTINED").await, 1);
    let failed: Vec<_> = app.events("").await.events.into_iter().filter(|e| e.kind == "VM_HOOK_FAILED").collect();
    assert_eq!(failed.len(), 1);
    let reason = failed[0].payload["reason"].as_str().unwrap();
    assert!(reason.ends_with(OUTPUT_END), "{reason:.100}");
    assert_clean_reason(reason, "reset-state");
    // The retry is a fresh claim of the other VM.
    app.sim.clear_exec_rules();
    let b = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(!b.replayed);
}

#[tokio::test]
async fn hosts_that_cannot_exec_refuse_pools_with_hooks() {
    let app = TestApp::spawn().await;
    for (setup, needle) in [(0, "older than v0.15.2"), (1, "--enable-exec-api"), (2, "v0.15.0")] {
        app.sim.set_server_info("v0.16.0");
        app.sim.set_exec_enabled(true);
        app.sim.set_server_info_unimplemented(false);
        match setup {
            0 => app.sim.set_server_info("v0.14.1"),
            1 => app.sim.set_exec_enabled(false),
            _ => app.sim.set_server_info_unimplemented(true),
        }
        let r = app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &["setup"], &[], "QUARANTINE")).await;
        r.assert_error(400, "FAILED_PRECONDITION");
        assert!(r.body["error"]["message"].as_str().unwrap().contains(needle), "{}", r.body);
        let host = app.get_host(SIM_HOST).await;
        assert!(host.exec_unavailable_reason.as_deref().is_some_and(|r| r.contains(needle)), "{host:?}");
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM pools").await, 0);
    // Without hooks the same host is fine; with a capable host the hooks are accepted.
    app.create_pool("plain", 0).await;
    app.sim.set_server_info_unimplemented(false);
    app.sim.set_exec_enabled(true);
    app.sim.set_server_info("v0.15.2-3-gabc1234");
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &["setup"], &[], "QUARANTINE")).await.assert_ok(201);
    let host = app.get_host(SIM_HOST).await;
    assert_eq!(host.exec_unavailable_reason, None);
    assert_eq!(host.flintlock_version.as_deref(), Some("v0.15.2-3-gabc1234"));
}
