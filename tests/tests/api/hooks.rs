//! Create and pre-lease hooks through flintlock's guest agent (MicroVMExec), and the
//! two-phase claim of the seed ADR.

use std::sync::Arc;
use std::time::Duration;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_sim::ExecRule;
use poolmgr_core::api::ClaimResponse;
use poolmgr_core::domain::HostExec;
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
    booted(app, &vms).await;
    vms
}

/// Waits until the simulated microVMs of `vms` are CREATED: exec needs them booted, and a
/// fixed sleep after seeding loses that race on a busy machine (issue 14 item 15).
async fn booted(app: &TestApp, vms: &[poolmgr_core::store::VmRow]) {
    wait_for("the seeded microVMs to boot", async || {
        vms.iter().all(|v| {
            let uid = v.uid.as_deref().expect("a seeded VM has its uid");
            app.sim.vm(uid).and_then(|m| m.status).is_some_and(|s| s.state == MicroVmState::Created as i32)
        })
    })
    .await;
}

/// Waits for a condition; the 60 s bound is against a hang, not a timing check.
async fn wait_for(what: &str, f: impl AsyncFn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
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
    // Issue 25 item 6: the client learns that the hook failed, with a reason word and a
    // correlation id; the admin's command and the guest's output go only to the event.
    r.assert_reason(500, "INTERNAL", "HOOK_FAILED");
    let message = r.body["error"]["message"].as_str().unwrap();
    for secret in ["reset-state", "exited with 3", "stderr"] {
        assert!(!message.contains(secret), "the client's answer names {secret:?}: {message}");
    }
    let failed: Vec<_> = app.events("").await.events.into_iter().filter(|e| e.kind == "VM_HOOK_FAILED").collect();
    let detail = failed[0].payload["reason"].as_str().unwrap();
    assert!(detail.contains("exited with 3") && detail.contains("reset-state"), "{detail}");
    assert_eq!(failed[0].payload["correlation_id"], r.body["error"]["request_id"], "{:?}", failed[0].payload);
    assert!(message.contains(r.body["error"]["request_id"].as_str().unwrap()), "{message}");
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

/// `n` claims of `CLIENT_A` with request_id `rid` on pool ci, released at once by a barrier.
fn duplicates(app: &Arc<TestApp>, n: usize, rid: &'static str) -> Vec<tokio::task::JoinHandle<TestResponse>> {
    let barrier = Arc::new(Barrier::new(n));
    (0..n)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.claim(CLIENT_A, "ci", Some(rid)).await
            })
        })
        .collect()
}

/// Issue 14 item 1 (contract semantics 5 with pre-lease hooks): 12 claims with one request_id
/// released at once on a hook pool with 4 VMs. One VM is taken, the hook runs once, one lease;
/// every caller gets that lease (one fresh, 11 replays), none answers 429 or takes a VM of its
/// own. (This test used to accept a second hook run on a VM the loser then gave back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicate_request_ids_with_a_slow_hook_create_one_lease() {
    let app = Arc::new(TestApp::spawn().await);
    hook_pool(&app, "DELETE_AND_REPLACE", 4).await;
    app.sim.set_exec_rule("reset-state", slow(400));
    let mut lease_ids = std::collections::HashSet::new();
    let mut fresh = 0;
    for t in duplicates(&app, 12, "dup") {
        let r = t.await.unwrap();
        let b = r.assert_ok_response(200).json::<ClaimResponse>();
        lease_ids.insert(b.lease.lease_id);
        fresh += usize::from(!b.replayed);
    }
    assert_eq!(lease_ids.len(), 1, "every caller carries the winner's lease");
    assert_eq!(fresh, 1);
    assert_eq!(app.sim.exec_calls().len(), 1, "the hook ran once: no duplicate took a VM");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 3, "no other VM was touched");
    assert_eq!(app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await, 0);
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"true\"}"),
        11.0
    );
    assert_eq!(
        app.metric("poolmgr_vm_claims_total{pool_name=\"ci\",pool_namespace=\"default\",replayed=\"false\"}"),
        1.0
    );
}

