//! The reconcile pass against real PostgreSQL and flintlock-sim over gRPC.

use std::sync::Arc;
use std::time::Duration;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use poolmgr_core::domain::Phase;
use poolmgr_tests::*;
use serde_json::json;

async fn create_pool_with(app: &TestApp, name: &str, size: i32, replenishment: serde_json::Value, policy: &str) {
    let mut spec = pool_spec(name, size);
    spec["replenishment"] = replenishment;
    spec["hook_failure_policy"] = json!(policy);
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
}

/// Rows and simulator agree: every live sim VM has a row with its uid on its host, and
/// every row with a uid has a live sim VM.
async fn assert_no_orphans(app: &TestApp) {
    let rows = app
        .conn()
        .await
        .query("SELECT id, uid FROM vms WHERE uid IS NOT NULL AND phase <> 'DELETING'", &[])
        .await
        .unwrap();
    let live = TestApp::sim_live(&app.sim);
    let sim_uids: std::collections::HashSet<String> =
        live.iter().filter_map(|m| m.spec.as_ref()?.uid.clone()).collect();
    let row_uids: std::collections::HashSet<String> = rows.iter().map(|r| r.get::<_, String>(1)).collect();
    assert_eq!(sim_uids, row_uids, "simulator VMs and rows disagree");
    let ids: std::collections::HashSet<String> =
        live.iter().filter_map(|m| m.spec.as_ref().map(|s| s.id.clone())).collect();
    assert_eq!(ids.len(), live.len(), "a VM id was created twice in flintlock");
}

#[tokio::test]
async fn a_pool_of_five_reaches_five_available_vms_through_passes_alone() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 5).await;
    app.settle(40, "5 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 5 }).await;

    let live = TestApp::sim_live(&app.sim);
    assert_eq!(live.len(), 5);
    for m in &live {
        let spec = m.spec.as_ref().unwrap();
        assert!(spec.allow_guest_agent, "guest agent forced on");
        assert!(spec.id.starts_with("ci-"));
    }
    assert_no_orphans(&app).await;
    // Network interfaces were recorded from flintlock's status, so claims need no call.
    let nics: serde_json::Value =
        app.conn().await.query_one("SELECT network_interfaces FROM vms LIMIT 1", &[]).await.unwrap().get(0);
    assert!(nics["eth1"]["host_device_name"].as_str().is_some_and(|s| s.starts_with("fltap")), "{nics}");
    assert_eq!(app.count_events("VM_PROVISIONED").await, 5);
    assert_eq!(app.count_events("VM_AVAILABLE").await, 5);
    // Settled: another pass creates nothing.
    let r = app.pass().await;
    assert_eq!((r.created, r.available), (0, 0));
    let claim = app.claimed(CLIENT_A, "ci", Some("r")).await;
    assert!(claim.vm.network_interfaces["eth1"].is_object());
}

