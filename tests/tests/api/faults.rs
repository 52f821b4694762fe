//! Faults a fleet meets every week (issue 23): microVMs that vanish behind poolmgr's back,
//! hosts that die or hang, network blips during hooks, cleanup under load. Each test names
//! the finding it covers and fails without its fix.

use std::collections::HashSet;
use std::sync::Arc;

use poolmgr_core::domain::Phase;
use poolmgr_tests::*;

/// The uid of each of the pool's VMs in `phase`, by id.
async fn uids_in(app: &TestApp, pool: &str, phase: &str) -> Vec<(String, String)> {
    let conn = app.conn().await;
    let rows = conn
        .query(
            "SELECT id, uid FROM vms WHERE pool_name = $1 AND phase = $2 AND uid IS NOT NULL ORDER BY id",
            &[&pool, &phase],
        )
        .await
        .unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// The VMs a VM_LOST event names.
async fn lost_vms(app: &TestApp) -> HashSet<String> {
    let rows = app.conn().await.query("SELECT vm_id FROM events WHERE type = 'VM_LOST'", &[]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// Pool default/ci filled to 8 AVAILABLE VMs, then every other one's microVM removed from the
/// simulator behind poolmgr's back: the ids of the VMs whose microVM is gone.
async fn eight_available_half_lost(app: &TestApp) -> HashSet<String> {
    app.create_pool("ci", 8).await;
    app.settle(60, "8 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 8 }).await;
    let available = uids_in(app, "ci", "AVAILABLE").await;
    let lost: HashSet<String> = available.iter().step_by(2).map(|(id, _)| id.clone()).collect();
    for (id, uid) in &available {
        if lost.contains(id) {
            assert!(app.sim.remove_vm(uid));
        }
    }
    lost
}

/// Claims that never ask flintlock (`POOLMGR_CLAIM_VERIFY=off`): the design's one-statement
/// claim, for the tests of what the reconciler alone guarantees.
fn unverified(env: &mut Vec<(String, String)>) {
    env.push(("POOLMGR_CLAIM_VERIFY".into(), "off".into()));
}

/// Finding 1, before any scan: a host that lost microVMs (rebooted for a moment, a delete
/// behind poolmgr's back) and that no pass has looked at yet. The one-statement claim handed
/// those VMs out with 200 (the fault campaign's `dead-vm`, seed 101). A claim now asks the
/// host for its VM before it writes the lease: every VM handed out exists, a lost one goes
/// with VM_LOST and its claim answers 503, and the retries with the same request_ids get the
/// VMs that are left — raced by many claims at once.
#[tokio::test]
async fn claims_never_hand_out_a_vm_whose_microvm_vanished_before_any_scan() {
    let app = Arc::new(TestApp::spawn().await);
    let lost = eight_available_half_lost(&app).await;
    // Eight claimers, each retrying its request_id after a 503 as a client does: the four
    // live VMs go to four of them, the others end at 429 once only lost VMs were left.
    let claimers = (0..8).map(|i| {
        let app = app.clone();
        tokio::spawn(async move {
            let rid = format!("after-reboot-{i}");
            let mut unavailable = 0;
            loop {
                let r = app.claim(CLIENT_A, "ci", Some(&rid)).await;
                match r.status.as_u16() {
                    503 => {
                        assert_eq!(r.body["error"]["status"], "UNAVAILABLE", "{}", r.body);
                        assert!(r.headers.contains_key("retry-after"));
                        unavailable += 1;
                    }
                    200 => return (Some(r.body["vm"]["id"].as_str().unwrap().to_owned()), unavailable),
                    429 => return (None, unavailable),
                    other => panic!("claim answered {other}: {}", r.body),
                }
            }
        })
    });
    let results: Vec<(Option<String>, usize)> =
        futures::future::join_all(claimers).await.into_iter().map(|r| r.unwrap()).collect();
    let claimed: Vec<String> = results.iter().filter_map(|(id, _)| id.clone()).collect();
    let live: HashSet<String> = TestApp::sim_live_uids(&app.sim);
    for id in &claimed {
        assert!(!lost.contains(id), "{id} was handed out although its microVM is gone");
        let uid: String = app.conn().await.query_one("SELECT uid FROM vms WHERE id = $1", &[id]).await.unwrap().get(0);
        assert!(live.contains(&uid), "{id} ({uid}) was handed out but its host does not have it");
    }
    assert_eq!(claimed.len(), 4, "every live VM was claimed once: {results:?}");
    assert_eq!(claimed.iter().collect::<HashSet<_>>().len(), 4, "no VM handed out twice");
    // Each lost VM was met by exactly one claim (503, VM_LOST) and is gone.
    assert_eq!(lost_vms(&app).await, lost);
    assert_eq!(results.iter().map(|(_, n)| n).sum::<usize>(), 4, "{results:?}");
    for id in &lost {
        assert_eq!(app.phase_of(id).await, None, "{id}'s row is gone");
    }
    // And the pass replaces them (REPLACE_ON_DELETE: the 4 leased VMs count towards the 8).
    app.settle(60, "4 AVAILABLE again", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
}

/// Finding 1, the check's limit: a host that hangs on GetMicroVM (it accepts the call and
/// never answers) holds a claim for `POOLMGR_CLAIM_VERIFY_TIMEOUT_MS`, no longer. The claim
/// answers 503 with Retry-After, the VM goes back to AVAILABLE, and the retry with the same
/// request_id claims it once the host answers again.
#[tokio::test]
async fn a_claim_whose_host_hangs_on_the_check_answers_503_and_gives_the_vm_back() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_CLAIM_VERIFY_TIMEOUT_MS".into(), "300".into()))).await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    app.sim.set_get_delay(std::time::Duration::from_secs(30));
    // The host's last scan was just now: its next one is not due for a while.
    app.conn().await.execute("UPDATE hosts SET scan_until = now() + interval '1 hour'", &[]).await.unwrap();
    let started = std::time::Instant::now();
    let r = app.claim(CLIENT_A, "ci", Some("hung")).await;
    assert_eq!(r.status.as_u16(), 503, "{}", r.body);
    // Well under flintlock's own 10 s call timeout, which is what bounded it before.
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "the claim waited for the host: {:?}",
        started.elapsed()
    );
    assert!(r.headers.contains_key("retry-after"));
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("could not reach") && msg.contains("given back"), "{msg}");
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"));
    assert_eq!(app.count_events("VM_LOST").await, 0, "an unreachable host is not a lost VM");
    // Finding 2 on the deployed shape: the claim found the host silent first, so its scan
    // (which starts the dead-host clock) is due at the next pass, which the claim woke.
    let due = app.scalar_i64("SELECT count(*) FROM hosts WHERE name = 'sim' AND scan_until = '-infinity'").await;
    assert_eq!(due, 1, "the host's scan is due now");
    app.sim.set_get_delay(std::time::Duration::ZERO);
    let c = app.claimed(CLIENT_A, "ci", Some("hung")).await;
    assert_eq!(c.vm.id, vm.id);
    assert!(!c.replayed);
}

/// Finding 1, a host that a call found unreachable and none has reached since (the reconciler
/// marks it; it may be rebooting without its microVMs): claims pick VMs on the other hosts
/// instead of one whose VM cannot be checked, and use it again once a call reached it.
#[tokio::test]
async fn claims_skip_vms_on_a_host_marked_unreachable() {
    let app = TestApp::spawn_with(unverified).await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    app.conn()
        .await
        .execute("UPDATE hosts SET unreachable_since = now(), unreachable_until = now() + interval '1 minute'", &[])
        .await
        .unwrap();
    let r = app.claim(CLIENT_A, "ci", None).await;
    assert_eq!(r.status.as_u16(), 429, "{}", r.body);
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"));
    // A pass reaches the host: the mark is cleared and the VM is claimed.
    app.pass().await;
    let c = app.claimed(CLIENT_A, "ci", None).await;
    assert_eq!(c.vm.id, vm.id);
}

/// Finding 1: a microVM deleted outside poolmgr (or lost with its host's reboot) left its
/// AVAILABLE row behind, and claims handed it out with 200 for ever. Now the orphan scan
/// checks the rows against flintlock's list: the row goes with VM_LOST, its replacement is
/// created, and every claim afterwards gets a VM that exists. A QUARANTINED row whose
/// microVM is gone goes too (nothing is left to inspect).
#[tokio::test]
async fn a_vm_whose_microvm_vanished_is_never_handed_out_and_is_replaced() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    app.settle(40, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    let available = uids_in(&app, "ci", "AVAILABLE").await;
    let (lost_id, lost_uid) = available[0].clone();
    assert!(app.sim.remove_vm(&lost_uid), "the sim had the VM");
    let quarantined = app.seed_vm("ci", Phase::Quarantined).await;
    assert!(app.sim.remove_vm(quarantined.uid.as_deref().unwrap()));

    let report = app.pass().await;
    assert_eq!(report.lost, 2, "{report:?}");
    assert_eq!(app.phase_of(&lost_id).await, None, "the lost VM's row is gone");
    assert_eq!(app.phase_of(&quarantined.id).await, None, "the lost quarantined VM's row is gone");
    let lost = lost_vms(&app).await;
    assert_eq!(lost, HashSet::from([lost_id.clone(), quarantined.id.clone()]));

    app.settle(40, "3 AVAILABLE again", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    for _ in 0..3 {
        let c = app.claimed(CLIENT_A, "ci", None).await;
        assert_ne!(c.vm.id, lost_id, "the lost VM was handed out");
        let uid: String =
            app.conn().await.query_one("SELECT uid FROM vms WHERE id = $1", &[&c.vm.id]).await.unwrap().get(0);
        assert!(app.sim.vm(&uid).is_some(), "claimed VM {} has no microVM", c.vm.id);
    }
    // The microVMs that remain are the rows' (nothing leaked, nothing counted twice).
    let rows: HashSet<String> = uids_in(&app, "ci", "LEASED").await.into_iter().map(|(_, u)| u).collect();
    let live: HashSet<String> =
        TestApp::sim_live(&app.sim).into_iter().filter_map(|m| m.spec.and_then(|s| s.uid)).collect();
    assert!(rows.is_subset(&live), "{rows:?} ⊄ {live:?}");
}

/// Finding 1, raced: claims of half a pool's VMs run while passes find half of its
/// microVMs gone. A VM is either claimed before its loss was seen (its lease stands: the
/// scan never removes a leased row) or removed as lost, never both, and no VM is handed out
/// after its row was removed.
#[tokio::test]
async fn claims_racing_the_loss_check_never_get_a_forgotten_vm_and_the_check_never_takes_a_leased_one() {
    // The one-statement claim, which never asks flintlock: the race is the scan's alone.
    let app = Arc::new(TestApp::spawn_with(unverified).await);
    let lost = eight_available_half_lost(&app).await;
    // Fewer claims than VMs: some lost VMs are left for the check whatever the interleaving.
    let claims = (0..4).map(|_| {
        let app = app.clone();
        tokio::spawn(async move {
            let r = app.claim(CLIENT_A, "ci", None).await;
            (r.status.as_u16(), r.body["vm"]["id"].as_str().map(str::to_owned))
        })
    });
    let passes = (0..3).map(|_| {
        let app = app.clone();
        tokio::spawn(async move { app.pass().await.lost })
    });
    let (claims, passes) = futures::join!(futures::future::join_all(claims), futures::future::join_all(passes));
    let claimed: Vec<String> = claims.into_iter().filter_map(|r| r.unwrap().1).collect();
    let forgotten: usize = passes.into_iter().map(|r| r.unwrap()).sum();
    let gone_events = lost_vms(&app).await;
    assert_eq!(gone_events.len(), forgotten, "one VM_LOST per removed row");
    for id in &claimed {
        assert!(!gone_events.contains(id), "{id} was both claimed and removed as lost");
    }
    // Every lost VM ended one way or the other, and no claimed VM has two leases.
    for id in &lost {
        assert!(claimed.contains(id) || gone_events.contains(id), "{id}: neither claimed nor found lost");
    }
    assert_eq!(claimed.iter().collect::<HashSet<_>>().len(), claimed.len(), "a VM handed out twice");
    // What is still AVAILABLE exists in flintlock, once a pass ran after the race.
    app.pass().await;
    for (id, uid) in uids_in(&app, "ci", "AVAILABLE").await {
        assert!(app.sim.vm(&uid).is_some(), "{id} is AVAILABLE without a microVM");
    }
}

/// Finding 2: a host that accepts TCP connections but never answers kept its pools short:
/// its PROVISIONING (uid), AVAILABLE and uid-less rows kept counting as the pool's, so
/// nothing was placed on the healthy host, and its AVAILABLE VM was still handed out. Now a
/// host every call has found unreachable for `POOLMGR_HOST_DEAD_SECONDS` (2 here) is judged
/// dead: its rows are retired (VM_LOST) and the pool is topped up on the healthy host. When
/// the host comes back (a flintlock on the same address, with the microVMs it had), they are
/// deleted there: the retired rows' by their deletes, the uid-less row's by the orphan scan.
/// Nothing leaked, nothing counted twice.
#[tokio::test]
async fn a_dead_hosts_rows_stop_counting_the_pool_refills_elsewhere_and_its_vms_go_when_it_returns() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_HOST_DEAD_SECONDS".into(), "2".into()))).await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    app.created_host(serde_json::json!({"name": "silent", "address": addr.to_string(), "tls": {"insecure": true}}))
        .await;
    let mut spec = pool_spec("ci", 4);
    spec["flintlock_hosts"] = serde_json::json!(["silent", SIM_HOST]);
    app.created_pool(spec).await;
    // What the dead host holds: the microVMs of an AVAILABLE row, a PROVISIONING row and an
    // intent whose create reached flintlock but whose reply was lost.
    let returning = flintlock_sim::Sim::new(flintlock_sim::SimConfig::default());
    let ns = app.flintlock_namespace("default").await;
    let mut on_silent = vec![];
    for phase in [Phase::Available, Phase::Provisioning] {
        let id = poolmgr_core::reconcile::new_vm_id("ci");
        let uid = returning.insert_vm(&ns, &id, flintlock_proto::types::micro_vm_status::MicroVmState::Created);
        app.insert_vm_row("ci", &id, "silent", phase, Some(&uid)).await;
        on_silent.push(id);
    }
    let intent = poolmgr_core::reconcile::new_vm_id("ci");
    returning.insert_vm(&ns, &intent, flintlock_proto::types::micro_vm_status::MicroVmState::Created);
    app.insert_vm_row("ci", &intent, "silent", Phase::Provisioning, None).await;
    on_silent.push(intent.clone());
    assert_eq!(TestApp::sim_live_uids(&returning).len(), 3);

    // Passes until the pool is whole on the healthy host; each pass calls the silent host
    // (3 s timeout), so this also covers "judged dead" happening mid-run. 60 passes bound a
    // hang, not a timing.
    app.settle(60, "4 AVAILABLE on sim and nothing on silent counting", || async {
        let on_sim =
            app.scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'sim' AND phase = 'AVAILABLE'").await;
        let counting = app
            .scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'silent' AND phase NOT IN ('DELETING')")
            .await;
        on_sim == 4 && counting == 0
    })
    .await;
    let lost = lost_vms(&app).await;
    for id in &on_silent {
        assert!(lost.contains(id), "{id} retired with VM_LOST: {lost:?}");
    }
    assert_eq!(app.phase_of(&intent).await, None, "the uid-less row was dropped");
    for _ in 0..4 {
        let c = app.claimed(CLIENT_A, "ci", None).await;
        assert_eq!(c.vm.flintlock_host.name, SIM_HOST, "a VM on the dead host was handed out");
    }

    // The host returns at the same address, with its three microVMs.
    drop(silent);
    let server = returning.serve(addr).await.expect("serve on the dead host's address");
    app.settle(80, "the dead host's microVMs deleted and its rows gone", || async {
        TestApp::sim_live_uids(&returning).is_empty()
            && app.scalar_i64("SELECT count(*) FROM vms WHERE flintlock_host = 'silent'").await == 0
    })
    .await;
    let host = app.get_host("silent").await;
    assert_eq!(host.name, "silent");
    // The pool (REPLACE_ON_DELETE): its 4 leased VMs, all on sim, each with its microVM.
    app.pass().await;
    assert_eq!(app.count_phase("ci", "LEASED").await, 4);
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 0, "nothing counted twice");
    let rows: HashSet<String> = app
        .conn()
        .await
        .query("SELECT uid FROM vms WHERE uid IS NOT NULL AND phase IN ('AVAILABLE', 'LEASED')", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, TestApp::sim_live_uids(&app.sim), "every row has its microVM and every microVM its row");
    server.shutdown().await;
}

/// Finding 2, raced: claims of a dead host's AVAILABLE VMs run while passes retire them (the
/// host is judged dead from the first pass: its `unreachable_since` is set an hour back, so
/// the race is forced, not hoped for). Each VM ends either leased (its claim won: the retire
/// never takes a leased row) or DELETING with VM_LOST, never both, and never handed out twice.
#[tokio::test]
async fn claims_racing_a_dead_hosts_retirement_get_each_vm_at_most_once_and_never_a_retired_one() {
    let app = Arc::new(TestApp::spawn().await);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    app.created_host(serde_json::json!({"name": "silent", "address": silent.local_addr().unwrap().to_string(), "tls": {"insecure": true}})).await;
    let mut spec = pool_spec("ci", 0);
    spec["flintlock_hosts"] = serde_json::json!(["silent"]);
    app.created_pool(spec).await;
    let mut ids = vec![];
    for _ in 0..12 {
        let id = poolmgr_core::reconcile::new_vm_id("ci");
        app.insert_vm_row("ci", &id, "silent", Phase::Available, Some(&ulid::Ulid::generate().to_string())).await;
        ids.push(id);
    }
    app.conn()
        .await
        .execute("UPDATE hosts SET unreachable_since = now() - interval '1 hour' WHERE name = 'silent'", &[])
        .await
        .unwrap();
    let claims = (0..12).map(|_| {
        let app = app.clone();
        tokio::spawn(async move {
            let r = app.claim(CLIENT_A, "ci", None).await;
            r.body["vm"]["id"].as_str().map(str::to_owned)
        })
    });
    let passes = (0..2).map(|_| {
        let app = app.clone();
        tokio::spawn(async move { app.pass().await })
    });
    let (claims, _) = futures::join!(futures::future::join_all(claims), futures::future::join_all(passes));
    let claimed: Vec<String> = claims.into_iter().filter_map(|r| r.unwrap()).collect();
    assert_eq!(claimed.iter().collect::<HashSet<_>>().len(), claimed.len(), "a VM handed out twice");
    let lost = lost_vms(&app).await;
    for id in &ids {
        let phase = app.phase_of(id).await;
        match (claimed.contains(id), lost.contains(id)) {
            (true, false) => assert_eq!(phase.as_deref(), Some("LEASED"), "{id}"),
            (false, true) => assert_eq!(phase.as_deref(), Some("DELETING"), "{id}"),
            other => panic!("{id}: claimed/retired = {other:?}, phase {phase:?}"),
        }
    }
    drop(silent);
}

/// Finding 4: orphan scans, deleted pools' stragglers and event retention ran only when the
/// pools left time before the pass deadline, so a pass whose pools used it all (here a create
/// hook whose command runs past the 3 s deadline) cleaned nothing, every pass. Now the cleanup
/// has a budget of its own in every pass: one such pass deletes the orphan, finishes the
/// deleted pool's straggler and prunes the old events.
#[tokio::test]
async fn a_pass_whose_pools_use_the_whole_deadline_still_cleans_up() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_RECONCILE_DEADLINE_SECONDS".into(), "3".into()))).await;
    app.sim.set_exec_rule(
        "slow-setup",
        flintlock_sim::ExecRule { duration: std::time::Duration::from_secs(4), ..Default::default() },
    );
    // The straggler: a deleted pool's VM whose delete failed.
    app.create_pool("gone", 1).await;
    app.settle(40, "gone's VM AVAILABLE", || async { app.count_phase("gone", "AVAILABLE").await == 1 }).await;
    app.sim.fail_deletes(u32::MAX);
    app.delete(ADMIN, "/v1/pools/default/gone").await.assert_ok(204);
    app.sim.reset_faults();
    app.conn().await.execute("UPDATE vms SET next_attempt_at = NULL WHERE pool_name = 'gone'", &[]).await.unwrap();
    // Last, so the pass below is the first to run its hook.
    let mut busy = pool_spec("busy", 1);
    busy["create_commands"] = serde_json::json!(["slow-setup"]);
    app.created_pool(busy).await;
    app.settle(40, "the busy pool's VM in its create hook", || async {
        app.count_phase("busy", "CREATE_HOOK_RUNNING").await == 1
    })
    .await;
    // The orphan, and events past the retention.
    let ns = app.flintlock_namespace("default").await;
    let orphan = app.sim.insert_vm(
        &ns,
        "busy-01jzzzzzzzzzzzzzzzzzzzzzzz",
        flintlock_proto::types::micro_vm_status::MicroVmState::Created,
    );
    app.conn()
        .await
        .execute(
            "INSERT INTO events (type, pool_namespace, pool_name, created_at)
             SELECT 'POOL_REPLENISHING', 'default', 'x', now() - interval '8 days' FROM generate_series(1, 10)",
            &[],
        )
        .await
        .unwrap();
    app.conn().await.execute("UPDATE hosts SET scan_until = '-infinity'", &[]).await.unwrap();

    let started = std::time::Instant::now();
    let report = app.pass().await;
    assert!(started.elapsed() >= std::time::Duration::from_secs(3), "the hook held the pass past its deadline");
    // Every pool was visited and the cleanup finished within its own budget.
    assert!(report.errors.is_empty(), "{report:?}");
    assert_eq!(report.orphans_deleted, 1, "the orphan scan ran: {report:?}");
    assert!(app.sim.vm(&orphan).is_none_or(|m| {
        m.status.is_some_and(|s| s.state == flintlock_proto::types::micro_vm_status::MicroVmState::Deleting as i32)
    }));
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms WHERE pool_name = 'gone'").await, 0, "straggler finished");
    assert_eq!(report.events_pruned, 10, "{report:?}");
}