/// Issue 14 item 1: duplicates arriving while the first claim's hook runs on the pool's only
/// VM. Their snapshots see no lease and no AVAILABLE VM (this used to answer 429); they wait
/// for the lease and replay it, and the hook runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_arriving_while_the_hook_runs_wait_for_its_lease() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    app.sim.set_exec_rule("reset-state", slow(600));
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the hook to start", async || app.sim.exec_running() == 1).await;
    let dups = duplicates(&app, 12, "r-1");
    let first = first.await.unwrap().assert_ok_response(200).json::<ClaimResponse>();
    assert!(!first.replayed);
    for t in dups {
        let b = t.await.unwrap().assert_ok_response(200).json::<ClaimResponse>();
        assert!(b.replayed);
        assert_eq!(b.lease, first.lease);
        assert_eq!(b.vm.id, vms[0].id);
    }
    assert_eq!(app.sim.exec_calls().len(), 1);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
}

/// Issue 14 item 1: the duplicates of a claim whose hook fails run no hook of their own and
/// take no VM; once that claim ended without a lease they answer 409 ABORTED with Retry-After
/// (the contract's "the concurrent claim that won the request_id already ended").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_of_a_claim_whose_hook_fails_are_aborted_and_run_no_hook() {
    let app = Arc::new(TestApp::spawn().await);
    hook_pool(&app, "QUARANTINE", 2).await;
    app.sim.set_exec_rule(
        "reset-state",
        ExecRule { exit_code: 3, duration: Duration::from_millis(600), ..Default::default() },
    );
    let first = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the hook to start", async || app.sim.exec_running() == 1).await;
    let dups = duplicates(&app, 4, "r-1");
    first.await.unwrap().assert_error(500, "INTERNAL");
    for t in dups {
        let r = t.await.unwrap();
        r.assert_error(409, "ABORTED");
        assert!(r.headers.get("retry-after").is_some(), "ABORTED carries Retry-After");
    }
    assert_eq!(app.sim.exec_calls().len(), 1, "the duplicates ran no hook");
    assert_eq!(app.count_phase("ci", "QUARANTINED").await, 1);
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 1, "the other VM untouched");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
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
    // Force the moment: the claim's second transaction is waiting for the row (issue 14 item
    // 15; a fixed sleep here let the delete commit first on a busy machine).
    wait_for("the claim to wait for the VM row", async || {
        app.scalar_i64(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
            == 1
    })
    .await;
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
        let taken = poolmgr_core::store::vm_claim_for_hook(&**conn, &pool("ci"), "client-a", None).await.unwrap();
        assert_eq!(taken.vm.unwrap().id, vms[0].id);
    }
    app.pass().await;
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("PRE_LEASE_HOOK_RUNNING"), "not before the timeout");
    app.advance_clock(Duration::from_secs(3600));
    app.pass().await;
    let phase = app.phase_of(&vms[0].id).await;
    assert!(phase.is_none() || phase.as_deref() == Some("DELETING"), "deleted, never handed out again: {phase:?}");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 1);
    app.claim(CLIENT_A, "ci", None).await.assert_reason(429, "RESOURCE_EXHAUSTED", "POOL_EXHAUSTED");
}

