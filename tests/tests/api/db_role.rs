//! The runtime database role (issue 25 item 9): the functions log in as a role with DML on
//! poolmgr's tables and no DDL; migrate, as the owning (master) login, creates and grants it.
//! Every other test's app runs as that role too (`TestApp::spawn_on`), which shows the
//! functions need nothing more.

use lambda_emu::Emulator;
use poolmgr_core::db;
use poolmgr_core::db_role;
use poolmgr_tests::{RUNTIME_USER, TestApp, TestDb, as_user, through_pooler};
use serde_json::json;
use tokio_postgres::error::SqlState;

use crate::lambda_lifecycle::{DB_ARN, function_bin, invoke};

async fn connect(url: &str) -> tokio_postgres::Client {
    db::connect_one(url, &db::DbTls::default()).await.expect("connect")
}

/// What the runtime role may not do: each statement is refused for lack of privilege (or of
/// ownership), and the schema is unchanged.
async fn assert_no_ddl(c: &tokio_postgres::Client) {
    for sql in [
        "CREATE TABLE sneaky (x int)",
        "CREATE SCHEMA sneaky",
        "DROP TABLE events",
        "ALTER TABLE leases ADD COLUMN sneaky int",
        "CREATE INDEX sneaky ON vms (id)",
        "TRUNCATE events",
        "DELETE FROM refinery_schema_history",
        "CREATE ROLE sneaky LOGIN",
        "CREATE FUNCTION sneaky() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "CREATE TRIGGER sneaky BEFORE INSERT ON leases FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()",
    ] {
        let err = c.batch_execute(sql).await.expect_err(sql);
        assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{sql}: {err}");
    }
}

/// The app under test is the runtime role: not a superuser, owner of nothing, refused every
/// DDL, and still serving a claim, a release and a reconcile pass.
#[tokio::test]
async fn the_app_logs_in_as_a_role_with_dml_only() {
    if through_pooler() {
        eprintln!("skipped: through PgBouncer the app logs in as the pooler's user");
        return;
    }
    let app = TestApp::spawn().await;
    let c = app.state.db.raw().get().await.unwrap();
    let row = c
        .query_one(
            "SELECT current_user::text, rolsuper, rolcreatedb, rolcreaterole,
                    (SELECT count(*) FROM pg_class WHERE relowner = r.oid)
               FROM pg_roles r WHERE rolname = current_user",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), RUNTIME_USER);
    assert_eq!((row.get::<_, bool>(1), row.get::<_, bool>(2), row.get::<_, bool>(3)), (false, false, false));
    assert_eq!(row.get::<_, i64>(4), 0, "the runtime role owns nothing");
    assert_no_ddl(&c).await;
    let n: i64 = c.query_one("SELECT count(*) FROM refinery_schema_history", &[]).await.unwrap().get(0);
    assert!(n > 0, "it reads the schema version the functions check");
    drop(c);

    app.create_pool("ci", 1).await;
    app.settle(40, "one VM ready", || async { app.get_pool("ci").await.status.available == 1 }).await;
    let claim = app.claimed(poolmgr_tests::CLIENT_A, "ci", Some("r1")).await;
    app.release(poolmgr_tests::CLIENT_A, &claim.lease.lease_id).await.assert_ok(204);
}

/// A table a later migration adds (created by the owning login) is the runtime role's to use
/// without another grant; granting again, and four migrations granting at once, are safe.
#[tokio::test]
async fn grants_cover_later_tables_and_survive_concurrent_migrations() {
    let testdb = TestDb::create().await;
    let user = format!("app_{}", &testdb.name[testdb.name.len() - 10..]);
    let mut owner = testdb.client().await;
    db::migrate(&mut owner, None).await.unwrap();
    let mut runs = vec![];
    for _ in 0..4 {
        let (url, user) = (testdb.url.clone(), user.clone());
        runs.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            db_role::ensure(&mut c, &user, "a-generated-password-123").await
        }));
    }
    for r in runs {
        r.await.unwrap().expect("a concurrent grant succeeds");
    }
    owner.batch_execute("CREATE TABLE later_table (x int)").await.unwrap();
    let runtime = connect(&as_user(&testdb.url, &user, "a-generated-password-123")).await;
    runtime.batch_execute("INSERT INTO later_table VALUES (1); DELETE FROM later_table").await.unwrap();
    assert_no_ddl(&runtime).await;
    // The password is stored as a SCRAM verifier, never as given.
    let stored: String =
        owner.query_one("SELECT rolpassword FROM pg_authid WHERE rolname = $1", &[&user]).await.unwrap().get(0);
    assert!(stored.starts_with("SCRAM-SHA-256$") && !stored.contains("a-generated-password"), "{stored}");
}