/// Finding 5: a heartbeat on a lease whose release began (the client's release answered 503:
/// the VM is DELETING, flintlock's delete pending) answered 200 and pushed its expiry out, as
/// if the lease were still held. Now it answers 404, and heartbeats racing the release never
/// answer 200 after the release began.
#[tokio::test]
async fn a_heartbeat_after_the_release_began_is_not_found() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let lease = claim.lease.lease_id.clone();
    app.sim.fail_deletes(1);
    app.release(CLIENT_A, &lease).await.assert_error(503, "UNAVAILABLE");
    app.heartbeat(CLIENT_A, &lease).await.assert_error(404, "NOT_FOUND");
    let expires: chrono::DateTime<chrono::Utc> = app
        .conn()
        .await
        .query_one("SELECT expires_at FROM leases WHERE lease_id = $1", &[&lease])
        .await
        .unwrap()
        .get(0);
    assert!(expires <= claim.lease.expires_at, "the heartbeat did not extend a lease being released");
    app.release(CLIENT_A, &lease).await.assert_ok(204);

    // Raced: heartbeats while a release runs; none answers 200 once the release answered.
    app.seed_available("ci", 1).await;
    let claim = app.claimed(CLIENT_A, "ci", None).await;
    let lease = claim.lease.lease_id.clone();
    let beats = (0..8).map(|_| {
        let (app, lease) = (app.clone(), lease.clone());
        tokio::spawn(async move { app.heartbeat(CLIENT_A, &lease).await.status.as_u16() })
    });
    let release = {
        let (app, lease) = (app.clone(), lease.clone());
        tokio::spawn(async move { app.release(CLIENT_A, &lease).await.status.as_u16() })
    };
    for b in futures::future::join_all(beats).await {
        assert!(matches!(b.unwrap(), 200 | 404));
    }
    assert_eq!(release.await.unwrap(), 204);
    app.heartbeat(CLIENT_A, &lease).await.assert_error(404, "NOT_FOUND");
}