#[tokio::test]
async fn replace_on_delete_replaces_only_what_was_released() {
    let app = TestApp::spawn().await;
    create_pool_with(&app, "ci", 3, json!({"strategy": "REPLACE_ON_DELETE"}), "DELETE_AND_REPLACE").await;
    app.settle(40, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    let lease = app.claimed(CLIENT_A, "ci", None).await.lease.lease_id;
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2, "a claim alone creates nothing");
    app.release(CLIENT_A, &lease).await.assert_ok(204);
    app.settle(40, "replacement", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    assert_eq!(TestApp::sim_live(&app.sim).len(), 3);
}

#[tokio::test]
async fn immediate_on_lease_replaces_a_claimed_vm_at_once() {
    let app = TestApp::spawn().await;
    create_pool_with(&app, "ci", 3, json!({"strategy": "IMMEDIATE_ON_LEASE"}), "DELETE_AND_REPLACE").await;
    app.settle(40, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    app.settle(40, "3 AVAILABLE + 2 LEASED", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    assert_eq!(app.count_phase("ci", "LEASED").await, 2);
    assert_eq!(TestApp::sim_live(&app.sim).len(), 5, "leased VMs are extra");
}

#[tokio::test]
async fn min_size_threshold_provisions_only_below_min_size() {
    let app = TestApp::spawn().await;
    create_pool_with(&app, "ci", 4, json!({"strategy": "MIN_SIZE_THRESHOLD", "min_size": 2}), "DELETE_AND_REPLACE")
        .await;
    app.settle(40, "fresh pool topped up", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
    let mut leases = vec![];
    for _ in 0..3 {
        leases.push(app.claimed(CLIENT_A, "ci", None).await.lease.lease_id);
    }
    // 1 available < min 2, but 1 + 3 leased = size: nothing to add.
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 1);
    app.release(CLIENT_A, &leases[0]).await.assert_ok(204);
    app.release(CLIENT_A, &leases[1]).await.assert_ok(204);
    // 1 available < 2 and 1 + 1 leased < 4: top up by 2.
    app.settle(40, "topped up below min_size", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 3, "at or above min_size nothing more is added");
}

#[tokio::test]
async fn an_abandoned_lease_expires_and_its_vm_is_deleted_in_flintlock() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    let uid = app.claimed(CLIENT_A, "ci", Some("r-1")).await.vm.uid;
    // Move time instead of sleeping: the holder stopped heartbeating long ago.
    app.advance_clock(Duration::from_secs(121));
    let r = app.pass().await;
    app.reset_clock();
    assert_eq!(r.expired, 1);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_DELETED_DUE_TO_EXPIRY").await, 1);
    assert_eq!(
        app.metric("poolmgr_vm_releases_total{pool_name=\"ci\",pool_namespace=\"default\",reason=\"expiry\"}"),
        1.0
    );
    app.settle(40, "expired VM gone from flintlock", || async {
        app.sim.vm(&uid).is_none_or(|m| m.status.is_some_and(|s| s.state == MicroVmState::Deleting as i32))
    })
    .await;
    // The request_id is free again, and the pool was replenished.
    app.settle(40, "replacement", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    assert!(!app.claimed(CLIENT_A, "ci", Some("r-1")).await.replayed);
}

#[tokio::test]
async fn expiring_soon_is_written_once_per_deadline() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let lease = app.claimed(CLIENT_A, "ci", None).await.lease.lease_id;
    // 110 s on, the deadline (120 s after the claim) is 10 s away: inside the warning window.
    let to_the_window = Duration::from_secs(110);
    app.advance_clock(to_the_window);
    app.pass().await;
    app.pass().await;
    assert_eq!(app.count_events("VM_EXPIRING_SOON").await, 1, "once per deadline");
    // A heartbeat moves the deadline out of the window: no warning.
    app.heartbeat(CLIENT_A, &lease).await.assert_ok(200);
    app.pass().await;
    assert_eq!(app.count_events("VM_EXPIRING_SOON").await, 1);
    // A new deadline inside the window warns again.
    app.advance_clock(to_the_window);
    app.pass().await;
    assert_eq!(app.count_events("VM_EXPIRING_SOON").await, 2);
}

#[tokio::test]
async fn a_lost_create_reply_is_adopted_not_orphaned() {
    let app = TestApp::spawn().await;
    app.sim.lose_create_replies(2);
    app.create_pool("ci", 3).await;
    app.settle(60, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(TestApp::sim_live(&app.sim).len(), 3, "exactly size VMs in flintlock");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 3, "exactly size rows");
    assert_eq!(app.count_events("VM_ADOPTED").await, 2);
    assert_no_orphans(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_passes_fill_every_pool_exactly_once() {
    let app = Arc::new(TestApp::spawn().await);
    for i in 0..10 {
        app.create_pool(&format!("p{i}"), 3).await;
    }
    for _ in 0..30 {
        let passes: Vec<_> = (0..4)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { app.pass().await })
            })
            .collect();
        for p in passes {
            p.await.unwrap();
        }
        if app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await == 30 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    for i in 0..10 {
        assert_eq!(app.count_phase(&format!("p{i}"), "AVAILABLE").await, 3, "pool p{i}");
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 30);
    assert_eq!(TestApp::sim_live(&app.sim).len(), 30, "no VM created twice");
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_CREATE), 30);
    assert_no_orphans(&app).await;
}

#[tokio::test]
async fn create_errors_back_off_then_succeed() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_RECONCILE_BACKOFF_MS".into(), "300".into()))).await;
    app.sim.fail_creates(3);
    app.create_pool("ci", 2).await;
    let first = app.pass().await;
    assert!(!first.errors.is_empty(), "the failures are reported");
    let attempts = app.scalar_i64("SELECT coalesce(max(attempts), 0)::bigint FROM vms").await;
    assert!(attempts >= 1, "failed creates are counted for backoff");
    let backed_off = app.scalar_i64("SELECT count(*) FROM vms WHERE next_attempt_at > now()").await;
    assert!(backed_off >= 1, "a failed VM waits before its next attempt");
    let creates = app.sim.calls(flintlock_sim::METHOD_CREATE);
    app.pass().await;
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_CREATE), creates, "no retry before the backoff delay");
    app.settle(80, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    assert_no_orphans(&app).await;
}