/// Issue 14 item 4: a client that disconnects while the hook claim's first transaction is in
/// flight — it commits (VM → PRE_LEASE_HOOK_RUNNING) after the client left — must not strand
/// the VM, counted as claiming, until the abandon sweep: the claim still finishes and the
/// client's retry replays its lease. The moment is forced: the test holds an uncommitted
/// claim of the same request_id on the other VM, so the first transaction waits on the
/// request_id's unique index until the test rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_gone_while_the_first_hook_transaction_commits_still_gets_its_claim_finished() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 2).await;
    let mut holder = app.db.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "UPDATE vms SET phase = 'PRE_LEASE_HOOK_RUNNING', hook_started_at = now(),
                        claim_principal = 'client-a', claim_request_id = 'r-1'
         WHERE id = $1",
        &[&vms[1].id],
    )
    .await
    .unwrap();
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the first transaction to wait", async || crate::claims::lock_waiters(&app).await == 1).await;
    claim.abort(); // the client goes away
    let _ = claim.await;
    tx.rollback().await.unwrap();
    wait_for("the detached claim to finish", async || app.phase_of(&vms[0].id).await.as_deref() == Some("LEASED"))
        .await;
    assert_eq!(app.count_phase("ci", "PRE_LEASE_HOOK_RUNNING").await, 0, "nothing stranded");
    assert_eq!(app.sim.exec_calls().len(), 1);
    let r = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(r.replayed, "the retry finds the lease the abandoned call made");
    assert_eq!(r.vm.id, vms[0].id);
    assert_eq!(app.phase_of(&vms[1].id).await.as_deref(), Some("AVAILABLE"));
}

/// Issue 14 item 4: a database error between the two transactions of a hook claim (here the
/// lease insert fails) must not leave the VM in PRE_LEASE_HOOK_RUNNING, counted as claiming,
/// for the abandon period: its hook ran to the end, so it is AVAILABLE again at once and the
/// next claim takes it.
#[tokio::test]
async fn a_database_error_between_the_hook_transactions_gives_the_vm_back() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    app.conn()
        .await
        .batch_execute(
            "CREATE FUNCTION fail_lease_insert() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$;
             CREATE TRIGGER fail_lease_insert BEFORE INSERT ON leases
                 FOR EACH ROW EXECUTE FUNCTION fail_lease_insert();",
        )
        .await
        .unwrap();
    app.claim(CLIENT_A, "ci", Some("r-1")).await.assert_error(500, "INTERNAL");
    assert_eq!(app.sim.exec_calls().len(), 1, "the hook ran");
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("AVAILABLE"), "given back, not stranded");
    assert_eq!(app.get_pool("ci").await.status.claiming, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_CLAIMED").await, 0);

    app.conn().await.batch_execute("DROP TRIGGER fail_lease_insert ON leases").await.unwrap();
    let b = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert!(!b.replayed);
    assert_eq!(b.vm.id, vms[0].id);
}

/// Issue 14 item 4: a claim's pre-lease commands share one deadline
/// (`POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS`), below the function timeout, whatever each
/// command's own limit (30 s here): the second command gets only what is left of it, and
/// past it the hook has failed (the pool's policy applies).
#[tokio::test]
async fn a_claims_pre_lease_commands_share_one_deadline() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS".into(), "1".into()))).await;
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &[], &["step-one", "step-two"], "QUARANTINE")).await.assert_ok(201);
    let vm = app.seed_available("ci", 1).await.remove(0);
    booted(&app, std::slice::from_ref(&vm)).await;
    app.sim.set_exec_rule("step-one", slow(300));
    app.sim.set_exec_rule("step-two", slow(5000));

    let r = app.claim(CLIENT_A, "ci", Some("r-1")).await;
    r.assert_reason(500, "INTERNAL", "HOOK_FAILED");
    let failed: Vec<_> = app.events("").await.events.into_iter().filter(|e| e.kind == "VM_HOOK_FAILED").collect();
    assert!(failed[0].payload["reason"].as_str().unwrap().contains("deadline"), "{:?}", failed[0].payload);
    let calls = app.sim.exec_calls();
    assert_eq!(calls.iter().map(|c| c.cmd.as_str()).collect::<Vec<_>>(), ["step-one", "step-two"]);
    assert_eq!(calls[0].timeout_seconds, 1, "the first command gets no more than the deadline");
    assert_eq!(calls[1].timeout_seconds, 1, "the second gets what is left of it, not its own 30 s");
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("QUARANTINED"));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