/// Finding 5: a host PUT could change the address of a host that still had VMs: its
/// microVMs stayed at the old address (leaked: their deletes went to the new one and found
/// nothing), or another flintlockd's orphan scan took them for its own. Now a new address is
/// refused (400 FAILED_PRECONDITION, nothing changed) while a VM row names the host; the same
/// address with other settings is still accepted, and so is a new address once it has none.
#[tokio::test]
async fn a_hosts_address_cannot_change_while_it_has_vms() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    let address = app.sim_server.addr.to_string();
    let moved = serde_json::json!({"name": SIM_HOST, "address": "10.9.9.9:9090", "tls": {"insecure": true}});
    let r = app.put(ADMIN, &format!("/v1/hosts/{SIM_HOST}"), moved.clone()).await;
    r.assert_error(400, "FAILED_PRECONDITION");
    assert!(r.body["error"]["message"].as_str().unwrap().contains("cordon"), "{}", r.body);
    assert_eq!(app.get_host(SIM_HOST).await.address, address, "unchanged");
    let same =
        serde_json::json!({"name": SIM_HOST, "address": address.clone(), "tls": {"insecure": true}, "exec": "enabled"});
    app.updated_host(SIM_HOST, same).await;
    // Without VMs (the pool deleted and its VM gone), the address may change.
    app.delete(ADMIN, "/v1/pools/default/ci").await.assert_ok(204);
    app.settle(40, "no VM rows", || async { app.scalar_i64("SELECT count(*) FROM vms").await == 0 }).await;
    assert_eq!(app.updated_host(SIM_HOST, moved).await.address, "10.9.9.9:9090");
}