#[tokio::test]
async fn vms_ending_failed_are_deleted_and_replaced_under_delete_and_replace() {
    let app = TestApp::spawn().await;
    app.sim.set_vms_end_failed(true);
    create_pool_with(&app, "ci", 2, json!({"strategy": "REPLACE_ON_DELETE"}), "DELETE_AND_REPLACE").await;
    app.settle(40, "failures seen", || async { app.count_events("VM_HOOK_FAILED").await >= 2 }).await;
    app.sim.set_vms_end_failed(false);
    app.settle(60, "2 AVAILABLE", || async {
        app.count_phase("ci", "AVAILABLE").await == 2 && app.count_phase("ci", "DELETING").await == 0
    })
    .await;
    for _ in 0..2 {
        app.pass().await;
    }
    assert_eq!(TestApp::sim_live(&app.sim).len(), 2, "failed microVMs were deleted, not orphaned");
    assert_no_orphans(&app).await;
}

/// A VM that ends FAILED is kept under QUARANTINE. Since issue 14 item 5 it also fills this
/// pool of size 1, so the pool gets no replacement until an operator discards it.
#[tokio::test]
async fn vms_ending_failed_are_kept_under_quarantine() {
    let app = TestApp::spawn().await;
    app.sim.set_vms_end_failed(true);
    create_pool_with(&app, "ci", 1, json!({"strategy": "REPLACE_ON_DELETE"}), "QUARANTINE").await;
    app.settle(40, "quarantined", || async { app.count_phase("ci", "QUARANTINED").await >= 1 }).await;
    app.sim.set_vms_end_failed(false);
    for _ in 0..3 {
        assert_eq!(app.pass().await.created, 0, "quarantined VMs fill the pool: no replacement");
    }
    let quarantined = app.list_vms("phase=QUARANTINED").await;
    assert_eq!(quarantined.len(), 1);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 1);
    assert!(app.sim.vm(quarantined[0].uid.as_deref().unwrap()).is_some(), "a quarantined VM is kept for inspection");
    assert_eq!(app.get_pool("ci").await.status.quarantined, 1);

    app.delete(ADMIN, &format!("/v1/vms/{}", quarantined[0].id)).await.assert_ok(204);
    app.settle(60, "replacement AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
}

/// The POOL_SIZE_BELOW_TARGET events: their payloads, in order.
async fn below_target_events(app: &TestApp) -> Vec<serde_json::Value> {
    app.conn()
        .await
        .query("SELECT payload FROM events WHERE type = 'POOL_SIZE_BELOW_TARGET' ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Issue 14 item 5: a QUARANTINE pool whose create hook always fails stays bounded. Once its
/// quarantined VMs number its size, pass after pass creates nothing (before, every pass
/// replaced every failure until the host ran out of memory), and POOL_SIZE_BELOW_TARGET says
/// why exactly once, not every pass. Once the hook is fixed and the operator discards the
/// quarantined VMs (DELETE /v1/vms/{id}), the pool fills again and the reason is cleared.
#[tokio::test]
async fn a_quarantine_pool_whose_hook_always_fails_stops_replenishing_at_its_size() {
    let app = TestApp::spawn().await;
    app.sim.set_exec_exit_code("setup", 3);
    let mut spec = pool_spec("ci", 2);
    spec["create_commands"] = json!(["setup"]);
    spec["hook_failure_policy"] = json!("QUARANTINE");
    app.created_pool(spec).await;
    app.settle(80, "2 quarantined", || async { app.count_phase("ci", "QUARANTINED").await >= 2 }).await;

    // Held from here on: nothing is created, however many passes run.
    let creates = app.sim.calls(flintlock_sim::METHOD_CREATE);
    for _ in 0..8 {
        let r = app.pass().await;
        assert_eq!(r.created, 0, "no replacement once quarantined >= size: {r:?}");
    }
    // A VM in flight when the bound was reached finishes its hook (quarantined too).
    app.settle(40, "nothing in flight", || async {
        app.scalar_i64("SELECT count(*) FROM vms WHERE phase <> 'QUARANTINED'").await == 0
    })
    .await;
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_CREATE), creates);
    let quarantined = app.list_vms("phase=QUARANTINED").await;
    assert!((2..=3).contains(&quarantined.len()), "at most size + (size - 1): {quarantined:?}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, quarantined.len() as i64);
    assert_eq!(creates, quarantined.len());
    let events = below_target_events(&app).await;
    assert_eq!(events.len(), 1, "once per state change, not every pass: {events:?}");
    assert!(events[0]["reason"].as_str().unwrap().starts_with("quarantined VMs fill the pool"), "{events:?}");
    assert_eq!(events[0]["size"], json!(2));
    assert!(events[0]["quarantined"].as_i64().unwrap() >= 2, "{events:?}");
    assert_eq!(app.get_pool("ci").await.status.quarantined, quarantined.len() as i64);

    // Fixed, then discarded: replenishment resumes and nothing holds the pool back any more.
    app.sim.clear_exec_rules();
    for vm in &quarantined {
        app.delete(ADMIN, &format!("/v1/vms/{}", vm.id)).await.assert_ok(204);
    }
    app.settle(80, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    assert_eq!(app.count_events("VM_DISCARDED").await, quarantined.len() as i64);
    let reason = app.conn().await.query_one("SELECT below_target_reason FROM pools", &[]).await.unwrap();
    assert_eq!(reason.get::<_, Option<String>>(0), None);
    assert_eq!(below_target_events(&app).await.len(), 1, "clearing the reason writes no event");
}

#[tokio::test]
async fn a_failing_delete_stays_deleting_and_is_retried() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    let c = app.claimed(CLIENT_A, "ci", None).await;
    app.sim.fail_deletes(u32::MAX);
    app.release(CLIENT_A, &c.lease.lease_id).await.assert_error(503, "UNAVAILABLE");
    let vm_id = c.vm.id;
    app.pass().await;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    app.pass().await;
    assert_eq!(app.phase_of(&vm_id).await.as_deref(), Some("DELETING"), "stays DELETING while flintlock fails");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1, "the release's lease waits for the delete");
    assert!(app.scalar_i64(&format!("SELECT attempts::bigint FROM vms WHERE id = '{vm_id}'")).await >= 1);
    app.sim.reset_faults();
    app.settle(40, "delete finished", || async { app.phase_of(&vm_id).await.is_none() }).await;
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1, "the reconciler finished the release");
}

