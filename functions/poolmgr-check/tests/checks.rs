//! Every check of poolmgr-check fires on a deliberately broken state and stays quiet on a
//! healthy one: a real database (scripts/test.sh) and the simulator over gRPC.

use std::process::Command;
use std::time::Duration;

use flintlock_proto::types::micro_vm_status::MicroVmState;
use poolmgr_check::{Class, Mode, Options, Outcome, Verdict, check_once, run};
use poolmgr_core::domain::Phase;
use poolmgr_tests::*;

fn opts(app: &TestApp) -> Options {
    Options {
        database_url: app.db.url.clone(),
        db_tls: Default::default(),
        flintlock_overrides: vec![],
        namespace_prefix: "poolmgr-".into(),
        deployment_id: None,
        flintlock_timeout: Duration::from_secs(3),
        credentials: app.state.config.credentials.clone(),
    }
}

async fn check(app: &TestApp) -> Outcome {
    check_once(&opts(app)).await.expect("check runs")
}

/// A pool `ci` of `size` filled by reconcile passes.
async fn filled(size: i32) -> TestApp {
    let app = TestApp::spawn().await;
    app.create_pool("ci", size).await;
    app.settle(100, "pool ci full", || async { app.count_phase("ci", "AVAILABLE").await == i64::from(size) }).await;
    app
}

fn checks_of(o: &Outcome) -> Vec<&'static str> {
    o.findings.iter().map(|f| f.check).collect()
}

#[track_caller]
fn assert_finding(o: &Outcome, check: &str, class: Class, subject_has: &str) {
    let f = o
        .findings
        .iter()
        .find(|f| f.check == check)
        .unwrap_or_else(|| panic!("expected a {check} finding, got {:?}", checks_of(o)));
    assert_eq!(f.class, class, "{f}");
    assert!(f.subject.contains(subject_has), "subject {:?} should name {subject_has:?}", f.subject);
    assert!(!f.look_at.is_empty(), "{f}");
}

async fn lease_vm(app: &TestApp, lease_id: &str) -> String {
    app.conn().await.query_one("SELECT vm_id FROM leases WHERE lease_id = $1", &[&lease_id]).await.unwrap().get(0)
}

async fn sql(app: &TestApp, s: &str) {
    app.conn().await.batch_execute(s).await.unwrap_or_else(|e| panic!("{s}: {e}"));
}

#[tokio::test]
async fn a_healthy_settled_system_has_no_finding() {
    let app = filled(3).await;
    let lease = app.claim(CLIENT_A, "ci", Some("job-1")).await.assert_ok(200)["lease"]["lease_id"].clone();
    assert!(lease.is_string());
    // The leased VM is replaced (REPLACE_ON_DELETE counts it): still settled at size 3.
    let o = check(&app).await;
    assert!(o.findings.is_empty(), "{:?}", o.findings);
    assert_eq!((o.stats.pools, o.stats.vms, o.stats.leases, o.stats.hosts), (1, 3, 1, 1));
    assert_eq!(o.stats.flintlock_vms, 3);
    let (verdict, _) = run(&opts(&app), Mode::Settled).await;
    assert_eq!(verdict, Verdict::Clean);
}

#[tokio::test]
async fn a_leased_vm_without_a_lease_is_a_violation() {
    let app = filled(2).await;
    sql(&app, "UPDATE vms SET phase = 'LEASED' WHERE id = (SELECT id FROM vms ORDER BY id LIMIT 1)").await;
    let o = check(&app).await;
    assert_finding(&o, "leased-vm-without-lease", Class::Always, "vm ci-");
    assert_eq!(o.violations(false).len(), 1, "{:?}", checks_of(&o));
}