/// Finding 5: while no host was eligible (every host cordoned), every pass wrote a
/// POOL_REPLENISHING event for VMs it then could not place (and, being an event, it also made
/// the next selection step the pool again). Now it is written only for VMs actually placed;
/// POOL_SIZE_BELOW_TARGET says why once.
#[tokio::test]
async fn no_replenishing_event_is_written_while_no_host_is_eligible() {
    let app = TestApp::spawn().await;
    app.post(ADMIN, &format!("/v1/hosts/{SIM_HOST}/cordon"), serde_json::json!({"reason": "maintenance"}))
        .await
        .assert_ok(200);
    app.create_pool("ci", 2).await;
    for _ in 0..4 {
        app.pass().await;
    }
    assert_eq!(app.count_events("POOL_REPLENISHING").await, 0);
    assert_eq!(app.count_events("POOL_SIZE_BELOW_TARGET").await, 1);
    app.post(ADMIN, &format!("/v1/hosts/{SIM_HOST}/uncordon"), serde_json::json!({})).await.assert_ok(200);
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    let creating: i64 = app
        .conn()
        .await
        .query_one("SELECT sum((payload->>'creating')::int)::int8 FROM events WHERE type = 'POOL_REPLENISHING'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(creating, 2, "one event per placement round, counting what was placed");
}

/// Finding 1, found again by the fault campaign (a host rebooted without its microVMs): a
/// PROVISIONING VM whose microVM vanished got the pool's hook-failure policy, so under
/// QUARANTINE a VM that did not exist was quarantined (VM_HOOK_FAILED, and one step closer
/// to the quarantine bound that stops replenishment). Now it is simply lost: its row goes with
/// VM_LOST and a replacement is created.
#[tokio::test]
async fn a_provisioning_vm_whose_microvm_vanished_is_lost_not_quarantined() {
    let app = TestApp::spawn().await;
    app.sim.set_boot_delay(std::time::Duration::from_secs(3600));
    let mut spec = pool_spec("ci", 1);
    spec["hook_failure_policy"] = serde_json::json!("QUARANTINE");
    app.created_pool(spec).await;
    app.settle(20, "1 created", || async {
        app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'PROVISIONING' AND uid IS NOT NULL").await == 1
    })
    .await;
    let (id, uid) = uids_in(&app, "ci", "PROVISIONING").await.remove(0);
    assert!(app.sim.remove_vm(&uid));
    app.sim.set_boot_delay(std::time::Duration::from_millis(50));
    app.pass().await;
    assert_eq!(app.phase_of(&id).await, None);
    assert_eq!(app.count_events("VM_LOST").await, 1);
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
    app.settle(40, "a replacement AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    assert_eq!(app.count_phase("ci", "QUARANTINED").await, 0);
}

/// Finding 5: a pool delete fanned out one flintlock delete per VM at once from the request
/// (10,000 for a 10,000-VM pool). Now it deletes at most 64 before answering, 16 at a time, and
/// leaves the rest DELETING for the reconciler, which finishes them.
#[tokio::test]
async fn a_large_pool_delete_deletes_a_bounded_batch_and_leaves_the_rest_to_the_reconciler() {
    let app = TestApp::spawn().await;
    app.create_pool("big", 0).await;
    app.seed_available("big", 90).await;
    app.delete(ADMIN, "/v1/pools/default/big").await.assert_ok(204);
    let left = app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'DELETING'").await;
    assert_eq!(left, 90 - 64, "64 deleted inline, the rest left DELETING");
    app.settle(40, "every VM deleted", || async { app.scalar_i64("SELECT count(*) FROM vms").await == 0 }).await;
    app.settle(40, "gone from flintlock", || async { TestApp::sim_live(&app.sim).is_empty() }).await;
}

/// Finding 5, the two-phase claim's ABA: claim A's give-back (PRE_LEASE_HOOK_RUNNING →
/// AVAILABLE) commits but its reply is lost; claim B takes the VM; A's retried give-back and
/// A's second transaction checked only the phase, so they moved B's VM back to AVAILABLE or
/// wrote A's lease on it. Now both are guarded by the claim's own `hook_started_at`: A's stale
/// writes change nothing, B's lease is written. (The lost reply is forced by calling the
/// store's statements in that order, on real PostgreSQL.)
#[tokio::test]
async fn a_stale_give_back_or_lease_write_never_touches_another_claims_vm() {
    use poolmgr_core::store;
    let app = TestApp::spawn().await;
    let mut spec = pool_spec("ci", 0);
    spec["pre_lease_commands"] = serde_json::json!(["reset"]);
    app.created_pool(spec).await;
    let vm = app.seed_vm("ci", Phase::Available).await;
    let pool = poolmgr_tests::pool("ci");
    let conn = app.conn().await;
    let a = store::vm_claim_for_hook(&**conn, &pool, "client-a", Some("rid-a")).await.unwrap().vm.unwrap();
    assert_eq!(a.id, vm.id);
    assert!(store::vm_transition_hook_claim(&**conn, &a.id, a.hook_started_at, Phase::Available, None).await.unwrap());
    let b = store::vm_claim_for_hook(&**conn, &pool, "client-b", Some("rid-b")).await.unwrap().vm.unwrap();
    assert_eq!(b.id, vm.id, "B took the VM A gave back");
    assert_ne!(a.hook_started_at, b.hook_started_at);

    // A's give-back, retried after its lost reply: nothing moves.
    assert!(!store::vm_transition_hook_claim(&**conn, &a.id, a.hook_started_at, Phase::Available, None).await.unwrap());
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("PRE_LEASE_HOOK_RUNNING"));
    // A's second transaction: the VM is not A's any more.
    let stale =
        store::lease_insert_after_hook(&**conn, &vm.id, "lease-a", Some("rid-a"), "client-a", a.hook_started_at)
            .await
            .unwrap();
    assert!(matches!(stale, store::HookLease::VmTaken), "A's stale lease write must find the VM taken");
    let fresh =
        store::lease_insert_after_hook(&**conn, &vm.id, "lease-b", Some("rid-b"), "client-b", b.hook_started_at)
            .await
            .unwrap();
    assert!(matches!(fresh, store::HookLease::Claimed(_)), "B's lease is written");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 1);
    assert_eq!(
        app.conn().await.query_one("SELECT principal FROM leases", &[]).await.unwrap().get::<_, String>(0),
        "client-b"
    );
}