#[tokio::test]
async fn an_unavailable_host_does_not_stop_provisioning_on_the_others() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_PROVISION_MAX_ATTEMPTS".into(), "2".into()))).await;
    let (down, _down_server) = app.add_sim_host("down").await;
    down.set_unavailable(true);
    let mut spec = pool_spec("ci", 4);
    spec["flintlock_hosts"] = json!(["down", SIM_HOST]);
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    app.settle(60, "4 AVAILABLE on the healthy host", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'sim' AND phase = 'AVAILABLE'").await,
        4
    );
    assert_eq!(TestApp::sim_live(&app.sim).len(), 4);
}

#[tokio::test]
async fn a_cordoned_host_gets_no_new_vms_and_keeps_its_own() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    let existing = app.seed_vm("ci", Phase::Available).await;
    app.post(ADMIN, &format!("/v1/hosts/{SIM_HOST}/cordon"), json!({"reason": "maintenance"})).await.assert_ok(200);
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 1, "no placement on a cordoned host");
    assert_eq!(app.phase_of(&existing.id).await.as_deref(), Some("AVAILABLE"), "existing VMs untouched");
    // Issue 14 item 5: POOL_SIZE_BELOW_TARGET once per state change, not once per pass.
    let events = below_target_events(&app).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["reason"], json!("no eligible flintlock host"));
    app.post(ADMIN, &format!("/v1/hosts/{SIM_HOST}/uncordon"), json!({})).await.assert_ok(200);
    app.settle(40, "3 AVAILABLE after uncordon", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
}

#[tokio::test]
async fn orphans_are_deleted_and_foreign_namespaces_left_alone() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    let ns = app.flintlock_namespace("default").await;
    let ghost = app.sim.insert_vm(&ns, "ci-01jzzzzzzzzzzzzzzzzzzzzzzz", MicroVmState::Created);
    let foreign = app.sim.insert_vm("team-x", "ci-01jyyyyyyyyyyyyyyyyyyyyyyy", MicroVmState::Created);
    let r = app.pass().await;
    assert_eq!(r.orphans_deleted, 1);
    assert!(app.sim.vm(&ghost).is_none_or(|m| m.status.is_some_and(|s| s.state == MicroVmState::Deleting as i32)));
    assert!(app.sim.vm(&foreign).is_some_and(|m| m.status.is_some_and(|s| s.state == MicroVmState::Created as i32)));
    assert_eq!(app.count_events("VM_ORPHAN_DELETED").await, 1);
    assert_eq!(
        app.metric("poolmgr_orphans_total{action=\"deleted\",pool_name=\"ci\",pool_namespace=\"default\"}"),
        1.0
    );
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 1, "the pool's own VM is not an orphan");
}

