//! Revisions and rollouts of a pool's VM template (issue 24): what bumps a revision, what the
//! VMs record, what is kept, and the races on them.

use std::collections::HashSet;
use std::sync::Arc;

use poolmgr_core::api;
use poolmgr_tests::*;
use serde_json::{Value, json};

const POOL_PATH: &str = "/v1/pools/default/ci";

/// The spec of pool default/ci (size `size`) with `image` as its root volume's image.
fn spec_with_image(size: i32, image: &str) -> Value {
    let mut spec = pool_spec("ci", size);
    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!(image);
    spec
}

async fn put_spec(app: &TestApp, spec: Value) -> api::Pool {
    app.put(ADMIN, POOL_PATH, spec).await.assert_ok_response(200).json()
}

async fn revisions(app: &TestApp) -> Vec<api::Revision> {
    let r = app.get(ADMIN, &format!("{POOL_PATH}/revisions")).await;
    r.assert_ok_response(200).json::<api::RevisionList>().revisions
}

/// Item 1: only `microvm_template` and `create_commands` make a revision. Size, the pre-lease
/// commands (run at claim time) and the policies do not; neither does the same template
/// written with its keys in another order. Each revision keeps the spec that made it, newest
/// first, and the first one counts as rolled out.
#[tokio::test]
async fn only_a_change_that_shapes_the_warm_vms_makes_a_revision() {
    let app = TestApp::spawn().await;
    let created = app.create_pool("ci", 1).await;
    assert_eq!(created.revision, 1);

    let mut spec = pool_spec("ci", 3);
    assert_eq!(put_spec(&app, spec.clone()).await.revision, 1, "size");
    spec["pre_lease_commands"] = json!(["echo ready"]);
    spec["hook_failure_policy"] = json!("QUARANTINE");
    spec["heartbeat_expiry_seconds"] = json!(300);
    assert_eq!(put_spec(&app, spec.clone()).await.revision, 1, "pre-lease commands and policies");
    // The same template, its keys in another order.
    let t = template();
    let mut reordered = serde_json::Map::new();
    for k in ["interfaces", "kernel", "root_volume"] {
        reordered.insert(k.into(), t[k].clone());
    }
    spec["microvm_template"] = Value::Object(reordered);
    assert_eq!(put_spec(&app, spec.clone()).await.revision, 1, "the same template");

    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!("ghcr.io/x/runner:2");
    let p = put_spec(&app, spec.clone()).await;
    assert_eq!(p.revision, 2, "a new image");
    spec["create_commands"] = json!(["systemctl start runner"]);
    assert_eq!(put_spec(&app, spec.clone()).await.revision, 3, "new create commands");
    assert_eq!(app.get(ADMIN, POOL_PATH).await.assert_ok_response(200).json::<api::Pool>().revision, 3);

    let revs = revisions(&app).await;
    assert_eq!(revs.iter().map(|r| r.revision).collect::<Vec<_>>(), vec![3, 2, 1]);
    assert_eq!(revs[0].spec.create_commands, vec!["systemctl start runner".to_owned()]);
    assert_eq!(revs[1].spec.create_commands, Vec::<String>::new());
    let image = |r: &api::Revision| {
        serde_json::to_value(&r.spec.microvm_template).unwrap()["root_volume"]["source"]["container_source"].clone()
    };
    assert_eq!(image(&revs[1]), json!("ghcr.io/x/runner:2"));
    assert_eq!(image(&revs[2]), template()["root_volume"]["source"]["container_source"]);
    assert!(revs[2].rolled_out, "the first revision");
    assert!(revs.iter().all(|r| r.created_at <= chrono::Utc::now()));
}