/// Finding 5: a pool deleted while a release of one of its VMs was pending (the release
/// answered 503: VM DELETING, lease kept) marked that VM again, took its lease and wrote
/// VM_DELETED_ON_POOL_DELETE for it: the release's terminal event was lost and the VM was
/// recorded as deleted by the pool delete. Now a VM already DELETING is left to its deleter:
/// each VM gets exactly one terminal event, the released one VM_DELETED_ON_RELEASE.
#[tokio::test]
async fn a_pool_delete_over_a_pending_release_keeps_the_release_as_its_terminal_event() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    app.seed_available("ci", 2).await;
    let released = app.claimed(CLIENT_A, "ci", None).await;
    let kept = app.claimed(CLIENT_A, "ci", None).await;
    app.sim.fail_deletes(1);
    app.release(CLIENT_A, &released.lease.lease_id).await.assert_error(503, "UNAVAILABLE");
    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);
    app.settle(40, "every VM gone", || async { app.scalar_i64("SELECT count(*) FROM vms").await == 0 }).await;
    let terminal = |vm: String| {
        let app = &app;
        async move {
            app.conn()
                .await
                .query(
                    "SELECT type FROM events WHERE vm_id = $1 AND type IN
                       ('VM_DELETED_ON_RELEASE', 'VM_DELETED_ON_POOL_DELETE', 'VM_DELETED_DUE_TO_EXPIRY') ORDER BY id",
                    &[&vm],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(terminal(released.vm.id.clone()).await, ["VM_DELETED_ON_RELEASE"]);
    assert_eq!(terminal(kept.vm.id.clone()).await, ["VM_DELETED_ON_POOL_DELETE"]);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

/// Finding 5: a lease whose release was pending (the release answered 503: VM DELETING, lease
/// kept) and then passed its expiry was recorded as expired (VM_DELETED_DUE_TO_EXPIRY) and the
/// release's own terminal event never came. Now the expiry sweep leaves it to the release:
/// the VM ends with VM_DELETED_ON_RELEASE only.
#[tokio::test]
async fn a_release_pending_at_expiry_is_recorded_as_a_release() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    app.seed_available("ci", 1).await;
    let c = app.claimed(CLIENT_A, "ci", None).await;
    app.sim.fail_deletes(u32::MAX);
    app.release(CLIENT_A, &c.lease.lease_id).await.assert_error(503, "UNAVAILABLE");
    app.advance_clock(std::time::Duration::from_secs(3600));
    app.pass().await;
    app.sim.reset_faults();
    app.settle(40, "the VM deleted", || async { app.phase_of(&c.vm.id).await.is_none() }).await;
    let types: Vec<String> = app
        .conn()
        .await
        .query("SELECT type FROM events WHERE vm_id = $1 AND type LIKE 'VM_DELETED%' ORDER BY id", &[&c.vm.id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(types, ["VM_DELETED_ON_RELEASE"]);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
}

/// Finding 5: a VM released normally between the orphan scan's list and its read of the rows
/// (microVM deleted, then its row) looked like an orphan: the scan deleted it again and wrote
/// VM_ORPHAN_DELETED for a VM nobody had lost. The moment is forced: the host answers the
/// scan's list a second after taking it, and the release runs in that second. Now the scan
/// asks for each candidate again before calling it an orphan.
#[tokio::test]
async fn a_vm_released_while_the_orphan_scan_lists_is_not_an_orphan() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 0).await;
    app.seed_available("ci", 1).await;
    let c = app.claimed(CLIENT_A, "ci", None).await;
    app.sim.set_list_delay(std::time::Duration::from_secs(1));
    let lists = app.sim.calls("ListMicroVMs");
    let pass = {
        let app = app.clone();
        tokio::spawn(async move { app.pass().await })
    };
    while app.sim.calls("ListMicroVMs") == lists {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // The scan holds a list in which the VM is live; release it now.
    app.release(CLIENT_A, &c.lease.lease_id).await.assert_ok(204);
    let report = pass.await.unwrap();
    app.sim.set_list_delay(std::time::Duration::ZERO);
    assert_eq!(report.orphans_deleted, 0, "{report:?}");
    assert_eq!(app.count_events("VM_ORPHAN_DELETED").await, 0);
    assert_eq!(app.count_events("VM_DELETED_ON_RELEASE").await, 1);
}

/// Finding 5: one statement expired every due lease of a batch of 32 pools, however many
/// (locking all their VMs at once). Now one statement takes at most `EXPIRE_BATCH` (500); the
/// rest stay due and the next pass takes them. (Rows inserted by SQL: 520 leased VMs whose
/// microVMs the host never had, which their deletes count as gone.)
#[tokio::test]
async fn one_expiry_statement_expires_a_bounded_number_of_leases() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    app.conn()
        .await
        .batch_execute(
            "INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase, lease_id, network_interfaces)
             SELECT 'ci-' || g, 'uid-' || g, 'default', 'ci', 'sim', 'LEASED', 'lease-' || g, '{}'
             FROM generate_series(1, 520) g;
             INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at, principal)
             SELECT 'lease-' || g, 'ci-' || g, 'default', 'ci', now(), now(), now() + interval '1 minute', 'client-a'
             FROM generate_series(1, 520) g;",
        )
        .await
        .unwrap();
    app.advance_clock(std::time::Duration::from_secs(3600));
    let first = app.pass().await;
    assert_eq!(first.expired as i64, poolmgr_core::store::EXPIRE_BATCH, "{first:?}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 520 - poolmgr_core::store::EXPIRE_BATCH);
    let second = app.pass().await;
    assert_eq!(second.expired, 20, "{second:?}");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0);
    assert_eq!(app.count_events("VM_DELETED_DUE_TO_EXPIRY").await, 520);
}

/// Finding 5: a step waiting for one of its host's slots (`POOLMGR_RECONCILE_HOST_CONCURRENCY`)
/// waited however long the calls ahead of it took, past the pass deadline and past the pool
/// lease (deadline + hook timeout + 30 s): two passes could then work one pool. Now a call
/// still waiting for a slot at the deadline is skipped and left to the next pass. Forced: one
/// slot, creates that take 2.5 s, a 2 s deadline, four VMs to create on the host.
#[tokio::test]
async fn a_step_waiting_for_a_host_slot_gives_up_at_the_pass_deadline() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_RECONCILE_DEADLINE_SECONDS".into(), "2".into()));
        env.push(("POOLMGR_RECONCILE_HOST_CONCURRENCY".into(), "1".into()));
    })
    .await;
    // Inside the 3 s flintlock timeout: a slow host, not a dead one.
    app.sim.set_create_delay(std::time::Duration::from_millis(2500));
    app.create_pool("ci", 4).await;
    let report = app.pass().await;
    let creates = app.sim.calls("CreateMicroVM");
    assert!(creates < 4, "{creates} creates were called; those behind the first wait past the deadline");
    assert!(report.skipped >= 4 - creates, "{report:?}");
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM vms WHERE uid IS NULL").await,
        4 - report.created as i64,
        "the creates not made (or not answered) are intents for the next pass"
    );
    app.sim.set_create_delay(std::time::Duration::ZERO);
    app.settle(40, "4 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
}