#[tokio::test]
async fn a_lease_on_an_available_vm_is_a_violation() {
    let app = filled(2).await;
    let r = app.claim(CLIENT_A, "ci", Some("job-1")).await;
    let lease = r.assert_ok(200)["lease"]["lease_id"].as_str().unwrap().to_string();
    let vm = lease_vm(&app, &lease).await;
    app.conn().await.execute("UPDATE vms SET phase = 'AVAILABLE' WHERE id = $1", &[&vm]).await.unwrap();
    let o = check(&app).await;
    assert_finding(&o, "lease-on-unleased-vm", Class::Always, &lease);
}

#[tokio::test]
async fn two_leases_on_one_vm_are_a_violation() {
    let app = filled(2).await;
    let r = app.claim(CLIENT_A, "ci", None).await;
    let lease = r.assert_ok(200)["lease"]["lease_id"].as_str().unwrap().to_string();
    let vm = lease_vm(&app, &lease).await;
    // Only possible with the constraint gone: the checker must not rely on it.
    sql(&app, "ALTER TABLE leases DROP CONSTRAINT leases_vm_id_key").await;
    app.conn()
        .await
        .execute(
            "INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at, principal)
             SELECT 'second-lease', vm_id, pool_namespace, pool_name, now(), now(), expires_at, principal FROM leases WHERE lease_id = $1",
            &[&lease],
        )
        .await
        .unwrap();
    let o = check(&app).await;
    assert_finding(&o, "vm-with-several-leases", Class::Always, &vm);
    assert!(o.has("leased-vm-lease-mismatch"), "the second lease is not the VM's: {:?}", checks_of(&o));
}

#[tokio::test]
async fn one_request_id_with_two_leases_is_a_violation() {
    let app = filled(3).await;
    let first = app.claim(CLIENT_A, "ci", Some("job-dup")).await;
    let first = first.assert_ok(200)["lease"]["lease_id"].as_str().unwrap().to_string();
    // A claim without request_id, then given the same id: what a broken replay would leave.
    let second = app.claim(CLIENT_A, "ci", None).await;
    let second = second.assert_ok(200)["lease"]["lease_id"].as_str().unwrap().to_string();
    // Only possible with the unique index gone (dropped after the claims, which name it).
    sql(&app, "DROP INDEX leases_principal_request_id").await;
    app.conn().await.execute("UPDATE leases SET request_id = 'job-dup' WHERE lease_id = $1", &[&second]).await.unwrap();
    let o = check(&app).await;
    assert_finding(&o, "request-id-with-several-leases", Class::Always, "job-dup");
    let f = o.findings.iter().find(|f| f.check == "request-id-with-several-leases").unwrap();
    assert!(f.detail.contains(&first) && f.detail.contains(&second), "{f}");
}

#[tokio::test]
async fn a_lease_whose_vm_row_is_gone_or_on_another_pool_is_a_violation() {
    let app = filled(3).await;
    let a = app.claim(CLIENT_A, "ci", None).await.assert_ok(200)["lease"]["lease_id"].as_str().unwrap().to_string();
    let b = app.claim(CLIENT_A, "ci", None).await.assert_ok(200)["lease"]["lease_id"].as_str().unwrap().to_string();
    let vm_a = lease_vm(&app, &a).await;
    app.conn().await.execute("DELETE FROM vms WHERE id = $1", &[&vm_a]).await.unwrap();
    app.conn().await.execute("UPDATE leases SET pool_name = 'other' WHERE lease_id = $1", &[&b]).await.unwrap();
    let o = check(&app).await;
    assert_finding(&o, "lease-without-vm", Class::Always, &a);
    assert_finding(&o, "lease-pool-mismatch", Class::Always, &b);
}