/// Issue 23 (finding 3's last case): a pre-lease command cut off by the claim's deadline on
/// a host that had stopped answering (hung mid-command) got the hook-failure policy, and the
/// VM was quarantined although only the host was sick. Now the claim asks the host for the
/// VM: a host that does not answer within `POOLMGR_CLAIM_VERIFY_TIMEOUT_MS` makes it a 503
/// with the VM given back, no VM_HOOK_FAILED; a host that answers (the command itself hung)
/// still gets the policy (`a_claims_pre_lease_commands_share_one_deadline`).
#[tokio::test]
async fn a_hook_cut_off_by_the_deadline_on_a_hung_host_gives_the_vm_back_instead_of_the_policy() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS".into(), "1".into()));
        env.push(("POOLMGR_CLAIM_VERIFY_TIMEOUT_MS".into(), "300".into()));
    })
    .await;
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    // The host hangs: the command never ends and GetMicroVM never answers.
    app.sim.set_exec_rule("reset-state", slow(30_000));
    app.sim.set_get_delay(Duration::from_secs(30));
    let r = app.claim(CLIENT_A, "ci", Some("hung-host")).await;
    r.assert_reason(503, "UNAVAILABLE", "FLINTLOCK_UNAVAILABLE");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("AVAILABLE"), "the VM is given back");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0, "a hung host is not a failed hook");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);

    // The host answers again: the retry with the same request_id claims.
    app.sim.clear_exec_rules();
    app.sim.set_get_delay(Duration::ZERO);
    let c = app.claimed(CLIENT_A, "ci", Some("hung-host")).await;
    assert_eq!(c.vm.id, vms[0].id);
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
    } else {
        // It fills this pool of one (issue 14 item 5): no replacement until it is discarded.
        assert_eq!(app.pass().await.created, 0);
        app.delete(ADMIN, &format!("/v1/vms/{id}")).await.assert_ok(204);
        assert!(app.sim.vm(&uid).is_none_or(|m| m.status.is_some_and(|s| s.state == MicroVmState::Deleting as i32)));
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
    r.assert_reason(500, "INTERNAL", "HOOK_FAILED");
    assert!(!r.body["error"]["message"].as_str().unwrap().contains("reset-state"), "{}", r.body);
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

/// Log lines written while the returned guard lives, on this thread (the tests run on a
/// current-thread runtime, so the request and its spawned tasks log here).
fn capture_logs() -> (std::sync::Arc<std::sync::Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
    #[derive(Clone)]
    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Sink(buf.clone());
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || sink.clone()).finish();
    (buf, tracing::subscriber::set_default(subscriber))
}

/// The sim registered again with `exec` set to `mode` (`None`: left out of the PUT).
async fn declare_exec(app: &TestApp, mode: Option<&str>) -> poolmgr_core::api::Host {
    let mut body = json!({"address": app.sim_server.addr.to_string(), "tls": {"insecure": true}});
    if let Some(m) = mode {
        body["exec"] = json!(m);
    }
    app.updated_host(SIM_HOST, body).await
}