/// Issue 25 item 11: one flintlockd registered under two host records (two addresses). The
/// scan of the record without the pool's rows lists the pool's VMs too; their uids are on
/// rows of the other record, so they are the same VMs, never orphans. A real orphan on that
/// flintlockd is still deleted.
#[tokio::test]
async fn one_flintlockd_under_two_host_records_never_has_its_vms_taken_for_orphans() {
    let app = TestApp::spawn().await;
    let alias = format!("localhost:{}", app.sim_server.addr.port());
    app.post(ADMIN, "/v1/hosts", json!({"name": "sim-alias", "address": alias, "tls": {"insecure": true}}))
        .await
        .assert_ok(201);
    app.create_pool("ci", 2).await;
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    // The suite scans every host on every pass (POOLMGR_ORPHAN_SCAN_SECONDS=0).
    for _ in 0..3 {
        let r = app.pass().await;
        assert_eq!(r.orphans_deleted, 0, "{r:?}");
    }
    assert_eq!(app.count_events("VM_ORPHAN_DELETED").await, 0);
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2);
    assert_eq!(TestApp::sim_live(&app.sim).len(), 2, "no VM of the pool was deleted");

    let ns = app.flintlock_namespace("default").await;
    let ghost = app.sim.insert_vm(&ns, "ci-01jzzzzzzzzzzzzzzzzzzzzzzz", MicroVmState::Created);
    let r = app.pass().await;
    assert_eq!(r.orphans_deleted, 1, "{r:?}");
    assert!(app.sim.vm(&ghost).is_none_or(|m| m.status.is_some_and(|s| s.state == MicroVmState::Deleting as i32)));
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2);
}

#[tokio::test]
async fn a_deleted_pools_stragglers_are_finished_by_the_pass() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    app.sim.fail_deletes(u32::MAX);
    app.delete(ADMIN, "/v1/pools/default/ci").await.assert_ok(204);
    assert_eq!(app.count_phase("ci", "DELETING").await, 2);
    app.sim.reset_faults();
    app.settle(40, "stragglers deleted", || async { app.scalar_i64("SELECT count(*) FROM vms").await == 0 }).await;
    app.settle(40, "gone from flintlock", || async { TestApp::sim_live(&app.sim).is_empty() }).await;
}

/// Issue 22 item 1: one scheduled invocation no longer stops after one step per VM: it keeps
/// passing while the VMs it created boot, and returns with the pool filled.
#[tokio::test]
async fn the_scheduled_event_decodes_and_runs_a_loop_that_fills_the_pool() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    let raw = include_str!("../../../functions/reconcile/events/scheduled.json");
    let event: aws_lambda_events::eventbridge::EventBridgeEvent<serde_json::Value> = serde_json::from_str(raw).unwrap();
    assert_eq!(event.detail_type, "Scheduled Event");
    let payload: serde_json::Value = serde_json::from_str(raw).unwrap();
    let report =
        reconcile_fn::handle(&app.state, lambda_runtime::LambdaEvent::new(payload, Default::default())).await.unwrap();
    assert_eq!(report.total.created, 2);
    assert_eq!(report.total.available, 2, "{report:?}");
    assert!(report.passes >= 2, "created in one pass, found booted in a later one: {report:?}");
    assert!(!report.joined && !report.handed_on, "{report:?}");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2);
}

#[tokio::test]
async fn a_pool_whose_size_goes_down_sheds_available_vms() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.settle(40, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    app.put(ADMIN, "/v1/pools/default/ci", pool_spec("ci", 1)).await.assert_ok(200);
    app.settle(40, "shrunk", || async {
        app.count_phase("ci", "AVAILABLE").await == 0 && app.scalar_i64("SELECT count(*) FROM vms").await == 1
    })
    .await;
    assert_eq!(app.count_phase("ci", "LEASED").await, 1, "the leased VM is kept");
    assert_eq!(app.count_events("VM_DELETED_ON_SCALE_DOWN").await, 2);
    app.settle(40, "gone from flintlock", || async { TestApp::sim_live(&app.sim).len() == 1 }).await;
}

