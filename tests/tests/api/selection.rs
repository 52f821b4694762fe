//! Issue 15: a pass steps only the pools with work. The selection (`reconcile::pools_with_work`,
//! one statement) against real PostgreSQL, each kind of work on its own; overlapping passes
//! over it; creates side by side across hosts, each host bounded.

use std::sync::Arc;
use std::time::Duration;

use poolmgr_core::domain::Phase;
use poolmgr_core::reconcile;
use poolmgr_tests::*;
use serde_json::json;

/// Two pools of 2 AVAILABLE VMs each, `s` and `w`, both stepped once since their creation,
/// so neither has anything to do: the settled starting point of every selection test.
async fn two_settled_pools() -> TestApp {
    let app = TestApp::spawn().await;
    for name in ["s", "w"] {
        app.create_pool(name, 2).await;
        app.seed_available(name, 2).await;
    }
    let first = app.pass().await;
    assert_eq!((first.selected, first.pools), (2, 2), "new pools are stepped once: {first:?}");
    assert_eq!(selected(&app).await, Vec::<String>::new(), "settled pools are not selected");
    let settled = app.pass().await;
    assert_eq!((settled.selected, settled.pools, settled.created), (0, 0, 0), "{settled:?}");
    app
}

/// The names of the pools a pass starting now would step.
async fn selected(app: &TestApp) -> Vec<String> {
    let now = poolmgr_core::store::database_now(&**app.conn().await).await.unwrap();
    let pools = reconcile::pools_with_work(&app.state, now).await.expect("selection");
    pools.into_iter().map(|p| p.name).collect()
}

/// The id of one AVAILABLE VM of pool `w`.
async fn a_vm_of_w(app: &TestApp) -> String {
    app.conn()
        .await
        .query_one("SELECT id FROM vms WHERE pool_name = 'w' AND phase = 'AVAILABLE' ORDER BY id LIMIT 1", &[])
        .await
        .unwrap()
        .get(0)
}

async fn exec(app: &TestApp, sql: &str, vm: &str) {
    app.conn().await.execute(sql, &[&vm]).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[tokio::test]
async fn a_pool_below_its_size_is_selected_and_a_settled_one_is_not() {
    let app = two_settled_pools().await;
    let vm = a_vm_of_w(&app).await;
    exec(&app, "DELETE FROM vms WHERE id = $1", &vm).await;
    assert_eq!(selected(&app).await, ["w"]);
    let r = app.pass().await;
    assert_eq!((r.selected, r.pools, r.created), (1, 1, 1), "{r:?}");
}

#[tokio::test]
async fn a_pool_with_a_lease_to_expire_is_selected() {
    let app = two_settled_pools().await;
    app.claimed(CLIENT_A, "w", None).await;
    assert_eq!(selected(&app).await, Vec::<String>::new(), "a live lease is nothing to do");
    app.advance_clock(Duration::from_secs(121));
    assert_eq!(selected(&app).await, ["w"]);
    let r = app.pass().await;
    app.reset_clock();
    assert_eq!((r.pools, r.expired), (1, 1), "{r:?}");
}

#[tokio::test]
async fn a_pool_with_a_lease_to_warn_about_is_selected_once_per_deadline() {
    let app = two_settled_pools().await;
    app.claimed(CLIENT_A, "w", None).await;
    app.advance_clock(Duration::from_secs(110));
    assert_eq!(selected(&app).await, ["w"]);
    let r = app.pass().await;
    assert_eq!((r.pools, r.expiry_warnings), (1, 1), "{r:?}");
    assert_eq!(selected(&app).await, Vec::<String>::new(), "warned already");
    app.reset_clock();
}

#[tokio::test]
async fn a_pool_with_an_abandoned_claim_is_selected() {
    let app = two_settled_pools().await;
    let vm = a_vm_of_w(&app).await;
    exec(&app, "UPDATE vms SET phase = 'PRE_LEASE_HOOK_RUNNING', hook_started_at = now() WHERE id = $1", &vm).await;
    assert_eq!(selected(&app).await, Vec::<String>::new(), "a hook still running is nothing to do");
    exec(&app, "UPDATE vms SET hook_started_at = now() - interval '1 hour' WHERE id = $1", &vm).await;
    assert_eq!(selected(&app).await, ["w"]);
    app.pass().await;
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 1, "the claim was recovered");
    assert_ne!(app.phase_of(&vm).await.as_deref(), Some("PRE_LEASE_HOOK_RUNNING"));
}

#[tokio::test]
async fn a_pool_with_a_deleting_vm_is_selected_unless_it_backs_off() {
    let app = two_settled_pools().await;
    let vm = app.seed_vm("w", Phase::Deleting).await.id;
    exec(&app, "UPDATE vms SET next_attempt_at = now() + interval '1 hour' WHERE id = $1", &vm).await;
    assert_eq!(selected(&app).await, Vec::<String>::new(), "backing off");
    exec(&app, "UPDATE vms SET next_attempt_at = NULL WHERE id = $1", &vm).await;
    assert_eq!(selected(&app).await, ["w"]);
    let r = app.pass().await;
    assert_eq!(r.deleted, 1, "{r:?}");
}