#[tokio::test]
async fn rows_the_schema_allows_but_the_design_forbids_are_violations() {
    let app = filled(3).await;
    let ids: Vec<String> =
        app.conn().await.query("SELECT id FROM vms ORDER BY id", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    let c = app.conn().await;
    c.execute("UPDATE vms SET uid = NULL WHERE id = $1", &[&ids[0]]).await.unwrap();
    c.execute("UPDATE vms SET flintlock_host = 'nowhere' WHERE id = $1", &[&ids[1]]).await.unwrap();
    c.execute(
        "INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase)
         SELECT 'twin', uid, pool_namespace, pool_name, flintlock_host, 'AVAILABLE' FROM vms WHERE id = $1",
        &[&ids[2]],
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase)
         VALUES ('stray', 'UIDSTRAY', 'default', 'gone', 'sim', 'AVAILABLE')",
        &[],
    )
    .await
    .unwrap();
    drop(c);
    let o = check(&app).await;
    assert_finding(&o, "live-vm-without-uid", Class::Always, &ids[0]);
    assert_finding(&o, "vm-on-unknown-host", Class::Always, &ids[1]);
    assert_finding(&o, "microvm-with-several-rows", Class::Always, "on host sim");
    assert_finding(&o, "vm-of-deleted-pool", Class::Always, "stray");
}

#[tokio::test]
async fn an_orphan_microvm_is_a_settled_violation_only() {
    let app = filled(2).await;
    let ns = app.flintlock_namespace("default").await;
    let uid = app.sim.insert_vm(&ns, "ci-01jghost0000000000000000", MicroVmState::Created);
    // Not this deployment's namespace: never an orphan (another deployment's, poolmgr's
    // namespace from before deployment ids, anyone's).
    app.sim.insert_vm("someone-else", "theirs", MicroVmState::Created);
    app.sim.insert_vm("poolmgr-0ther-default", "ci-01jother000000000000000", MicroVmState::Created);
    app.sim.insert_vm("poolmgr-default", "ci-01jlegacy00000000000000", MicroVmState::Created);
    let o = check(&app).await;
    assert_finding(&o, "orphan-vm", Class::Settled, &uid);
    assert_eq!(o.findings.len(), 1, "{:?}", checks_of(&o));
    assert!(o.violations(false).is_empty());
    assert_eq!(o.violations(true).len(), 1);
    assert_eq!(run(&opts(&app), Mode::Once).await.0, Verdict::Clean);
    assert_eq!(run(&opts(&app), Mode::Settled).await.0, Verdict::Violations);
}

#[tokio::test]
async fn a_duplicate_create_of_a_row_is_an_orphan() {
    let app = filled(1).await;
    let id: String = app.conn().await.query_one("SELECT id FROM vms", &[]).await.unwrap().get(0);
    let dup = app.sim.insert_vm(&app.flintlock_namespace("default").await, &id, MicroVmState::Created);
    let o = check(&app).await;
    assert_finding(&o, "orphan-vm", Class::Settled, &dup);
    assert!(o.findings[0].detail.contains("duplicate create"), "{}", o.findings[0]);
}