/// A size that falls while VMs boot never sheds a ready VM for one still booting: counted
/// with the booting ones, the pool shed the AVAILABLE VMs, kept the booting ones, and the next
/// claims found none. The AVAILABLE ones beyond the size still go; a PROVISIONING one never.
#[tokio::test]
async fn a_size_that_falls_while_vms_boot_keeps_the_ready_ones() {
    let app = TestApp::spawn().await;
    let spec = |size: i32| {
        let mut s = pool_spec("ci", size);
        s["replenishment"]["strategy"] = json!("IMMEDIATE_ON_LEASE");
        s
    };
    app.created_pool(spec(4)).await;
    app.settle(40, "4 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
    // The replacements of two claims boot for an hour: the moment is held, not caught.
    app.sim.set_boot_delay(Duration::from_secs(3600));
    for _ in 0..2 {
        app.claim(CLIENT_A, "ci", None).await.assert_ok(200);
    }
    app.settle(40, "2 replacements booting", || async { app.count_phase("ci", "PROVISIONING").await == 2 }).await;
    // Size 2: 2 ready and 2 booting. The ready ones stay.
    app.put(ADMIN, "/v1/pools/default/ci", spec(2)).await.assert_ok(200);
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2, "no ready VM shed for a booting one");
    assert_eq!(app.count_phase("ci", "PROVISIONING").await, 2);
    assert_eq!(app.count_events("VM_DELETED_ON_SCALE_DOWN").await, 0);
    // Size 1: one ready VM beyond it goes; the booting ones are never taken.
    app.put(ADMIN, "/v1/pools/default/ci", spec(1)).await.assert_ok(200);
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    assert_eq!(app.count_phase("ci", "PROVISIONING").await, 2, "booting VMs are never shed");
    assert_eq!(app.count_phase("ci", "LEASED").await, 2);
    assert_eq!(app.count_events("VM_DELETED_ON_SCALE_DOWN").await, 1);
}

/// Passes provisioning a pool race its forced delete: whatever the interleaving, no VM row
/// outlives the pool and no microVM is left in flintlock once passes settle.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_deleted_while_passes_provision_it_leaves_nothing_behind() {
    let app = Arc::new(TestApp::spawn().await);
    for round in 0..6u64 {
        let name = format!("r{round}");
        app.create_pool(&name, 8).await;
        let passes: Vec<_> = (0..2)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { app.pass().await })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(round * 4)).await;
        app.delete(ADMIN, &format!("/v1/pools/default/{name}?force=true")).await.assert_ok(204);
        for p in passes {
            p.await.unwrap();
        }
    }
    app.settle(80, "every row gone", || async { app.scalar_i64("SELECT count(*) FROM vms").await == 0 }).await;
    app.settle(80, "every microVM gone", || async { TestApp::sim_live(&app.sim).is_empty() }).await;
    assert_eq!(app.scalar_i64("SELECT count(*) FROM pools").await, 0);
}