/// Issue 14 item 17: an admin's declaration of a host's exec support overrides ServerInfo in
/// the exec gate. A ServerInfo that reads as an empty version (as a wrong guess of its
/// unpublished field numbers would) refuses hooks under `auto` and logs what ServerInfo
/// answered; declared `enabled`, the same host takes the pool without being asked and runs
/// its hooks; declared `disabled`, a host whose ServerInfo says yes refuses them; a PUT
/// without `exec` is `auto` again.
#[tokio::test]
async fn a_declared_exec_mode_overrides_server_info_in_the_exec_gate() {
    let app = TestApp::spawn().await;
    assert_eq!(app.get_host(SIM_HOST).await.exec, HostExec::Auto);
    app.sim.set_server_info("");
    let (logs, guard) = capture_logs();
    let r = app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &["setup"], &[], "QUARANTINE")).await;
    drop(guard);
    r.assert_error(400, "FAILED_PRECONDITION");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("not semver") && msg.contains(r#""exec": "enabled""#), "{msg}");
    let logs = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    let line = logs.lines().find(|l| l.contains("exec gate")).unwrap_or_else(|| panic!("no exec gate log: {logs}"));
    assert!(line.contains("server_info=") && line.contains(r#"version: """#), "ServerInfo's answer is logged: {line}");
    assert!(line.contains(&app.sim_server.addr.to_string()), "the whole answer, exec address included: {line}");

    // Declared enabled: no ServerInfo call, the pool is accepted and its create hook runs.
    assert_eq!(declare_exec(&app, Some("enabled")).await.exec, HostExec::Enabled);
    let asked = app.sim.calls(flintlock_sim::METHOD_SERVER_INFO);
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 1, &["setup"], &[], "QUARANTINE")).await.assert_ok(201);
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_SERVER_INFO), asked, "a declaration is taken as it is");
    app.settle(60, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    assert!(app.sim.exec_calls().iter().any(|c| c.cmd == "setup"), "the hook ran on the declared host");

    // Declared disabled: refused though ServerInfo says yes; pools without hooks are fine.
    app.sim.set_server_info("v0.16.0");
    assert_eq!(declare_exec(&app, Some("disabled")).await.exec, HostExec::Disabled);
    let r = app.post(ADMIN, "/v1/pools", hook_spec("web", 0, &[], &["reset"], "QUARANTINE")).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("declared disabled"), "{}", r.body);
    app.create_pool("plain", 0).await;

    // Back to auto (a PUT without exec): ServerInfo decides again, and now says yes.
    assert_eq!(declare_exec(&app, None).await.exec, HostExec::Auto);
    app.post(ADMIN, "/v1/pools", hook_spec("web", 0, &[], &["reset"], "QUARANTINE")).await.assert_ok(201);
    assert_eq!(app.get_host(SIM_HOST).await.flintlock_version.as_deref(), Some("v0.16.0"));
}

/// Issue 14 item 5: discarding a VM while a claim runs its pre-lease hook on it: the discard
/// wins (the VM is not LEASED yet), and the claim answers 409 ABORTED instead of handing out
/// a deleted VM. The hook is made slow so the DELETE lands while it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn discarding_a_vm_during_its_pre_lease_hook_aborts_that_claim() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    app.sim.set_exec_rule("reset-state", slow(1500));
    let claim = {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some("r-1")).await })
    };
    wait_for("the hook to start", async || app.sim.exec_running() == 1).await;
    assert_eq!(app.phase_of(&vms[0].id).await.as_deref(), Some("PRE_LEASE_HOOK_RUNNING"));
    app.delete(ADMIN, &format!("/v1/vms/{}", vms[0].id)).await.assert_ok(204);
    let r = claim.await.unwrap();
    r.assert_error(409, "ABORTED");
    assert_eq!(app.phase_of(&vms[0].id).await, None);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_CLAIMED").await, 0);
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0, "a discard is not a hook failure");
}

// ---------------------------------------------------------------------------------------
// Transport errors are not hook failures (issue 23 finding 3)
// ---------------------------------------------------------------------------------------

fn broken() -> ExecRule {
    ExecRule { broken: Some("injected: connection to flintlockd lost".into()), ..Default::default() }
}