/// Item 1: every VM records the revision whose template created it: the VMs made before a
/// change keep theirs, their replacements get the new one (`GET /v1/vms` shows it).
#[tokio::test]
async fn each_vm_records_the_revision_it_was_created_from() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    put_spec(&app, spec_with_image(2, "ghcr.io/x/runner:2")).await;
    let before: Vec<String> = app
        .conn()
        .await
        .query("SELECT id FROM vms WHERE pool_name = 'ci' AND phase = 'AVAILABLE'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // One VM used and released: its replacement is made from revision 2.
    let claimed = app.claimed(CLIENT_A, "ci", None).await;
    app.delete(CLIENT_A, &format!("/v1/leases/{}", claimed.lease.lease_id)).await.assert_ok(204);
    app.settle(40, "2 AVAILABLE again", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    let r = app.get(ADMIN, "/v1/vms?namespace=default&pool=ci").await;
    let vms: Value = r.assert_ok_response(200).body.clone();
    let by_id: Vec<(String, i64, String)> = vms["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["id"].as_str().unwrap().to_owned(),
                v["revision"].as_i64().unwrap(),
                v["phase"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let kept: Vec<&(String, i64, String)> = by_id.iter().filter(|(id, _, _)| before.contains(id)).collect();
    assert_eq!(kept.len(), 1, "{by_id:?}");
    assert_eq!(kept[0].1, 1, "the VM made before the change keeps its revision");
    // The replacement's microVM was created from revision 2's template.
    let new: Vec<&(String, i64, String)> = by_id.iter().filter(|(_, rev, _)| *rev == 2).collect();
    assert_eq!(new.len(), 1, "{by_id:?}");
    let uid: String =
        app.conn().await.query_one("SELECT uid FROM vms WHERE id = $1", &[&new[0].0]).await.unwrap().get(0);
    let vm = app.sim.vm(&uid).expect("in the sim");
    let image = vm.spec.unwrap().root_volume.unwrap().source.unwrap().container_source.unwrap_or_default();
    assert_eq!(image, "ghcr.io/x/runner:2");
}

/// Item 1: the last 10 revisions are kept, newest first.
#[tokio::test]
async fn the_last_ten_revisions_are_kept() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 0).await;
    for i in 2..=13 {
        assert_eq!(put_spec(&app, spec_with_image(0, &format!("ghcr.io/x/runner:{i}"))).await.revision, i);
    }
    let revs = revisions(&app).await;
    assert_eq!(revs.iter().map(|r| r.revision).collect::<Vec<_>>(), (4..=13).rev().collect::<Vec<_>>());
}

/// Item 1, raced: concurrent PUTs of different templates each get a revision of their own,
/// with no number given twice and none skipped, and the pool ends on the newest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_template_changes_get_one_revision_each() {
    let app = Arc::new(TestApp::spawn().await);
    app.create_pool("ci", 0).await;
    let puts = (0..8).map(|i| {
        let app = app.clone();
        tokio::spawn(async move { put_spec(&app, spec_with_image(0, &format!("ghcr.io/x/racer:{i}"))).await.revision })
    });
    let got: Vec<i32> = futures::future::join_all(puts).await.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(got.iter().copied().collect::<HashSet<_>>(), (2..=9).collect::<HashSet<_>>(), "{got:?}");
    let revs = revisions(&app).await;
    assert_eq!(revs.iter().map(|r| r.revision).collect::<Vec<_>>(), (1..=9).rev().collect::<Vec<_>>());
    let pool: api::Pool = app.get(ADMIN, POOL_PATH).await.assert_ok_response(200).json();
    assert_eq!(pool.revision, 9);
    // The pool's template is the one revision 9 recorded.
    assert_eq!(pool.spec.microvm_template, revs[0].spec.microvm_template);
}

#[tokio::test]
async fn revisions_of_an_unknown_pool_are_not_found_and_need_an_admin() {
    let app = TestApp::spawn().await;
    app.get(ADMIN, "/v1/pools/default/nope/revisions").await.assert_error(404, "NOT_FOUND");
    app.create_pool("ci", 0).await;
    let r = app.get(CLIENT_A, &format!("{POOL_PATH}/revisions")).await;
    assert_eq!(r.status.as_u16(), 403, "{}", r.body);
}

/// Pool default/ci of `size` with a rollout policy (`extra` merged into the server's defaults).
fn rolling_spec(size: i32, image: &str, rollout: Value) -> Value {
    let mut spec = spec_with_image(size, image);
    spec["rollout"] = rollout;
    spec
}

async fn create_rolling(app: &TestApp, size: i32, rollout: Value) {
    let spec = rolling_spec(size, "ghcr.io/x/runner:1", rollout);
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    app.settle(60, "the pool full", || async { app.count_phase("ci", "AVAILABLE").await == i64::from(size) }).await;
}

async fn pool(app: &TestApp) -> api::Pool {
    app.get(ADMIN, POOL_PATH).await.assert_ok_response(200).json()
}

