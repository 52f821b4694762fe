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

// Issue 15, selection in O(work): the signals, the full checks, the watermark.

/// No full checks and no margin: what a pass selects comes from the signals alone (events
/// and pool steps since the watermark, leases and VMs due, the pools row).
fn signals_only(env: &mut Vec<(String, String)>) {
    env.push(("POOLMGR_RECONCILE_FULL_CHECKS".into(), "0".into()));
    env.push(("POOLMGR_RECONCILE_SELECTION_MARGIN_MS".into(), "0".into()));
}

/// Pools `a` to `f` and `q` of 2 AVAILABLE VMs each, REPLACE_ON_DELETE but `a`
/// (IMMEDIATE_ON_LEASE: a claim alone gives it work) and `q` (a pre-lease hook under
/// QUARANTINE), stepped once, then settled: passes select none of them.
async fn settled_signal_pools() -> TestApp {
    let app = TestApp::spawn_with(signals_only).await;
    for name in ["a", "b", "c", "d", "e", "f", "q"] {
        let mut spec = pool_spec(name, 2);
        if name == "a" {
            spec["replenishment"] = json!({"strategy": "IMMEDIATE_ON_LEASE"});
        }
        if name == "q" {
            spec["pre_lease_commands"] = json!(["reset-state"]);
            spec["hook_failure_policy"] = json!("QUARANTINE");
        }
        app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
        app.seed_available(name, 2).await;
    }
    let first = app.pass().await;
    assert_eq!(first.selected, 7, "{first:?}");
    for _ in 0..2 {
        let r = app.pass().await;
        assert_eq!((r.selected, r.pools), (0, 0), "{r:?}");
    }
    app
}

/// The next pass after a change: exactly `pool` selected and stepped.
async fn selects_exactly(app: &TestApp, pool: &str, what: &str) -> reconcile::PassReport {
    assert_eq!(selected(app).await, [pool], "{what}");
    let r = app.pass().await;
    assert_eq!((r.selected, r.pools), (1, 1), "{what}: {r:?}");
    r
}