/// Finding 5: due and timeout checks compared database timestamps (`created_at`,
/// `next_attempt_at`) with the function's own clock, so a reconciler whose host clock ran an
/// hour ahead failed every booting VM at once for "the provision timeout". Now a pass compares
/// them with the database's time (its time at the pass's start, plus the time since). Forced:
/// the app's clock is skewed an hour ahead of PostgreSQL's.
#[tokio::test]
async fn a_reconciler_whose_clock_drifted_times_nothing_out_early() {
    let app = TestApp::spawn().await;
    app.sim.set_boot_delay(std::time::Duration::from_secs(3600));
    app.create_pool("ci", 2).await;
    app.settle(20, "2 created", || async {
        app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'PROVISIONING' AND uid IS NOT NULL").await == 2
    })
    .await;
    app.state.clock.skew(3_600_000);
    for _ in 0..3 {
        app.pass().await;
    }
    app.state.clock.skew(0);
    assert_eq!(
        app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'PROVISIONING'").await,
        2,
        "still booting: the provision timeout (300 s) is measured on the database's clock"
    );
    assert_eq!(app.count_events("VM_HOOK_FAILED").await, 0);
}

/// Finding 2, the judgement made sound where passes are sparse (the deployed schedule, a
/// minute apart): one failed call marked a host unreachable, and the next pass a minute later
/// judged it dead at its start and retired every VM of a healthy host. Now a host past
/// `POOLMGR_HOST_DEAD_SECONDS` is asked once more before its VMs are retired; one that
/// answers is cleared and keeps its VMs.
#[tokio::test]
async fn a_host_that_answers_is_never_judged_dead_on_an_old_mark() {
    let app = TestApp::spawn().await;
    filled_pool_of_two(&app).await;
    // A mark an hour old (a blip at the end of the last loop), and no call since.
    marked_an_hour_ago(&app).await;
    app.pass().await;
    assert_eq!(app.count_events("VM_LOST").await, 0, "a healthy host's VMs were retired");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM hosts WHERE unreachable_since IS NOT NULL").await, 0, "cleared");
}