/// (revision, phase) of every VM row of pool ci that is not DELETING.
async fn live_vms(app: &TestApp) -> Vec<(i32, String)> {
    let rows = app
        .conn()
        .await
        .query("SELECT revision, phase FROM vms WHERE pool_name = 'ci' AND phase <> 'DELETING' ORDER BY id", &[])
        .await
        .unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// Item 2: an idle pool rolls at once, surge first: the warm capacity never drops below the
/// target (counted after every pass), the pool never holds more than target + max_surge VMs
/// ready or coming, the leased VM of the old revision is never touched (reported as
/// stale-leased), and the rollout completes with one VM_DELETED_FOR_ROLLOUT per replaced VM,
/// POOL_ROLLOUT_COMPLETED once and the revision marked rolled out.
#[tokio::test]
async fn an_idle_pool_rolls_surge_first_without_losing_warm_capacity() {
    let app = TestApp::spawn().await;
    create_rolling(&app, 4, json!({"max_surge": 2})).await;
    // Under REPLACE_ON_DELETE the leased VM counts towards the 4: 3 AVAILABLE are warm.
    let leased = app.claimed(CLIENT_A, "ci", None).await;
    let started = put_spec(&app, rolling_spec(4, "ghcr.io/x/runner:2", json!({"max_surge": 2}))).await;
    assert_eq!(started.revision, 2);
    let r = started.status.rollout.as_ref().expect("a rollout");
    assert_eq!(r.state, poolmgr_core::domain::RolloutState::Progressing);
    assert_eq!((r.current_revision, r.target_revision), (1, 2));
    assert_eq!(app.count_events("ROLLOUT_STARTED").await, 1);

    let mut passes = 0;
    loop {
        app.pass().await;
        passes += 1;
        let vms = live_vms(&app).await;
        let available = vms.iter().filter(|(_, p)| p == "AVAILABLE").count();
        let ready_or_coming = vms.iter().filter(|(_, p)| p != "LEASED" && p != "QUARANTINED").count();
        assert!(available >= 3, "pass {passes}: warm capacity dropped to {available}: {vms:?}");
        assert!(ready_or_coming <= 3 + 2, "pass {passes}: more than target + surge: {vms:?}");
        if pool(&app).await.status.rollout.as_ref().unwrap().state == poolmgr_core::domain::RolloutState::Complete {
            break;
        }
        assert!(passes < 80, "the rollout never completed: {vms:?}");
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    let p = pool(&app).await;
    let r = p.status.rollout.unwrap();
    assert_eq!((r.current_revision, r.target_revision), (2, 2));
    assert_eq!(r.stale_leased, 1, "{r:?}");
    assert_eq!(r.extra_boots, 3, "three idle VMs replaced");
    assert_eq!(r.by_revision["2"]["available"], 3, "{r:?}");
    assert_eq!(r.by_revision["1"]["leased"], 1, "{r:?}");
    assert_eq!(app.count_events("VM_DELETED_FOR_ROLLOUT").await, 3);
    assert_eq!(app.count_events("POOL_ROLLOUT_COMPLETED").await, 1);
    assert_eq!(app.count_events("VM_DELETED_ON_SCALE_DOWN").await, 0, "the surge was never shed as surplus");
    assert_eq!(app.phase_of(&leased.vm.id).await.as_deref(), Some("LEASED"), "the leased VM was not touched");
    assert!(revisions(&app).await[0].rolled_out);
    // More passes change nothing.
    for _ in 0..3 {
        app.pass().await;
    }
    assert_eq!(app.count_events("POOL_ROLLOUT_COMPLETED").await, 1);
    assert_eq!(app.count_events("VM_DELETED_FOR_ROLLOUT").await, 3);
}

/// Item 2, `max_unavailable` without a surge: the stale VMs are retired before their
/// replacements are ready, never more than max_unavailable below the target, and never more
/// VMs than the target.
#[tokio::test]
async fn max_unavailable_without_a_surge_never_exceeds_the_target() {
    let app = TestApp::spawn().await;
    let policy = json!({"max_surge": 0, "max_unavailable": 1});
    create_rolling(&app, 3, policy.clone()).await;
    put_spec(&app, rolling_spec(3, "ghcr.io/x/runner:2", policy)).await;
    for pass in 0..80 {
        app.pass().await;
        let vms = live_vms(&app).await;
        let available = vms.iter().filter(|(_, p)| p == "AVAILABLE").count();
        assert!(vms.len() <= 3, "pass {pass}: above the target without a surge: {vms:?}");
        assert!(available >= 2, "pass {pass}: more than max_unavailable below the target: {vms:?}");
        if vms.iter().all(|(rev, p)| *rev == 2 && p == "AVAILABLE") && vms.len() == 3 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    panic!("never rolled: {:?}", live_vms(&app).await);
}

/// Item 2, the claims' preference: while a rollout runs, a claim takes a VM of the new
/// revision when there is one, although older ones are AVAILABLE (the moment is forced: the
/// passes stop as soon as a new VM is AVAILABLE, before any stale one could be retired).
#[tokio::test]
async fn claims_prefer_the_new_revision_while_a_rollout_runs() {
    let app = TestApp::spawn().await;
    create_rolling(&app, 3, json!({"max_surge": 1})).await;
    put_spec(&app, rolling_spec(3, "ghcr.io/x/runner:2", json!({"max_surge": 1}))).await;
    app.settle(40, "a VM of revision 2 AVAILABLE", || async {
        live_vms(&app).await.iter().any(|(rev, p)| *rev == 2 && p == "AVAILABLE")
    })
    .await;
    let stale = live_vms(&app).await.iter().filter(|(rev, p)| *rev == 1 && p == "AVAILABLE").count();
    assert!(stale >= 2, "stale VMs are still AVAILABLE: {:?}", live_vms(&app).await);
    let c = app.claimed(CLIENT_A, "ci", None).await;
    let rev: i32 =
        app.conn().await.query_one("SELECT revision FROM vms WHERE id = $1", &[&c.vm.id]).await.unwrap().get(0);
    assert_eq!(rev, 2, "the claim took a stale VM although a new one was AVAILABLE");
}

/// Item 3: a template whose VMs never boot (every new microVM ends FAILED) halts the rollout
/// after failure_threshold failed VMs — not a whole surge's worth: until one new VM is
/// AVAILABLE the surge is bounded by the failures left — and rolls the pool back to revision
/// 1; no healthy VM was retired and the warm capacity never dropped.
#[tokio::test]
async fn a_template_that_never_boots_halts_and_rolls_back_without_destroying_a_healthy_vm() {
    let app = TestApp::spawn().await;
    let policy = json!({"max_surge": "100%", "failure_threshold": 2});
    create_rolling(&app, 5, policy.clone()).await;
    let healthy: HashSet<String> = app
        .conn()
        .await
        .query("SELECT id FROM vms WHERE pool_name = 'ci'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Only the new image fails: replacements of the old one would still boot.
    app.sim.add_failing_image("broken");
    put_spec(&app, rolling_spec(5, "ghcr.io/x/broken:2", policy)).await;
    for pass in 0..80 {
        app.pass().await;
        assert_eq!(app.count_phase("ci", "AVAILABLE").await, 5, "pass {pass}: the warm capacity changed");
        if pool(&app).await.status.rollout.as_ref().unwrap().state == poolmgr_core::domain::RolloutState::RolledBack {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    let p = pool(&app).await;
    let r = p.status.rollout.as_ref().unwrap();
    assert_eq!(r.state, poolmgr_core::domain::RolloutState::RolledBack, "{r:?}");
    assert!(r.halted_reason.as_deref().unwrap().contains("failed"), "{r:?}");
    assert_eq!(p.revision, 1, "back on revision 1");
    let image =
        serde_json::to_value(&p.spec.microvm_template).unwrap()["root_volume"]["source"]["container_source"].clone();
    assert_eq!(image, json!("ghcr.io/x/runner:1"), "the template is revision 1's again");
    assert_eq!(app.count_events("ROLLOUT_HALTED").await, 1);
    assert_eq!(app.count_events("ROLLOUT_ROLLED_BACK").await, 1);
    assert_eq!(app.count_events("VM_DELETED_FOR_ROLLOUT").await, 0, "no healthy VM was retired");
    let failed = app.scalar_i64("SELECT count(*) FROM events WHERE type = 'VM_HOOK_FAILED'").await;
    assert_eq!(failed, 2, "halted after the threshold, not after the surge of 5");
    let still: HashSet<String> = app
        .conn()
        .await
        .query("SELECT id FROM vms WHERE pool_name = 'ci' AND phase = 'AVAILABLE'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(still, healthy, "the healthy VMs are the ones the pool had");
    // The next change rolls again, numbered after the halted revision.
    let next = put_spec(&app, rolling_spec(5, "ghcr.io/x/runner:3", json!({"max_surge": 1}))).await;
    assert_eq!(next.revision, 3);
}

/// Item 3, the progress deadline: new VMs that never finish booting halt the rollout once none
/// became AVAILABLE for progress_deadline_seconds; without auto_rollback it stays HALTED on
/// the new revision, and nothing else changes.
#[tokio::test]
async fn a_rollout_without_progress_halts_at_its_deadline() {
    let app = TestApp::spawn().await;
    let policy = json!({"max_surge": 1, "progress_deadline_seconds": 2, "auto_rollback": false});
    create_rolling(&app, 2, policy.clone()).await;
    app.sim.set_boot_delay(std::time::Duration::from_secs(3600));
    put_spec(&app, rolling_spec(2, "ghcr.io/x/slow:2", policy)).await;
    let started = std::time::Instant::now();
    loop {
        app.pass().await;
        let ev: Vec<String> = app
            .conn()
            .await
            .query("SELECT type || ' ' || payload::text FROM events ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(app.count_phase("ci", "AVAILABLE").await, 2, "{:?} {ev:#?}", live_vms(&app).await);
        if pool(&app).await.status.rollout.as_ref().unwrap().state == poolmgr_core::domain::RolloutState::Halted {
            break;
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(60), "never halted");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(started.elapsed() >= std::time::Duration::from_secs(2), "halted before the deadline");
    let p = pool(&app).await;
    assert_eq!(p.revision, 2);
    let r = p.status.rollout.unwrap();
    assert!(r.halted_reason.as_deref().unwrap().contains("progress_deadline_seconds"), "{r:?}");
    assert_eq!(app.count_events("ROLLOUT_ROLLED_BACK").await, 0);
}

/// A rollout policy is checked like the rest of the spec: each bad one is a 400 naming the
/// field, and changes nothing.
#[tokio::test]
async fn bad_rollout_policies_are_invalid_argument_and_change_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    for (bad, names) in [
        (json!({"max_surge": "150%"}), "max_surge"),
        (json!({"max_surge": -1}), "max_surge"),
        (json!({"max_surge": 0, "max_unavailable": 0}), "max_unavailable"),
        (json!({"failure_threshold": 0}), "failure_threshold"),
        (json!({"progress_deadline_seconds": 0}), "progress_deadline_seconds"),
        (json!({"claim_preference": "NEWEST"}), "claim_preference"),
        (json!({"surge": 1}), "surge"),
    ] {
        let r = app.put(ADMIN, POOL_PATH, rolling_spec(1, "ghcr.io/x/runner:9", bad.clone())).await;
        r.assert_error(400, "INVALID_ARGUMENT");
        let msg = r.body["error"]["message"].as_str().unwrap();
        // serde names the allowed values where it cannot name the field.
        assert!(msg.contains(names) || msg.contains("percentage") || msg.contains("CURRENT"), "{bad}: {msg}");
    }
    let p = pool(&app).await;
    assert_eq!(p.revision, 1);
    assert!(p.spec.rollout.is_none());
}

/// Item 4: a running rollout pauses (nothing is surged or retired while paused, the counts
/// frozen across passes) and resumes to completion; pausing or resuming when there is
/// nothing to pause or resume is FAILED_PRECONDITION and changes nothing.
#[tokio::test]
async fn a_rollout_pauses_and_resumes() {
    let app = TestApp::spawn().await;
    let policy = json!({"max_surge": 1});
    create_rolling(&app, 3, policy.clone()).await;
    app.post(ADMIN, &format!("{POOL_PATH}/rollout/pause"), json!(null)).await.assert_error(400, "FAILED_PRECONDITION");
    put_spec(&app, rolling_spec(3, "ghcr.io/x/runner:2", policy)).await;
    let paused: api::Pool =
        app.post(ADMIN, &format!("{POOL_PATH}/rollout/pause"), json!(null)).await.assert_ok_response(200).json();
    assert_eq!(paused.status.rollout.as_ref().unwrap().state, poolmgr_core::domain::RolloutState::Paused);
    app.post(ADMIN, &format!("{POOL_PATH}/rollout/pause"), json!(null)).await.assert_error(400, "FAILED_PRECONDITION");
    for _ in 0..5 {
        app.pass().await;
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    assert!(
        live_vms(&app).await.iter().all(|(rev, _)| *rev == 1),
        "nothing made while paused: {:?}",
        live_vms(&app).await
    );
    assert_eq!(app.count_events("VM_DELETED_FOR_ROLLOUT").await, 0);
    let resumed: api::Pool =
        app.post(ADMIN, &format!("{POOL_PATH}/rollout/resume"), json!(null)).await.assert_ok_response(200).json();
    assert_eq!(resumed.status.rollout.as_ref().unwrap().state, poolmgr_core::domain::RolloutState::Progressing);
    app.settle(80, "the rollout complete", || async {
        pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete
    })
    .await;
    assert!(live_vms(&app).await.iter().all(|(rev, p)| *rev == 2 && p == "AVAILABLE"));
    app.post(ADMIN, &format!("{POOL_PATH}/rollout/resume"), json!(null)).await.assert_error(400, "FAILED_PRECONDITION");
    app.post(CLIENT_A, &format!("{POOL_PATH}/rollout/pause"), json!(null)).await.assert_error(403, "PERMISSION_DENIED");
}

/// Item 4: undo returns the pool to a kept revision (the previous one by default) with a
/// rollout to it: the template is that revision's again, the VMs end on it, and the events
/// name who asked. An unknown revision, the current one, and a pool without a policy are
/// refused and change nothing.
#[tokio::test]
async fn undo_rolls_back_to_a_kept_revision() {
    let app = TestApp::spawn().await;
    let policy = json!({"max_surge": 2});
    create_rolling(&app, 2, policy.clone()).await;
    put_spec(&app, rolling_spec(2, "ghcr.io/x/runner:2", policy.clone())).await;
    app.settle(80, "revision 2 rolled out", || async {
        pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete
    })
    .await;
    let undo = format!("{POOL_PATH}/rollout/undo");
    app.post(ADMIN, &undo, json!({"to_revision": 7})).await.assert_error(400, "INVALID_ARGUMENT");
    app.post(ADMIN, &undo, json!({"to_revision": 2})).await.assert_error(400, "FAILED_PRECONDITION");
    app.post(ADMIN, &undo, json!({"to": 1})).await.assert_error(400, "INVALID_ARGUMENT");
    assert_eq!(pool(&app).await.revision, 2, "the refusals changed nothing");
    let back: api::Pool = app.post(ADMIN, &undo, json!({})).await.assert_ok_response(200).json();
    assert_eq!(back.revision, 1);
    let image =
        serde_json::to_value(&back.spec.microvm_template).unwrap()["root_volume"]["source"]["container_source"].clone();
    assert_eq!(image, json!("ghcr.io/x/runner:1"));
    let r = back.status.rollout.unwrap();
    assert_eq!(
        (r.state, r.current_revision, r.target_revision),
        (poolmgr_core::domain::RolloutState::Progressing, 2, 1)
    );
    app.settle(80, "back on revision 1", || async {
        pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete
    })
    .await;
    assert!(live_vms(&app).await.iter().all(|(rev, p)| *rev == 1 && p == "AVAILABLE"), "{:?}", live_vms(&app).await);
    let by: String = app
        .conn()
        .await
        .query_one("SELECT payload->>'by' FROM events WHERE type = 'ROLLOUT_STARTED' ORDER BY id DESC LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(by, "admin");
    // Without a policy there is no rollout to undo through.
    put_spec(&app, spec_with_image(2, "ghcr.io/x/runner:1")).await;
    app.post(ADMIN, &undo, json!({})).await.assert_error(400, "FAILED_PRECONDITION");
}

/// Item 5: a scale-in takes the stale VMs first (another revision than the pool's), even
/// when they are younger than the current revision's.
#[tokio::test]
async fn a_scale_in_takes_the_stale_vms_first() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 2).await;
    app.settle(40, "2 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    // Two VMs of revision 1; the pool moves to revision 2 without a rollout, and two VMs of
    // revision 2 are added (older than nothing: the stale ones are the older here, so make
    // them look younger to be sure the revision, not the age, decides).
    put_spec(&app, spec_with_image(4, "ghcr.io/x/runner:2")).await;
    app.settle(40, "4 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
    app.conn()
        .await
        .execute("UPDATE vms SET created_at = now() + interval '1 hour' WHERE pool_name = 'ci' AND revision = 1", &[])
        .await
        .unwrap();
    put_spec(&app, spec_with_image(2, "ghcr.io/x/runner:2")).await;
    app.settle(40, "2 AVAILABLE again", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    let left = live_vms(&app).await;
    assert!(left.iter().all(|(rev, _)| *rev == 2), "the stale VMs went first: {left:?}");
}

/// Item 5, raced: overlapping passes (four at once, again and again) step a rolling,
/// autoscaled pool: the pool never holds more VMs than its ceiling, never fewer warm ones than
/// its target, each stale VM is retired once (one VM_DELETED_FOR_ROLLOUT each, counted in
/// extra_boots), and the rollout completes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_passes_roll_a_pool_within_its_ceiling_and_retire_each_vm_once() {
    let app = Arc::new(TestApp::spawn().await);
    let mut spec = rolling_spec(4, "ghcr.io/x/runner:1", json!({"max_surge": "100%"}));
    spec["autoscaling"] = json!({"min": 4, "max": 6, "buffer": 4});
    app.post(ADMIN, "/v1/pools", spec.clone()).await.assert_ok(201);
    app.settle(60, "4 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!("ghcr.io/x/runner:2");
    put_spec(&app, spec).await;
    for round in 0..60 {
        let passes = (0..4).map(|_| {
            let app = app.clone();
            tokio::spawn(async move { app.pass().await })
        });
        futures::future::join_all(passes).await;
        let vms = live_vms(&app).await;
        assert!(vms.len() <= 6, "round {round}: above the ceiling of 6: {vms:?}");
        let available = vms.iter().filter(|(_, p)| p == "AVAILABLE").count();
        assert!(available >= 4, "round {round}: the warm capacity dropped: {vms:?}");
        if pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    let p = pool(&app).await;
    let r = p.status.rollout.unwrap();
    assert_eq!(r.state, poolmgr_core::domain::RolloutState::Complete, "{r:?}");
    let retired = app.scalar_i64("SELECT count(*) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await;
    let distinct =
        app.scalar_i64("SELECT count(DISTINCT vm_id) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await;
    assert_eq!(retired, 4, "each of the 4 stale VMs retired");
    assert_eq!(distinct, retired, "no VM retired twice");
    assert_eq!(i64::from(r.extra_boots), retired);
    assert_eq!(app.count_events("POOL_ROLLOUT_COMPLETED").await, 1);
    assert!(live_vms(&app).await.iter().all(|(rev, _)| *rev == 2));
}

/// Item 5, killed passes: passes cut off at random points of their work (the task aborted
/// after 0–40 ms, its pool lease then let go as its expiry would) step a rolling pool. Every
/// step is one guarded statement, so the rollout still completes, within the ceiling and the
/// warm floor, with each stale VM retired once and one POOL_ROLLOUT_COMPLETED.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_killed_at_any_point_still_finish_the_rollout_once() {
    let app = Arc::new(TestApp::spawn().await);
    let mut spec = rolling_spec(4, "ghcr.io/x/runner:1", json!({"max_surge": 2}));
    spec["autoscaling"] = json!({"min": 4, "max": 6, "buffer": 4});
    app.post(ADMIN, "/v1/pools", spec.clone()).await.assert_ok(201);
    app.settle(60, "4 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 4 }).await;
    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!("ghcr.io/x/runner:2");
    put_spec(&app, spec).await;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for round in 0..150 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let cut = std::time::Duration::from_millis(seed % 41);
        let a = app.clone();
        let pass = tokio::spawn(async move { a.pass().await });
        tokio::time::sleep(cut).await;
        pass.abort();
        let _ = pass.await;
        // The killed pass's pool lease, expired.
        app.conn().await.execute("UPDATE pools SET reconcile_until = '-infinity'", &[]).await.unwrap();
        let vms = live_vms(&app).await;
        assert!(vms.len() <= 6, "round {round}: above the ceiling of 6: {vms:?}");
        let available = vms.iter().filter(|(_, p)| p == "AVAILABLE").count();
        assert!(available >= 4, "round {round}: the warm capacity dropped: {vms:?}");
        if pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Whatever the cuts left, whole passes finish it.
    app.settle(60, "the rollout complete", || async {
        pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete
    })
    .await;
    let retired = app.scalar_i64("SELECT count(*) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await;
    let distinct =
        app.scalar_i64("SELECT count(DISTINCT vm_id) FROM events WHERE type = 'VM_DELETED_FOR_ROLLOUT'").await;
    assert_eq!((retired, distinct), (4, 4), "each stale VM retired once");
    assert_eq!(app.count_events("POOL_ROLLOUT_COMPLETED").await, 1);
    assert_eq!(i64::from(pool(&app).await.status.rollout.unwrap().extra_boots), retired);
    assert!(live_vms(&app).await.iter().all(|(rev, _)| *rev == 2));
}

/// Item 2, a busy pool: one that runs below its target (here a refill that does not finish
/// booting) still rolls. The floor of target - max_unavailable never let a stale VM go there;
/// the rollout keeps the warm capacity the pool had when it started instead, and retires a
/// stale VM each time a new one is AVAILABLE above it.
#[tokio::test]
async fn a_pool_running_below_its_target_still_rolls_without_losing_warm_capacity() {
    let app = TestApp::spawn().await;
    let mut spec = rolling_spec(3, "ghcr.io/x/runner:1", json!({"max_surge": 1}));
    spec["replenishment"] = json!({"strategy": "IMMEDIATE_ON_LEASE"});
    app.post(ADMIN, "/v1/pools", spec.clone()).await.assert_ok(201);
    app.settle(60, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    // A claim whose refill never finishes booting: 2 AVAILABLE + 1 PROVISIONING from now on.
    app.sim.set_boot_delay(std::time::Duration::from_secs(3600));
    app.claimed(CLIENT_A, "ci", None).await;
    app.settle(20, "the refill placed", || async { app.count_phase("ci", "PROVISIONING").await == 1 }).await;
    app.sim.set_boot_delay(std::time::Duration::from_millis(50));
    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!("ghcr.io/x/runner:2");
    put_spec(&app, spec).await;
    for pass in 0..80 {
        app.pass().await;
        let vms = live_vms(&app).await;
        let available = vms.iter().filter(|(_, p)| p == "AVAILABLE").count();
        assert!(available >= 2, "pass {pass}: below the warm capacity the rollout started with: {vms:?}");
        if !vms.iter().any(|(rev, p)| *rev == 1 && p == "AVAILABLE") {
            assert_eq!(app.count_events("VM_DELETED_FOR_ROLLOUT").await, 2, "{vms:?}");
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    panic!("the stale AVAILABLE VMs were never replaced: {:?}", live_vms(&app).await);
}

/// Item 2, a busy pool rolls by its own claims: under claim_preference ANY a claim takes a
/// stale VM first (the oldest), so claims retire them at no extra boot, and the rollout
/// counts on the last window's claims instead of replacing those VMs actively.
#[tokio::test]
async fn under_any_claims_use_up_the_stale_vms_first() {
    let app = TestApp::spawn().await;
    let policy = json!({"max_surge": 1, "claim_preference": "ANY", "window_seconds": 3600});
    let mut spec = rolling_spec(3, "ghcr.io/x/runner:1", policy);
    spec["replenishment"] = json!({"strategy": "IMMEDIATE_ON_LEASE"});
    app.post(ADMIN, "/v1/pools", spec.clone()).await.assert_ok(201);
    app.settle(60, "3 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    // Claims in the last window: the rollout counts on as many stale VMs being claimed.
    for _ in 0..3 {
        app.claimed(CLIENT_A, "ci", None).await;
    }
    app.settle(60, "3 AVAILABLE again", || async { app.count_phase("ci", "AVAILABLE").await == 3 }).await;
    spec["microvm_template"]["root_volume"]["source"]["container_source"] = json!("ghcr.io/x/runner:2");
    put_spec(&app, spec).await;
    for _ in 0..3 {
        app.pass().await;
    }
    // Nothing was replaced actively: the claims of the window will take the stale VMs.
    assert_eq!(app.count_events("VM_DELETED_FOR_ROLLOUT").await, 0);
    for i in 0..3 {
        let c = app.claimed(CLIENT_A, "ci", None).await;
        let rev: i32 =
            app.conn().await.query_one("SELECT revision FROM vms WHERE id = $1", &[&c.vm.id]).await.unwrap().get(0);
        assert_eq!(rev, 1, "claim {i} took a new VM while stale ones were AVAILABLE");
    }
    app.settle(60, "the rollout complete", || async {
        pool(&app).await.status.rollout.unwrap().state == poolmgr_core::domain::RolloutState::Complete
    })
    .await;
    assert_eq!(pool(&app).await.status.rollout.unwrap().extra_boots, 0, "rolled by its claims alone");
}

/// On one database connection, as on Lambda, pause, resume and undo answer 200: they gave
/// their connection back before the wake and the answer's read, which waited for it and
/// answered 503 after the change had committed (found in review).
#[tokio::test]
async fn on_one_connection_pause_resume_and_undo_answer() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_DB_POOL_SIZE".into(), "1".into()))).await;
    let policy = json!({"max_surge": 1});
    create_rolling(&app, 1, policy.clone()).await;
    put_spec(&app, rolling_spec(1, "ghcr.io/x/runner:2", policy)).await;
    let paused: api::Pool =
        app.post(ADMIN, &format!("{POOL_PATH}/rollout/pause"), json!(null)).await.assert_ok_response(200).json();
    assert_eq!(paused.status.rollout.unwrap().state, poolmgr_core::domain::RolloutState::Paused);
    let resumed: api::Pool =
        app.post(ADMIN, &format!("{POOL_PATH}/rollout/resume"), json!(null)).await.assert_ok_response(200).json();
    assert_eq!(resumed.status.rollout.unwrap().state, poolmgr_core::domain::RolloutState::Progressing);
    let back: api::Pool =
        app.post(ADMIN, &format!("{POOL_PATH}/rollout/undo"), json!({})).await.assert_ok_response(200).json();
    assert_eq!(back.revision, 1);
}