#[tokio::test]
async fn a_row_whose_microvm_vanished_is_a_settled_violation() {
    let app = filled(2).await;
    let (id, uid): (String, String) = {
        let r = app.conn().await.query_one("SELECT id, uid FROM vms ORDER BY id LIMIT 1", &[]).await.unwrap();
        (r.get(0), r.get(1))
    };
    let host = poolmgr_core::store::host_get(&**app.conn().await, SIM_HOST).await.unwrap().unwrap().0;
    app.state.flintlock.delete(&host.endpoint(), &uid).await.unwrap();
    for _ in 0..100 {
        if app.sim.vm(&uid).is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let o = check(&app).await;
    assert_finding(&o, "row-without-vm", Class::Settled, &id);
}

#[tokio::test]
async fn pools_below_or_above_size_and_vms_in_transition_are_settled_violations() {
    let app = TestApp::spawn().await;
    app.create_pool("small", 1).await;
    app.seed_available("small", 3).await;
    app.create_pool("empty", 2).await;
    app.seed_vm("empty", Phase::Provisioning).await;
    let o = check(&app).await;
    assert_finding(&o, "pool-above-size", Class::Settled, "default/small");
    assert_finding(&o, "pool-below-size", Class::Settled, "default/empty");
    assert_finding(&o, "vm-in-transition", Class::Settled, "vm empty-");
    assert!(o.violations(false).is_empty(), "{:?}", checks_of(&o));
}

/// Issue 22: an autoscaled pool is checked against its desired size, and above its ceiling
/// (which counts every VM) is a finding.
#[tokio::test]
async fn an_autoscaled_pool_is_checked_against_its_desired_size_and_its_ceiling() {
    let app = TestApp::spawn().await;
    let mut spec = poolmgr_tests::pool_spec("auto", 1);
    spec["autoscaling"] = serde_json::json!({"min": 3, "max": 4, "buffer": 0});
    app.created_pool(spec).await;
    app.seed_available("auto", 2).await;
    let o = check(&app).await;
    // Desired 3 (the floor), not the spec's 1: one VM short, not one too many.
    assert_finding(&o, "pool-below-size", Class::Settled, "default/auto");
    app.seed_available("auto", 3).await;
    let o = check(&app).await;
    assert_finding(&o, "pool-above-ceiling", Class::Settled, "default/auto");
}

#[tokio::test]
async fn an_unreachable_host_means_could_not_check_when_settled() {
    let app = filled(1).await;
    let mut o = opts(&app);
    o.flintlock_overrides = vec![(SIM_HOST.into(), "127.0.0.1:1".into())];
    o.flintlock_timeout = Duration::from_millis(500);
    let outcome = check_once(&o).await.unwrap();
    assert_finding(&outcome, "flintlock-unreachable", Class::Settled, "host sim");
    assert_eq!(run(&o, Mode::Settled).await.0, Verdict::CouldNotCheck);
    assert_eq!(run(&o, Mode::Once).await.0, Verdict::Clean);
}

fn bin(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_poolmgr-check"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run poolmgr-check")
}

#[tokio::test]
async fn the_binary_exits_0_1_2_and_prints_what_to_look_at() {
    let app = filled(1).await;
    let url = app.db.url.clone();
    let out = tokio::task::spawn_blocking({
        let url = url.clone();
        move || bin(&["--database-url", &url, "--settled"])
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("poolmgr-check: CLEAN (0 violations; pools=1 vms=1 leases=0 hosts=1 flintlock_vms=1"),
        "{stdout}"
    );

    sql(&app, "UPDATE vms SET phase = 'LEASED'").await;
    let out = tokio::task::spawn_blocking({
        let url = url.clone();
        move || bin(&["--database-url", &url])
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("VIOLATION [leased-vm-without-lease] vm ci-"), "{stdout}");
    assert!(stdout.contains("look at: SELECT * FROM vms WHERE id = 'ci-"), "{stdout}");

    let out = tokio::task::spawn_blocking(|| bin(&["--database-url", "postgres://postgres@127.0.0.1:1/nothing"]))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("could not check"));
}

#[tokio::test]
async fn wait_reports_progress_until_the_reconciler_settles_the_pool() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    let url = app.db.url.clone();
    let child = tokio::task::spawn_blocking(move || bin(&["--database-url", &url, "--wait", "60s"]));
    // The reconciler runs meanwhile, slowly enough that the checker sees the pool unsettled.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for _ in 0..100 {
        app.pass().await;
        if child.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = child.await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stderr.contains("waiting to settle") && stderr.contains("pool-below-size"), "{stderr}");
    assert!(stdout.contains("CLEAN"), "{stdout}");
}

#[tokio::test]
async fn wait_gives_up_at_once_on_an_always_violation() {
    let app = filled(1).await;
    sql(&app, "UPDATE vms SET phase = 'LEASED'").await;
    let t0 = std::time::Instant::now();
    let (verdict, outcome) = run(&opts(&app), Mode::WaitSettled(Duration::from_secs(60))).await;
    assert_eq!(verdict, Verdict::Violations);
    assert!(outcome.unwrap().has("leased-vm-without-lease"));
    assert!(t0.elapsed() < Duration::from_secs(10), "did not wait out the deadline");
}