/// Finding 2 on the deployed shape: a reconcile loop that found a host unreachable stopped
/// after its linger, and the host was judged dead (and its pools topped up elsewhere) only by
/// the next scheduled invocation, up to a minute later. Now the loop keeps passing until the
/// host is judged: when it returns, the dead host's VMs are retired and replaced. The moment
/// is forced: the host was marked just now, so the loop's first pass cannot judge it.
#[tokio::test]
async fn a_loop_keeps_passing_until_an_unreachable_host_is_judged_and_its_pool_refilled() {
    use poolmgr_core::reconcile::{Start, run_loop_from};
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_HOST_DEAD_SECONDS".into(), "2".into()))).await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    app.created_host(serde_json::json!({"name": "silent", "address": silent.local_addr().unwrap().to_string(), "tls": {"insecure": true}}))
        .await;
    let mut spec = pool_spec("ci", 2);
    spec["flintlock_hosts"] = serde_json::json!(["silent", SIM_HOST]);
    app.created_pool(spec).await;
    // The pool is whole, one VM on each host; the silent one was just found unreachable.
    for host in ["silent", SIM_HOST] {
        let id = poolmgr_core::reconcile::new_vm_id("ci");
        let ns = app.flintlock_namespace("default").await;
        let uid = app.sim.insert_vm(&ns, &id, flintlock_proto::types::micro_vm_status::MicroVmState::Created);
        app.insert_vm_row("ci", &id, host, Phase::Available, Some(&uid)).await;
    }
    app.conn()
        .await
        .execute(
            "UPDATE hosts SET unreachable_since = now(), unreachable_until = now() + interval '1 minute' WHERE name = 'silent'",
            &[],
        )
        .await
        .unwrap();
    let r = run_loop_from(&app.state, std::time::Duration::from_secs(600), Start::Schedule).await.unwrap();
    assert!(r.passes > 1, "the loop waited for the judgement: {r:?}");
    assert_eq!(lost_vms(&app).await.len(), 1, "the dead host's VM retired");
    let on_sim = "SELECT count(*) FROM vms WHERE flintlock_host = 'sim' AND phase = 'AVAILABLE'";
    assert_eq!(app.scalar_i64(on_sim).await, 2, "the pool is whole again on the healthy host: {r:?}");
}