#[tokio::test]
async fn a_pool_with_a_provisioning_vm_is_selected_unless_it_backs_off() {
    let app = two_settled_pools().await;
    let vm = a_vm_of_w(&app).await;
    exec(&app, "UPDATE vms SET phase = 'PROVISIONING', next_attempt_at = now() + interval '1 hour' WHERE id = $1", &vm)
        .await;
    assert_eq!(selected(&app).await, Vec::<String>::new(), "backing off");
    exec(&app, "UPDATE vms SET next_attempt_at = NULL WHERE id = $1", &vm).await;
    assert_eq!(selected(&app).await, ["w"]);
    // The seeded microVM boots after the simulator's boot delay: wait until flintlock says
    // CREATED, so the pass's poll has that answer to find (on a busy machine it may not yet).
    let (uid, host) = {
        let conn = app.conn().await;
        let uid: String = conn.query_one("SELECT uid FROM vms WHERE id = $1", &[&vm]).await.unwrap().get(0);
        (uid, poolmgr_core::store::host_get(&**conn, SIM_HOST).await.unwrap().unwrap().0.endpoint())
    };
    let t0 = std::time::Instant::now();
    loop {
        let m = app.state.flintlock.get(&host, &uid).await.unwrap().expect("the simulator knows the VM");
        if m.status.is_some_and(|s| s.state == flintlock_proto::types::micro_vm_status::MicroVmState::Created as i32) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the simulated VM never booted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = app.pass().await;
    assert_eq!(r.available, 1, "the poll found it CREATED: {r:?}");
}

#[tokio::test]
async fn a_pool_whose_spec_changed_is_selected() {
    let app = two_settled_pools().await;
    let mut spec = pool_spec("w", 2);
    spec["heartbeat_expiry_seconds"] = json!(300);
    app.put(ADMIN, "/v1/pools/default/w", spec).await.assert_ok(200);
    assert_eq!(selected(&app).await, ["w"]);
    app.pass().await;
    assert_eq!(selected(&app).await, Vec::<String>::new(), "stepped once after the change");
}

#[tokio::test]
async fn a_pool_with_surplus_vms_is_selected() {
    let app = two_settled_pools().await;
    app.seed_available("w", 1).await;
    assert_eq!(selected(&app).await, ["w"]);
    app.pass().await;
    assert_eq!(app.count_phase("w", "AVAILABLE").await, 2);
}

/// Quarantined VMs filling a pool hold it back: selected until the reason is recorded, then
/// not (nothing a step could do until an operator acts).
#[tokio::test]
async fn a_pool_held_back_by_quarantine_is_selected_only_until_that_is_recorded() {
    let app = two_settled_pools().await;
    app.conn().await.execute("UPDATE vms SET phase = 'QUARANTINED' WHERE pool_name = 'w'", &[]).await.unwrap();
    assert_eq!(selected(&app).await, ["w"]);
    app.pass().await;
    assert_eq!(app.count_events("POOL_SIZE_BELOW_TARGET").await, 1);
    assert_eq!(selected(&app).await, Vec::<String>::new(), "held back, and recorded");
}

/// Eight passes released at once over 24 pools with work: every pool filled exactly once,
/// no VM created twice, whichever pass took which pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_passes_step_each_selected_pool_once() {
    let app = Arc::new(TestApp::spawn().await);
    for i in 0..24 {
        app.create_pool(&format!("p{i}"), 2).await;
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let passes: Vec<_> = (0..8)
        .map(|_| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                app.pass().await
            })
        })
        .collect();
    let mut created = 0;
    for p in passes {
        let r = p.await.unwrap();
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        created += r.created;
    }
    assert_eq!(created, 48, "each pool's 2 VMs created by exactly one pass");
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_CREATE), 48);
    app.settle(40, "48 AVAILABLE", || async {
        app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await == 48
    })
    .await;
    for i in 0..24 {
        assert_eq!(app.scalar_i64(&format!("SELECT count(*) FROM vms WHERE pool_name = 'p{i}'")).await, 2);
    }
    assert_eq!(app.sim.calls(flintlock_sim::METHOD_CREATE), 48, "no VM created twice");
    let settled = app.pass().await;
    assert_eq!((settled.selected, settled.pools), (0, 0), "{settled:?}");
}

/// One pool of 12 on two hosts whose creates take 300 ms each: its creates run side by side,
/// at most `POOLMGR_RECONCILE_HOST_CONCURRENCY` (3) per host, and the report counts each
/// host's creates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn creates_run_side_by_side_across_hosts_each_host_bounded() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_RECONCILE_HOST_CONCURRENCY".into(), "3".into()))).await;
    let (other, _server) = app.add_sim_host("other").await;
    for sim in [&app.sim, &other] {
        sim.set_create_delay(Duration::from_millis(300));
    }
    let mut spec = pool_spec("ci", 12);
    spec["flintlock_hosts"] = json!([SIM_HOST, "other"]);
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    let r = app.pass().await;
    assert_eq!(r.created, 12, "{r:?}");
    for (name, sim) in [(SIM_HOST, &app.sim), ("other", &other)] {
        assert_eq!(sim.max_creates_in_flight(), 3, "{name}: as many at once as the bound, never more");
        // Its calls: the 6 creates and the orphan scan's list.
        let h = &r.hosts[name];
        assert_eq!((h.created, h.failed), (6, 0), "{name}: {h:?}");
        assert!(h.calls >= 6, "{name}: {h:?}");
        assert!(h.creates_per_s > 0.0);
    }
}
