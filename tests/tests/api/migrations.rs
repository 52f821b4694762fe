//! Schema migrations: the V1 → V2 upgrade with live leases, and refusing a database that a
//! newer binary migrated.

use poolmgr_core::db::{self, DbError};
use poolmgr_tests::*;

/// Fills a V1 database the way a V1 deployment would have: a pool, a host, two leased VMs.
async fn seed_v1(c: &tokio_postgres::Client) {
    c.batch_execute(
        r#"
        INSERT INTO hosts (name, address) VALUES ('old-host', '127.0.0.1:1');
        INSERT INTO pools (namespace, name, size, flintlock_hosts, strategy, microvm_template,
                           hook_failure_policy, heartbeat_interval_seconds, heartbeat_expiry_seconds)
        VALUES ('default', 'old', 2, '{old-host}', 'REPLACE_ON_DELETE',
                '{"root_volume": {"id": "root", "source": {"container_source": "img"}}, "interfaces": [{"device_id": "eth1", "type": "TAP"}]}',
                'DELETE_AND_REPLACE', 30, 120);
        INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase, lease_id)
        VALUES ('old-1', '01AAAAAAAAAAAAAAAAAAAAAAAA', 'default', 'old', 'old-host', 'LEASED', 'lease-1'),
               ('old-2', '01BBBBBBBBBBBBBBBBBBBBBBBB', 'default', 'old', 'old-host', 'LEASED', 'lease-2');
        INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at)
        VALUES ('lease-1', 'old-1', 'default', 'old', now(), now(), now() + interval '1 hour'),
               ('lease-2', 'old-2', 'default', 'old', now(), now(), now() + interval '1 hour');
        "#,
    )
    .await
    .expect("seed V1 rows");
}

#[tokio::test]
async fn upgrading_v1_with_leases_keeps_them_without_request_id_and_the_index_works() {
    let testdb = TestDb::create().await;
    let mut c = testdb.client().await;
    assert_eq!(db::migrate(&mut c, Some(1)).await.unwrap(), vec![1]);
    let has_column: bool = c
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'leases' AND column_name = 'request_id')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!has_column, "V1 has no request_id");
    seed_v1(&c).await;

    assert_eq!(db::migrate(&mut c, Some(2)).await.unwrap(), vec![2]);
    // Re-running is a no-op.
    assert!(db::migrate(&mut c, Some(2)).await.unwrap().is_empty());

    let rows = c.query("SELECT lease_id, request_id, principal FROM leases ORDER BY lease_id", &[]).await.unwrap();
    assert_eq!(rows.len(), 2, "old leases survive the upgrade");
    for r in &rows {
        assert_eq!(r.get::<_, Option<String>>(1), None, "old leases have no request_id");
        assert_eq!(r.get::<_, String>(2), "", "old leases belong to no principal");
    }

    // The partial unique index: NULL request_ids never conflict, a repeated key does.
    let insert = "INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at, last_heartbeat_at, expires_at, request_id, principal)
                  VALUES ($1, $2, 'default', 'old', now(), now(), now(), $3, 'p')";
    c.execute(insert, &[&"n-1", &"x-1", &None::<String>]).await.unwrap();
    c.execute(insert, &[&"n-2", &"x-2", &None::<String>]).await.unwrap();
    c.execute(insert, &[&"k-1", &"x-3", &Some("r-1")]).await.unwrap();
    let dup = c.execute(insert, &[&"k-2", &"x-4", &Some("r-1")]).await.unwrap_err();
    assert_eq!(dup.code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION), "{dup}");
    c.execute("DELETE FROM leases WHERE lease_id LIKE 'n-%' OR lease_id LIKE 'k-%'", &[]).await.unwrap();
    // Later migrations apply on top.
    assert!(!db::migrate(&mut c, None).await.unwrap().is_empty());

    // The upgraded database serves the API: an old lease reads back with request_id null.
    let app = TestApp::spawn_on(testdb, |_| {}).await;
    assert_eq!(app.get_lease(ADMIN, "lease-1").await.request_id, None);
    assert_eq!(app.list_leases(ADMIN, "namespace=default&pool=old").await.0.len(), 2);
}

#[tokio::test]
async fn a_database_migrated_by_a_newer_binary_is_refused() {
    let testdb = TestDb::create().await;
    let mut c = testdb.client().await;
    db::migrate(&mut c, None).await.unwrap();
    db::check_schema(&testdb.url, &db::DbTls::default()).await.expect("current schema passes the check");
    // What a newer binary would have left behind.
    c.batch_execute(
        "INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
         VALUES (99, 'from_the_future', '2030-01-01T00:00:00Z', '0')",
    )
    .await
    .unwrap();

    let err = db::migrate(&mut c, None).await.unwrap_err();
    assert!(matches!(err, DbError::SchemaTooNew { database: 99, .. }), "{err}");
    assert!(err.to_string().contains("newer"), "clear message: {err}");
    let err = db::check_schema(&testdb.url, &db::DbTls::default()).await.unwrap_err();
    assert!(matches!(err, DbError::SchemaTooNew { database: 99, .. }), "{err}");
}