/// The runtime login may not be the migrating one, nor a role with powers beyond login; the
/// errors say what to do.
#[tokio::test]
async fn a_runtime_login_with_powers_is_refused() {
    let testdb = TestDb::create().await;
    let mut owner = testdb.client().await;
    db::migrate(&mut owner, None).await.unwrap();
    let me: String = owner.query_one("SELECT current_user::text", &[]).await.unwrap().get(0);
    let err = db_role::ensure(&mut owner, &me, "a-generated-password-123").await.unwrap_err();
    assert!(err.contains("keep this one for migrations"), "{err}");
    let strong = format!("strong_{}", &testdb.name[testdb.name.len() - 10..]);
    owner.batch_execute(&format!("CREATE ROLE {strong} LOGIN CREATEDB")).await.unwrap();
    let err = db_role::ensure(&mut owner, &strong, "a-generated-password-123").await.unwrap_err();
    assert!(err.contains("NOCREATEDB"), "{err}");
    let password: Option<String> =
        owner.query_one("SELECT rolpassword FROM pg_authid WHERE rolname = $1", &[&strong]).await.unwrap().get(0);
    assert_eq!(password, None, "the refused role was not given the password");
    let err = db_role::ensure(&mut owner, "x; DROP TABLE pools", "a-generated-password-123").await.unwrap_err();
    assert!(err.contains("not a role name"), "{err}");
    let tables: i64 = owner
        .query_one("SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename = 'pools'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 1);
}

/// On Lambda, migrate reads the master login from the database secret and the runtime login
/// from its own secret (the template's `AppDatabaseSecret`), migrates, and grants.
#[tokio::test]
async fn migrate_on_lambda_sets_up_the_runtime_login_from_its_secret() {
    const RUNTIME_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/app-QwErTy";
    let testdb = TestDb::create().await;
    let user = format!("lambda_{}", &testdb.name[testdb.name.len() - 10..]);
    let cfg: tokio_postgres::Config = testdb.url.parse().unwrap();
    let tokio_postgres::config::Host::Tcp(host) = &cfg.get_hosts()[0] else { panic!("a TCP test server") };
    let master = json!({
        "username": cfg.get_user().unwrap(),
        "password": cfg.get_password().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default(),
        "host": "poolmgr-db.abcdefghijkl.eu-west-1.rds.amazonaws.com",
    });
    let emu = Emulator::start("migrate").await.unwrap();
    emu.extension.put_secret(DB_ARN, &master.to_string());
    emu.extension.put_secret(RUNTIME_ARN, &json!({"username": user, "password": "Gen3rated-Passw0rd-xyz"}).to_string());
    let env: Vec<(String, String)> = [
        ("POOLMGR_DATABASE_SECRET_ARN", DB_ARN.to_owned()),
        ("POOLMGR_RUNTIME_DATABASE_SECRET_ARN", RUNTIME_ARN.to_owned()),
        ("POOLMGR_DATABASE_HOST", host.clone()),
        ("POOLMGR_DATABASE_PORT", cfg.get_ports()[0].to_string()),
        ("POOLMGR_DATABASE_NAME", testdb.name.clone()),
        ("RUST_LOG", "info".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let mut migrate = emu.spawn(&function_bin("migrate"), &env).unwrap();
    let answer = invoke(&mut migrate, "{}").await.json();
    assert_eq!(answer["runtime_role"], json!(user), "{answer}");
    assert_eq!(answer["schema_version"], json!(db::latest_version()), "{answer}");
    let runtime = connect(&as_user(&testdb.url, &user, "Gen3rated-Passw0rd-xyz")).await;
    let n: i64 = runtime.query_one("SELECT count(*) FROM pools", &[]).await.unwrap().get(0);
    assert_eq!(n, 0);
    assert_no_ddl(&runtime).await;
    let log = migrate.full_stderr().expect("the whole log");
    assert!(log.contains("runtime login granted"), "the log says what was done: {log}");
    assert!(!log.contains("Gen3rated-Passw0rd-xyz"), "the log shows the runtime password");
}