/// Passes until one selects nothing (a step may leave work for the next one: a delete, then
/// the poll of its replacement), at most `max`.
async fn until_settled(app: &TestApp, max: usize, what: &str) {
    for _ in 0..max {
        if app.pass().await.selected == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    panic!("{what}: still selecting pools after {max} passes");
}

async fn reconcile_until(app: &TestApp, pool: &str) -> chrono::DateTime<chrono::Utc> {
    let conn = app.conn().await;
    conn.query_one("SELECT reconcile_until FROM pools WHERE name = $1", &[&pool]).await.unwrap().get(0)
}

#[tokio::test]
async fn each_kind_of_change_selects_exactly_its_pool_in_the_next_pass_and_a_settled_pool_never() {
    let app = settled_signal_pools().await;
    let f_stepped = reconcile_until(&app, "f").await;

    // A claim (IMMEDIATE_ON_LEASE: the claimed VM is replaced at once).
    let lease_a = app.claimed(CLIENT_A, "a", None).await;
    let r = selects_exactly(&app, "a", "a claim").await;
    assert_eq!(r.created, 1, "{r:?}");
    until_settled(&app, 40, "after the claim").await;
    // Released again, so the clock moved below expires no lease of a.
    app.release(CLIENT_A, &lease_a.lease.lease_id).await.assert_ok(204);
    until_settled(&app, 40, "after the release on a").await;

    // A release: the VM goes DELETING, is deleted and replaced.
    let lease = app.claimed(CLIENT_A, "b", None).await;
    assert_eq!(selected(&app).await, Vec::<String>::new(), "REPLACE_ON_DELETE: a claim alone is nothing to do");
    until_settled(&app, 5, "after the claim on b").await;
    app.release(CLIENT_A, &lease.lease.lease_id).await.assert_ok(204);
    selects_exactly(&app, "b", "a release").await;
    until_settled(&app, 40, "after the release").await;

    // An operator's forced delete of a VM.
    let vm = app.list_vms("pool=c").await.remove(0).id;
    app.delete(ADMIN, &format!("/v1/vms/{vm}")).await.assert_ok(204);
    selects_exactly(&app, "c", "a forced VM delete").await;
    until_settled(&app, 40, "after the forced delete").await;

    // A lease due: the clock alone, no row written.
    app.claimed(CLIENT_A, "d", None).await;
    until_settled(&app, 5, "after the claim on d").await;
    app.advance_clock(Duration::from_secs(121));
    let r = selects_exactly(&app, "d", "a lease due").await;
    app.reset_clock();
    assert_eq!(r.expired, 1, "{r:?}");
    until_settled(&app, 40, "after the expiry").await;

    // A spec change.
    let mut spec = pool_spec("e", 2);
    spec["heartbeat_expiry_seconds"] = json!(300);
    app.put(ADMIN, "/v1/pools/default/e", spec).await.assert_ok(200);
    selects_exactly(&app, "e", "a spec change").await;
    until_settled(&app, 5, "after the spec change").await;

    // A quarantine, by a claim whose pre-lease hook failed, outside any pass.
    wait_booted(&app, "q").await;
    app.sim.set_exec_rule("reset-state", flintlock_sim::ExecRule { exit_code: 3, ..Default::default() });
    app.claim(CLIENT_A, "q", None).await.assert_error(500, "INTERNAL");
    assert_eq!(app.count_phase("q", "QUARANTINED").await, 1);
    let r = selects_exactly(&app, "q", "a quarantine").await;
    assert_eq!(r.created, 1, "the quarantined VM is replaced: {r:?}");
    until_settled(&app, 40, "after the quarantine").await;

    assert_eq!(reconcile_until(&app, "f").await, f_stepped, "the settled pool f was never stepped again");
}

/// Waits until every simulated microVM of `pool` is CREATED (a hook needs it booted).
async fn wait_booted(app: &TestApp, pool: &str) {
    let uids: Vec<String> = app.list_vms(&format!("pool={pool}")).await.into_iter().filter_map(|v| v.uid).collect();
    let t0 = std::time::Instant::now();
    while !uids.iter().all(|u| {
        app.sim
            .vm(u)
            .and_then(|m| m.status)
            .is_some_and(|s| s.state == flintlock_proto::types::micro_vm_status::MicroVmState::Created as i32)
    }) {
        assert!(t0.elapsed() < Duration::from_secs(60), "the simulated VMs of {pool} never booted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Four settled pools, `n0` to `n3`; then one VM of `n2` quarantined by raw SQL: no signal
/// sees that (no event, no pool stepped, nothing due), yet `n2` is one VM short.
async fn a_vm_lost_without_a_signal(full_checks: &'static str) -> TestApp {
    let app = TestApp::spawn_with(|env| {
        signals_only(env);
        env.retain(|(k, _)| k != "POOLMGR_RECONCILE_FULL_CHECKS");
        env.push(("POOLMGR_RECONCILE_FULL_CHECKS".into(), full_checks.into()));
    })
    .await;
    for name in ["n0", "n1", "n2", "n3"] {
        app.create_pool(name, 2).await;
        app.seed_available(name, 2).await;
    }
    until_settled(&app, 5, "the four pools").await;
    app.pass().await;
    let vm: String = app
        .conn()
        .await
        .query_one("SELECT id FROM vms WHERE pool_name = 'n2' ORDER BY id LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    // Raw SQL: no event, no updated_at, the microVM left as it is (a deleted row would leave
    // an orphan, whose deletion by the scan writes an event).
    app.conn().await.execute("UPDATE vms SET phase = 'QUARANTINED' WHERE id = $1", &[&vm]).await.unwrap();
    app
}

/// The full checks' bound: with 1 pool checked in full per pass and 4 pools, every pool is
/// checked within 4 passes, so `n2` is refilled within 4.
#[tokio::test]
async fn a_pool_short_of_a_vm_no_signal_saw_is_refilled_within_the_full_checks_bound() {
    let app = a_vm_lost_without_a_signal("1").await;
    let mut refilled_in = None;
    for pass in 1..=4 {
        let r = app.pass().await;
        if r.created > 0 {
            assert_eq!((r.selected, r.created), (1, 1), "{r:?}");
            refilled_in = Some(pass);
            break;
        }
        assert_eq!(r.selected, 0, "{r:?}");
    }
    assert!(refilled_in.is_some(), "n2 not refilled within ceil(4 pools / 1) passes");
}

/// What the full checks are for: without them, no signal ever finds that row gone.
#[tokio::test]
async fn without_full_checks_a_pool_short_of_a_vm_no_signal_saw_stays_short() {
    let app = a_vm_lost_without_a_signal("0").await;
    for _ in 0..8 {
        let r = app.pass().await;
        assert_eq!((r.selected, r.created), (0, 0), "{r:?}");
    }
    assert_eq!(app.count_phase("n2", "AVAILABLE").await, 1);
    assert_eq!(app.count_phase("n2", "PROVISIONING").await, 0);
}

/// A transaction that changed a VM (quarantined it, its event stamped with its start) and
/// stays open across a whole pass, committing only after that pass recorded what it saw:
/// the next pass still selects the pool. No margin: the pass's horizon (the oldest open
/// transaction) alone keeps the watermark before the write.
#[tokio::test]
async fn a_vm_write_committed_after_a_pass_that_could_not_see_it_is_selected_by_the_next() {
    let app = TestApp::spawn_with(signals_only).await;
    app.create_pool("w", 2).await;
    let vms = app.seed_available("w", 2).await;
    until_settled(&app, 5, "pool w").await;

    // On the app's own login, as a function's write is: `pg_stat_activity` shows a
    // transaction's start only to its own role (`store::selection_horizon`).
    let mut conn = app.state.db.raw().get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    // What a quarantine writes: the VM's phase and its event, stamped with the transaction's start.
    tx.batch_execute(&format!(
        "UPDATE vms SET phase = 'QUARANTINED', updated_at = now() WHERE id = '{id}';
         INSERT INTO events (type, pool_namespace, pool_name, vm_id) VALUES ('VM_HOOK_FAILED', 'default', 'w', '{id}')",
        id = vms[0].id
    ))
    .await
    .unwrap();
    let during = app.pass().await;
    assert_eq!((during.selected, during.pools), (0, 0), "the write is not committed yet: {during:?}");
    let seen_through: chrono::DateTime<chrono::Utc> =
        app.conn().await.query_one("SELECT seen_through FROM reconcile_selection", &[]).await.unwrap().get(0);
    let tx_start: chrono::DateTime<chrono::Utc> = tx.query_one("SELECT now()", &[]).await.unwrap().get(0);
    assert!(seen_through <= tx_start, "the pass recorded a watermark past the open write");
    tx.commit().await.unwrap();

    let after = app.pass().await;
    assert_eq!((after.selected, after.created), (1, 1), "the late write is seen: {after:?}");
}

/// Claims and releases on 8 pools from 8 tasks while 3 passes run over and over, all
/// released at once, no full checks: the signals alone bring every pool back to its size,
/// with no VM leased twice and no microVM without its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_and_releases_racing_overlapping_passes_leave_every_pool_at_size() {
    let app = Arc::new(TestApp::spawn_with(signals_only).await);
    for i in 0..8 {
        app.create_pool(&format!("r{i}"), 3).await;
        app.seed_available(&format!("r{i}"), 3).await;
    }
    until_settled(&app, 5, "the 8 pools").await;
    let barrier = Arc::new(tokio::sync::Barrier::new(11));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let claimers: Vec<_> = (0..8)
        .map(|t| {
            let (app, barrier, done) = (app.clone(), barrier.clone(), done.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut vms = vec![];
                for k in 0..6 {
                    let r = app.claim(CLIENT_A, &format!("r{}", (t + k) % 8), None).await;
                    if r.status == 200 {
                        let c: poolmgr_core::api::ClaimResponse = r.json();
                        app.release(CLIENT_A, &c.lease.lease_id).await.assert_ok(204);
                        vms.push(c.vm.id);
                    }
                }
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                vms
            })
        })
        .collect();
    let passers: Vec<_> = (0..3)
        .map(|_| {
            let (app, barrier, done) = (app.clone(), barrier.clone(), done.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                while done.load(std::sync::atomic::Ordering::SeqCst) < 8 {
                    let r = app.pass().await;
                    assert!(r.errors.is_empty(), "{:?}", r.errors);
                }
            })
        })
        .collect();
    let mut claimed = vec![];
    for c in claimers {
        claimed.extend(c.await.unwrap());
    }
    for p in passers {
        p.await.unwrap();
    }
    assert!(!claimed.is_empty(), "some claims got VMs");
    let distinct: std::collections::HashSet<&String> = claimed.iter().collect();
    assert_eq!(distinct.len(), claimed.len(), "a VM was leased twice");
    app.settle(60, "every pool at 3 AVAILABLE and nothing else", || async {
        app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'").await == 24
            && app.scalar_i64("SELECT count(*) FROM vms").await == 24
    })
    .await;
    for i in 0..8 {
        assert_eq!(app.count_phase(&format!("r{i}"), "AVAILABLE").await, 3, "pool r{i}");
    }
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    let live = TestApp::sim_live(&app.sim);
    assert_eq!(live.len(), 24, "one microVM per row, none left behind");
    let settled = app.pass().await;
    assert_eq!((settled.selected, settled.pools), (0, 0), "{settled:?}");
}
