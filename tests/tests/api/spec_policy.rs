//! The deployment's spec policy (issue 25 item 1): which host directories, bridges and images
//! a pool's template may use, set by the deployment (`POOLMGR_POLICY_*`), never by the API.
//! A spec outside it is a 400 naming the field that changes nothing; a pool stored before the
//! policy was tightened gets no new VM.

use poolmgr_core::api;
use poolmgr_tests::{ADMIN, TestApp, pool_spec};
use serde_json::{Value, json};

const POOL_PATH: &str = "/v1/pools/default/ci";

fn with_volume(source: Value) -> Value {
    let mut spec = pool_spec("ci", 0);
    spec["microvm_template"]["provider"] = json!("cloudhypervisor");
    spec["microvm_template"]["additional_volumes"] = json!([{"id": "data", "source": source}]);
    spec
}

fn with_bridge(bridge: &str) -> Value {
    let mut spec = pool_spec("ci", 0);
    spec["microvm_template"]["interfaces"][0]["overrides"] = json!({"bridge_name": bridge});
    spec
}

/// POST is refused with the policy's 400 naming `field`, and no pool is created.
async fn refused(app: &TestApp, spec: Value, field: &str) {
    let r = app.post(ADMIN, "/v1/pools", spec).await;
    r.assert_reason(400, "INVALID_ARGUMENT", "SPEC_POLICY");
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("microvm_template.{field} ")), "the field is not named: {msg}");
    assert!(msg.contains("POOLMGR_POLICY_"), "the message does not say which setting widens it: {msg}");
    app.get(ADMIN, POOL_PATH).await.assert_error(404, "NOT_FOUND");
}

async fn accepted(app: &TestApp, spec: Value) {
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    app.delete(ADMIN, POOL_PATH).await.assert_ok(204);
}

/// The defaults: no host directory, no bridge override; any image.
#[tokio::test]
async fn by_default_no_host_directory_or_bridge_is_allowed() {
    let app = TestApp::spawn().await;
    let field = "additional_volumes[0].source.virtiofs_source";
    // The attack of the issue: the host's root shared into the guest.
    refused(&app, with_volume(json!({"virtiofs_source": "/"})), field).await;
    refused(&app, with_volume(json!({"virtiofs_source": "/srv/share"})), field).await;
    refused(&app, with_bridge("br0"), "interfaces[0].overrides.bridge_name").await;
    let mut any_image = pool_spec("ci", 0);
    any_image["microvm_template"]["root_volume"]["source"]["container_source"] = json!("example.net/anything:1");
    accepted(&app, any_image).await;
    assert_eq!(app.count_events("POOL_CREATED").await, 1, "a refused spec recorded a pool");
}

#[tokio::test]
async fn virtiofs_paths_are_compared_component_by_component() {
    let app =
        TestApp::spawn_with(|env| env.push(("POOLMGR_POLICY_VIRTIOFS_PATHS".into(), "/srv/share, /data".into()))).await;
    let field = "additional_volumes[0].source.virtiofs_source";
    accepted(&app, with_volume(json!({"virtiofs_source": "/srv/share"}))).await;
    accepted(&app, with_volume(json!({"virtiofs_source": "/srv/share/team-a"}))).await;
    accepted(&app, with_volume(json!({"virtiofs_source": "/data"}))).await;
    for outside in ["/srv/shared", "/srv", "/", "/etc", "/srv/share/../../etc", "/srv/share/./x", "srv/share"] {
        let r = app.post(ADMIN, "/v1/pools", with_volume(json!({"virtiofs_source": outside}))).await;
        r.assert_error(400, "INVALID_ARGUMENT");
        let msg = r.body["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field), "{outside}: {msg}");
    }
    app.get(ADMIN, POOL_PATH).await.assert_error(404, "NOT_FOUND");
}

#[tokio::test]
async fn bridges_and_image_prefixes_are_allowed_by_list() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_POLICY_BRIDGES".into(), "br0,br-ci".into()));
        env.push(("POOLMGR_POLICY_IMAGE_PREFIXES".into(), "ghcr.io/liquidmetal-dev/".into()));
    })
    .await;
    accepted(&app, with_bridge("br-ci")).await;
    refused(&app, with_bridge("br1"), "interfaces[0].overrides.bridge_name").await;
    // The harness's template pins every image under the prefix.
    accepted(&app, pool_spec("ci", 0)).await;
    for (pointer, field) in [
        ("/microvm_template/kernel/image", "kernel.image"),
        ("/microvm_template/root_volume/source/container_source", "root_volume.source.container_source"),
    ] {
        let mut spec = pool_spec("ci", 0);
        *spec.pointer_mut(pointer).unwrap() = json!("ghcr.io/liquidmetal-devil/x:1");
        refused(&app, spec, field).await;
    }
    let mut initrd = pool_spec("ci", 0);
    initrd["microvm_template"]["initrd"] = json!({"image": "docker.io/x/initrd:1"});
    refused(&app, initrd, "initrd.image").await;
}