/// Issue 23 finding 3, create hooks: a flintlockd restart during create hooks (every
/// command's stream breaks with UNAVAILABLE) quarantined every VM mid-hook under QUARANTINE,
/// and once the quarantined VMs filled the pool it stopped refilling. Now the step is
/// retried: no VM_HOOK_FAILED, nothing quarantined, and once flintlock is back the same VMs
/// finish their hooks and become AVAILABLE.
#[tokio::test]
async fn a_connection_broken_during_create_hooks_retries_the_step_instead_of_quarantining() {
    let app = TestApp::spawn().await;
    app.sim.set_exec_rule("setup", broken());
    app.post(ADMIN, "/v1/pools", hook_spec("ci", 3, &["setup"], &[], "QUARANTINE")).await.assert_ok(201);
    app.settle(80, "every VM's setup tried at least twice", || async {
        let mut per_uid = std::collections::HashMap::<String, usize>::new();
        for c in app.sim.exec_calls().into_iter().filter(|c| c.cmd == "setup") {
            *per_uid.entry(c.uid).or_default() += 1;
        }
        per_uid.len() == 3 && per_uid.values().all(|n| *n >= 2)
    })
    .await;
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0, "a transport error is not the hook failing");
    assert_eq!(app.count_phase("ci", "QUARANTINED").await, 0);
    let ids: Vec<String> = app
        .conn()
        .await
        .query("SELECT id FROM vms WHERE phase = 'CREATE_HOOK_RUNNING' ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids.len(), 3, "the same three VMs are still in their hooks");
    app.sim.clear_exec_rules();
    app.settle(80, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    for id in ids {
        assert_eq!(app.phase_of(&id).await.as_deref(), Some("AVAILABLE"), "{id} finished its hook");
    }
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
}

/// Issue 23 finding 3, pre-lease hooks: a claim whose hook command lost its connection to
/// flintlock answered 500 and burned its VM (quarantined or deleted). Now it answers 503
/// with Retry-After and gives the VM back; concurrent claims caught in the same blip all do,
/// none gets a lease or applies the policy, and their retries with the same request_ids
/// claim once the host answers again.
#[tokio::test]
async fn claims_whose_pre_lease_hook_loses_its_connection_answer_503_and_give_the_vm_back() {
    let app = Arc::new(TestApp::spawn().await);
    let vms = hook_pool(&app, "QUARANTINE", 4).await;
    app.sim.set_exec_rule("reset-state", broken());
    let claims = (0..4).map(|i| {
        let app = app.clone();
        tokio::spawn(async move { app.claim(CLIENT_A, "ci", Some(&format!("blip-{i}"))).await })
    });
    for r in futures::future::join_all(claims).await {
        let r = r.unwrap();
        assert_eq!(r.status.as_u16(), 503, "{}", r.body);
        assert_eq!(r.body["error"]["status"], json!("UNAVAILABLE"));
        assert!(r.headers.contains_key("retry-after"));
        assert!(r.body["error"]["message"].as_str().unwrap().contains("given back"), "{}", r.body);
    }
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 4, "every VM is back");
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    app.sim.clear_exec_rules();
    let mut got = std::collections::HashSet::new();
    for i in 0..4 {
        let c = app.claimed(CLIENT_A, "ci", Some(&format!("blip-{i}"))).await;
        assert!(!c.replayed, "nothing to replay: the first attempt got no lease");
        assert!(got.insert(c.vm.id.clone()), "one VM per request_id");
    }
    assert!(vms.iter().all(|v| got.contains(&v.id)));
}

/// Issue 23 finding 1, found by the fault campaign: a claim whose pre-lease hook found the
/// VM gone from flintlock (its host rebooted without it) applied the hook-failure policy and
/// quarantined a VM that did not exist. Now the row goes (VM_LOST), the claim answers 503 with
/// Retry-After, and its retry with the same request_id claims another VM.
#[tokio::test]
async fn a_claim_whose_vm_vanished_answers_503_and_its_retry_claims_another_vm() {
    let app = TestApp::spawn().await;
    let vms = hook_pool(&app, "QUARANTINE", 1).await;
    let gone = &vms[0];
    assert!(app.sim.remove_vm(gone.uid.as_deref().unwrap()));
    let r = app.claim(CLIENT_A, "ci", Some("vanished")).await;
    r.assert_reason(503, "UNAVAILABLE", "VM_GONE");
    assert!(r.headers.contains_key("retry-after"));
    assert!(r.body["error"]["message"].as_str().unwrap().contains("gone"), "{}", r.body);
    assert_eq!(app.phase_of(&gone.id).await, None, "the lost VM's row is gone");
    assert_eq!(app.count_events("VM_LOST").await, 1);
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
    assert_eq!(app.count_phase("ci", "QUARANTINED").await, 0);
    // The pool replaces it; the retry with the same request_id claims the new VM.
    app.settle(60, "a replacement AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    let c = app.claimed(CLIENT_A, "ci", Some("vanished")).await;
    assert_ne!(c.vm.id, gone.id);
    assert!(!c.replayed);
}