/// On Lambda the pool has one connection while a pass steps up to 8 pools at once and calls
/// flintlock while stepping them. No step may hold that connection while it waits for
/// anything else: here every create-hook command outlasts the 1 s wait for a connection, so
/// a step holding it through the command would fail the other pools' steps. Plain pools,
/// hooked pools and a shrink (DELETING VMs finished through the teardown) all settle on one
/// connection without a single step error.
#[tokio::test]
async fn a_pass_on_one_connection_steps_many_pools_without_any_waiting_for_it() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_DB_POOL_SIZE".into(), "1".into()));
        env.push(("POOLMGR_DB_CONNECT_TIMEOUT_SECONDS".into(), "1".into()));
    })
    .await;
    assert_eq!(app.state.config.reconcile.concurrency, 8, "more workers than connections");
    app.sim.set_exec_rule(
        "prepare",
        flintlock_sim::ExecRule { duration: std::time::Duration::from_millis(1500), ..Default::default() },
    );
    let plain = ["p0", "p1", "p2", "p3"];
    let hooked = ["h0", "h1"];
    for name in plain {
        app.create_pool(name, 2).await;
    }
    for name in hooked {
        let mut spec = pool_spec(name, 2);
        spec["create_commands"] = json!(["prepare"]);
        app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    }

    let pass_without_errors = || async {
        let errors = app.pass().await.errors;
        assert!(errors.is_empty(), "a step waited for the connection: {errors:?}");
    };
    let mut settled = false;
    for _ in 0..60 {
        pass_without_errors().await;
        let mut full = true;
        for name in plain.iter().chain(&hooked) {
            full &= app.count_phase(name, "AVAILABLE").await == 2;
        }
        if full {
            settled = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    assert!(settled, "the pools did not fill on one connection");

    app.put(ADMIN, "/v1/pools/default/p0", pool_spec("p0", 1)).await.assert_ok(200);
    for _ in 0..40 {
        pass_without_errors().await;
        if app.scalar_i64("SELECT count(*) FROM vms WHERE pool_name = 'p0'").await == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    assert_eq!(app.count_phase("p0", "AVAILABLE").await, 1, "the surplus VM was deleted");
    assert_eq!(app.count_events("VM_DELETED_ON_SCALE_DOWN").await, 1);
    assert_no_orphans(&app).await;
}

// ---------------------------------------------------------------------------------------
// Hosts that stop answering (issue 14 item 7)
// ---------------------------------------------------------------------------------------

/// Inserts a VM row of pool default/`pool` on host `host` in `phase`, with a uid flintlock
/// never saw (the host cannot be asked anyway).
async fn row_on(app: &TestApp, pool: &str, host: &str, phase: Phase) -> String {
    let id = poolmgr_core::reconcile::new_vm_id(pool);
    app.insert_vm_row(pool, &id, host, phase, Some(&ulid::Ulid::generate().to_string())).await;
    id
}

/// Issue 14 item 7: a host whose address is a listener that never answers (the kernel
/// accepts the TCP connection, nobody ever reads it: every call runs into the 3 s flintlock
/// timeout). Two pools each have two DELETING and one PROVISIONING VM on it. Stepped one at a
/// time, the six calls took 18 s, the pass's 8 s deadline ran out and replenishment never
/// ran, every pass. Now the first failure marks the host sick for the rest of the pass and
/// every other VM on it is skipped (one call to it per pass: at most one at a time, by
/// `POOLMGR_RECONCILE_HOST_CONCURRENCY`=1, so the second pool's call waits for the first
/// and then finds the host sick), and each pool's replenishment runs beside its VM steps:
/// both pools get their missing VM on the healthy host in this very pass.
///
/// Within this one pass the rows on the silent host still count (it is not judged dead
/// yet: `POOLMGR_HOST_DEAD_SECONDS`, 30); `faults::a_dead_hosts_rows_stop_counting…` covers
/// what happens once it is (issue 23 finding 2).
#[tokio::test]
async fn a_host_that_never_answers_costs_one_timeout_and_does_not_stall_replenishment() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_RECONCILE_DEADLINE_SECONDS".into(), "8".into()));
        env.push(("POOLMGR_RECONCILE_HOST_CONCURRENCY".into(), "1".into()));
    })
    .await;
    assert_eq!(app.state.config.flintlock_timeout, Duration::from_secs(3));
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    app.created_host(
        json!({"name": "silent", "address": silent.local_addr().unwrap().to_string(), "tls": {"insecure": true}}),
    )
    .await;
    let mut on_silent = vec![];
    for pool in ["a", "b"] {
        let mut spec = pool_spec(pool, 2);
        spec["flintlock_hosts"] = json!(["silent", SIM_HOST]);
        app.created_pool(spec).await;
        on_silent.push(row_on(&app, pool, "silent", Phase::Deleting).await);
        on_silent.push(row_on(&app, pool, "silent", Phase::Deleting).await);
        on_silent.push(row_on(&app, pool, "silent", Phase::Provisioning).await);
    }

    let started = std::time::Instant::now();
    let report = app.pass().await;
    let took = started.elapsed();
    assert!(!report.deadline_reached, "the deadline ran out after {took:?}: {report:?}");
    assert_eq!(report.created, 2, "each pool got its missing VM in this pass: {report:?}");
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'sim' AND phase = 'PROVISIONING'").await,
        2,
        "the new VMs are on the healthy host"
    );
    let tried = app.scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'silent' AND attempts > 0").await;
    assert_eq!(tried, 1, "one call to the silent host; its other VMs were skipped");
    assert_eq!(report.skipped, 6, "its five other VMs and its orphan scan: {report:?}");
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'silent'").await,
        6,
        "nothing on the silent host was given up on"
    );
    drop(silent);
}

// ---------------------------------------------------------------------------------------
// Deployments sharing hosts (issue 14 item 9)
// ---------------------------------------------------------------------------------------

