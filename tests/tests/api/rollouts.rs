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