/// Pool `ci` of 2, filled.
async fn filled_pool_of_two(app: &TestApp) {
    app.create_pool("ci", 2).await;
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
}

/// A filled pool of 2 on the harness's host, which then hangs on every VM call (Get and List)
/// while still answering ServerInfo, marked unreachable an hour ago; one pass judges it.
async fn judged_dead_while_its_vm_calls_hang(app: &TestApp) {
    filled_pool_of_two(app).await;
    app.sim.set_get_delay(std::time::Duration::from_secs(30));
    app.sim.set_list_delay(std::time::Duration::from_secs(30));
    marked_an_hour_ago(app).await;
    app.pass().await;
}

/// Mark the harness's host unreachable since an hour ago, as a blip long before left it.
async fn marked_an_hour_ago(app: &TestApp) {
    app.conn()
        .await
        .execute(
            "UPDATE hosts SET unreachable_since = now() - interval '1 hour', unreachable_until = now() + interval '1 minute'",
            &[],
        )
        .await
        .unwrap();
}

/// Finding 2, the last ask made with the kind of call that failed: a flintlockd whose VM calls
/// hang (containerd stuck) still answers ServerInfo. Asked with ServerInfo, such a host was
/// cleared at every judgement, marked again by the pass's next call, and never judged dead,
/// while claims skipped it and a loop waited on it. Asked with a GetMicroVM of one of its VMs
/// (the call's whole timeout), it is judged dead and its VMs retired.
#[tokio::test]
async fn a_host_whose_vm_calls_hang_is_judged_dead_though_it_answers_server_info() {
    let app = TestApp::spawn().await;
    judged_dead_while_its_vm_calls_hang(&app).await;
    assert_eq!(lost_vms(&app).await.len(), 2, "its VMs are retired");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 0);
}

/// Finding 2, a dead host's return: its orphan scan is how it is noticed, and the scan of a
/// host found unreachable is bounded (a hung host held every pass for the call's timeout). The
/// bound applies to a quick ServerInfo only: a host that came back and lists slowly (a busy
/// containerd after a reboot) is listed with the whole timeout, cleared, and its retired VMs'
/// microVMs deleted. With the list itself bounded it stayed dead for good.
#[tokio::test]
async fn a_dead_host_that_returns_and_lists_slowly_is_cleared_and_its_leftovers_deleted() {
    let app = TestApp::spawn().await;
    judged_dead_while_its_vm_calls_hang(&app).await;
    assert_eq!(lost_vms(&app).await.len(), 2);
    // Back, listing in 2.5 s: above the 2 s bound, under the call's timeout (3 s here).
    app.sim.set_get_delay(std::time::Duration::ZERO);
    app.sim.set_list_delay(std::time::Duration::from_millis(2500));
    app.settle(20, "the host cleared and the retired VMs' microVMs deleted", || async {
        app.scalar_i64("SELECT count(*) FROM hosts WHERE unreachable_since IS NOT NULL").await == 0
            && app.scalar_i64("SELECT count(*) FROM vms WHERE phase = 'DELETING'").await == 0
    })
    .await;
    app.sim.set_list_delay(std::time::Duration::ZERO);
    app.settle(40, "the pool refilled on its host", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
}