#[tokio::test]
async fn a_database_behind_the_binary_is_refused_by_functions_until_migrated() {
    let testdb = TestDb::create().await;
    let mut c = testdb.client().await;
    db::migrate(&mut c, Some(1)).await.unwrap();
    let err = db::check_schema(&testdb.url, &db::DbTls::default()).await.unwrap_err();
    assert!(matches!(err, DbError::SchemaTooOld { database: 1, .. }), "{err}");
    assert!(err.to_string().contains("migrate"), "says what to do: {err}");
    db::migrate(&mut c, None).await.unwrap();
    db::check_schema(&testdb.url, &db::DbTls::default()).await.unwrap();
}

/// Issue 14 item 9: V9 makes a host's address unique (without case). A database that already
/// has two host records for one flintlockd is refused with the duplicates named, and
/// migrates once one of them is gone. Each database gets its own deployment id.
#[tokio::test]
async fn v9_refuses_two_host_records_for_one_address_and_gives_each_database_a_deployment_id() {
    let testdb = TestDb::create().await;
    let mut c = testdb.client().await;
    db::migrate(&mut c, Some(5)).await.unwrap();
    c.batch_execute(
        "INSERT INTO hosts (name, address) VALUES
             ('host-a', 'flint.example:9090'), ('host-b', 'FLINT.example:9090'), ('host-c', '10.0.0.1:9090')",
    )
    .await
    .unwrap();
    let err = db::migrate(&mut c, None).await.unwrap_err();
    assert!(matches!(err, DbError::Migrate(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("flint.example:9090 (hosts host-a, host-b)"), "names the duplicates: {text}");
    assert!(!text.contains("host-c"), "{text}");

    c.batch_execute("DELETE FROM hosts WHERE name = 'host-b'").await.unwrap();
    db::migrate(&mut c, None).await.unwrap();
    let dup = c.execute("INSERT INTO hosts (name, address) VALUES ('host-d', 'Flint.Example:9090')", &[]).await;
    assert_eq!(dup.unwrap_err().code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION));

    let id_of = async |c: &tokio_postgres::Client| -> String {
        c.query_one("SELECT id FROM deployment", &[]).await.unwrap().get(0)
    };
    let first = id_of(&c).await;
    let other = TestDb::create().await;
    let mut o = other.client().await;
    db::migrate(&mut o, None).await.unwrap();
    let second = id_of(&o).await;
    for id in [&first, &second] {
        assert!(poolmgr_core::deployment::validate_deployment_id(id).is_ok() && id.len() == 12, "{id}");
    }
    assert_ne!(first, second, "two databases, two deployments");
}

/// V18 (issue 24): a pool that existed before revisions gets revision 1, kept with its spec as
/// the API writes it (the route reads it back as a PoolSpec) and counted as rolled out; its
/// VMs are of revision 1.
#[tokio::test]
async fn v18_gives_existing_pools_and_vms_revision_one_with_a_readable_spec() {
    let testdb = TestDb::create().await;
    let mut c = testdb.client().await;
    db::migrate(&mut c, Some(1)).await.unwrap();
    seed_v1(&c).await;
    db::migrate(&mut c, Some(17)).await.unwrap();
    c.batch_execute(
        "UPDATE pools SET create_commands = '{setup}', autoscaling = '{\"min\": 1, \"max\": 4, \"buffer\": 1}', desired_size = 2",
    )
    .await
    .unwrap();
    db::migrate(&mut c, None).await.unwrap();
    let app = TestApp::spawn_on(testdb, |_| {}).await;
    let pool: poolmgr_core::api::Pool = app.get(ADMIN, "/v1/pools/default/old").await.assert_ok_response(200).json();
    assert_eq!(pool.revision, 1);
    let r = app.get(ADMIN, "/v1/pools/default/old/revisions").await;
    let revs = r.assert_ok_response(200).json::<poolmgr_core::api::RevisionList>().revisions;
    assert_eq!(revs.len(), 1);
    assert_eq!(revs[0].revision, 1);
    assert!(revs[0].rolled_out);
    assert_eq!(revs[0].spec, pool.spec, "the kept spec is the pool's, field for field");
    let vm_revisions: Vec<i32> =
        app.conn().await.query("SELECT revision FROM vms", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(vm_revisions, vec![1, 1]);
}