/// Issue 14 item 9: two poolmgr deployments (two databases) share one flintlockd, each with
/// a pool of the same name (default/ci), one VM of each leased. Every pass of either scans
/// the shared host for orphans. Each deployment's VMs live in a flintlock namespace carrying
/// its deployment id, and a scan deletes only microVMs it can attribute to its own
/// deployment: neither deletes the other's VMs, leased ones included. A microVM in the
/// namespace poolmgr used before deployment ids (`poolmgr-default`, no row anywhere) cannot
/// be attributed either, and is left alone.
#[tokio::test]
async fn two_deployments_sharing_a_host_never_delete_each_others_vms() {
    let a = TestApp::spawn().await;
    let b = TestApp::spawn().await;
    // B registers A's simulator as its host `shared`.
    b.created_host(json!({"name": "shared", "address": a.sim_server.addr.to_string(), "tls": {"insecure": true}}))
        .await;
    a.create_pool("ci", 2).await;
    let mut spec = pool_spec("ci", 2);
    spec["flintlock_hosts"] = json!(["shared"]);
    b.created_pool(spec).await;
    let unattributable = a.sim.insert_vm("poolmgr-default", "ci-01jxxxxxxxxxxxxxxxxxxxxxxx", MicroVmState::Created);
    for _ in 0..40 {
        a.pass().await;
        b.pass().await;
        if a.count_phase("ci", "AVAILABLE").await == 2 && b.count_phase("ci", "AVAILABLE").await == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(
        (a.count_phase("ci", "AVAILABLE").await, b.count_phase("ci", "AVAILABLE").await),
        (2, 2),
        "both pools filled on the shared host (VM_ORPHAN_DELETED: A {}, B {})",
        a.count_events("VM_ORPHAN_DELETED").await,
        b.count_events("VM_ORPHAN_DELETED").await
    );
    let (da, db) = (a.state.deployment().await.unwrap(), b.state.deployment().await.unwrap());
    assert_ne!(da.id(), db.id(), "each database has its own deployment id");
    let la = a.claimed(CLIENT_A, "ci", Some("r-a")).await;
    let lb = b.claimed(CLIENT_A, "ci", Some("r-b")).await;
    for _ in 0..5 {
        let (ra, rb) = (a.pass().await, b.pass().await);
        assert_eq!((ra.orphans_deleted, rb.orphans_deleted), (0, 0), "A: {ra:?}\nB: {rb:?}");
    }
    for (app, lease) in [(&a, &la), (&b, &lb)] {
        assert_eq!(app.count_phase("ci", "AVAILABLE").await, 1);
        assert_eq!(app.count_phase("ci", "LEASED").await, 1);
        app.heartbeat(CLIENT_A, &lease.lease.lease_id).await.assert_ok(200);
        assert_eq!(app.count_events("VM_ORPHAN_DELETED").await, 0);
        let uids: Vec<String> =
            app.conn().await.query("SELECT uid FROM vms", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let live = TestApp::sim_live_uids(&a.sim);
        for uid in &uids {
            assert!(live.contains(uid), "VM {uid} of a deployment was deleted in flintlock");
        }
    }
    assert!(TestApp::sim_live_uids(&a.sim).contains(&unattributable), "a VM no deployment can claim was deleted");
    assert_eq!(TestApp::sim_live_uids(&a.sim).len(), 5);
}

/// Issue 14 item 7: a pass places a pool's new VMs beside its VM steps, so before those
/// could find a dead host dead again; the host found unreachable by an earlier pass gets no
/// new VMs for a while (`hosts.unreachable_until`, the backoff cap). Forced: pool `a`'s first
/// VM lands on `down` (listed first, equally loaded) and fails; its retry is backed off past
/// the next pass, so nothing in that pass calls `down` before pool `b` places its VM, which
/// would otherwise go to `down` too. Once `down` answers again, the mark goes.
#[tokio::test]
async fn a_host_found_unreachable_gets_no_new_vms_in_the_next_pass() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_RECONCILE_BACKOFF_MS".into(), "60000".into()));
        env.push(("POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS".into(), "120".into()));
    })
    .await;
    let (down, _down_server) = app.add_sim_host("down").await;
    down.set_unavailable(true);
    for pool in ["a", "b"] {
        let mut spec = pool_spec(pool, 1);
        spec["flintlock_hosts"] = json!(["down", SIM_HOST]);
        app.created_pool(spec).await;
        let r = app.pass().await;
        assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, if pool == "a" { 1 } else { 2 }, "{r:?}");
    }
    let host_of = |pool: &'static str| {
        let app = &app;
        async move {
            let row = app.conn().await.query_one("SELECT flintlock_host FROM vms WHERE pool_name = $1", &[&pool]).await;
            row.unwrap().get::<_, String>(0)
        }
    };
    assert_eq!(host_of("a").await, "down", "the first placement, before anyone knew");
    assert_eq!(host_of("b").await, SIM_HOST, "the next pass did not place on the unreachable host");
    assert_eq!(down.calls(flintlock_sim::METHOD_CREATE), 1, "one create reached the dead host");

    // Back: the next call that reaches it (the pass's orphan scan) lifts the mark.
    down.set_unavailable(false);
    let marked = "SELECT count(*) FROM hosts WHERE name = 'down' AND unreachable_until IS NOT NULL";
    assert_eq!(app.scalar_i64(marked).await, 1);
    app.pass().await;
    assert_eq!(app.scalar_i64(marked).await, 0, "a host that answers again takes new VMs again");
}