/// A PUT outside the policy changes nothing: same revision, same template.
#[tokio::test]
async fn an_update_outside_the_policy_changes_nothing() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_POLICY_IMAGE_PREFIXES".into(), "ghcr.io/".into()))).await;
    let before = app.created_pool(pool_spec("ci", 0)).await;
    let mut spec = pool_spec("ci", 0);
    spec["microvm_template"]["kernel"]["image"] = json!("registry.example/k:1");
    app.put(ADMIN, POOL_PATH, spec).await.assert_reason(400, "INVALID_ARGUMENT", "SPEC_POLICY");
    let after = app.get_pool("ci").await;
    assert_eq!(after.revision, before.revision);
    assert_eq!(after.spec.microvm_template, before.spec.microvm_template);
    assert_eq!(app.count_events("POOL_UPDATED").await, 0);
}

/// A pool stored before the policy was tightened: the redeployed reconciler creates none of
/// its VMs and says why (POOL_SIZE_BELOW_TARGET); an undo to a revision outside the policy
/// is refused; a spec within it fills the pool again.
#[tokio::test]
async fn a_tightened_policy_holds_back_pools_stored_before_it() {
    let app = TestApp::spawn().await;
    let mut old = pool_spec("ci", 2);
    old["microvm_template"]["root_volume"]["source"]["container_source"] = json!("example.net/old:1");
    old["rollout"] = json!({});
    app.created_pool(old).await;
    let app = app.redeployed(|env| env.push(("POOLMGR_POLICY_IMAGE_PREFIXES".into(), "ghcr.io/".into())));
    for _ in 0..3 {
        app.pass().await;
    }
    assert!(app.list_vms("").await.is_empty(), "VMs created for a spec outside the policy");
    let feed = app.events("").await;
    let held: Vec<&api::Event> = feed.events.iter().filter(|e| e.kind == "POOL_SIZE_BELOW_TARGET").collect();
    assert_eq!(held.len(), 1, "one event per change of reason, not per pass: {:?}", feed.events);
    let reason = held[0].payload["reason"].as_str().unwrap();
    assert!(reason.contains("microvm_template.root_volume.source.container_source"), "{reason}");

    // Within the policy again: revision 2 fills the pool.
    app.updated_pool("ci", {
        let mut s = pool_spec("ci", 2);
        s["rollout"] = json!({});
        s
    })
    .await;
    app.settle(60, "the pool full", || async { app.count_phase("ci", "AVAILABLE").await == 2 }).await;
    // Back to revision 1 would bring the refused image back.
    let r = app.post(ADMIN, &format!("{POOL_PATH}/rollout/undo"), json!({"to_revision": 1})).await;
    r.assert_reason(400, "INVALID_ARGUMENT", "SPEC_POLICY");
    assert_eq!(app.get_pool("ci").await.revision, 2);
}
