//! The Lambda-aware database runtime: a connection whose server side died between two
//! requests is replaced transparently, an unreachable database answers 503 with Retry-After
//! (never a crash), and EMF metrics carry the pool gauges.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use poolmgr_core::config::Config;
use poolmgr_core::{AppState, db, http};
use poolmgr_tests::*;
use serde_json::{Value, json};
use tower::ServiceExt;

/// Terminates every backend of the test database except the admin connection's own, and
/// waits until they are gone. Returns how many there were.
async fn terminate_backends(app: &TestApp) -> i64 {
    let admin = db::connect_one(&admin_url(), &db::DbTls::default()).await.expect("admin connection");
    admin
        .query_one(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000))
             FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&app.db.name],
        )
        .await
        .expect("pg_terminate_backend")
        .get(0)
}

fn config_for(url: &str, extra: &[(&str, &str)]) -> Config {
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), url.into()),
        ("POOLMGR_ADMIN_TOKENS".into(), format!("admin:{ADMIN}")),
        ("POOLMGR_CLIENT_TOKENS".into(), format!("client-a:{CLIENT_A}")),
        ("POOLMGR_DB_CONNECT_TIMEOUT_SECONDS".into(), "2".into()),
    ];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Config::from_lookup(|k| env.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.clone())).expect("config")
}

async fn send(router: &Router, method: Method, path: &str, token: &str, body: Option<Value>) -> (StatusCode, Value) {
    let b = Request::builder().method(method).uri(path).header("authorization", format!("Bearer {token}"));
    let req = match body {
        Some(v) => b.header("content-type", "application/json").body(Body::from(v.to_string())),
        None => b.body(Body::empty()),
    }
    .unwrap();
    let resp = router.clone().oneshot(req).await.expect("router is infallible");
    let status = resp.status();
    let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let mut body: Value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() };
    if let Some(r) = retry_after {
        body["retry_after_header"] = json!(r);
    }
    (status, body)
}

#[tokio::test]
async fn a_request_after_the_backend_was_terminated_still_succeeds() {
    // One connection, so the second request reuses the one whose backend was killed.
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_DB_POOL_SIZE".into(), "1".into()))).await;
    app.create_pool("ci", 1).await;
    app.get(ADMIN, "/v1/pools/default/ci").await.assert_ok(200);

    assert!(terminate_backends(&app).await >= 1, "the pooled connection's backend was terminated");

    assert_eq!(app.get_pool("ci").await.spec.name, "ci");
    app.claim(CLIENT_A, "ci", Some("after-terminate")).await;
    assert_eq!(app.get(ADMIN, "/healthz").await.status, StatusCode::OK);
}

/// A router on a runtime of its own that runs only while it serves a request, like a Lambda
/// execution environment: between requests it is frozen, and its connection tasks do not
/// see what happens to their sockets until the next request thaws it.
type Invocation = (Method, String, mpsc::Sender<(StatusCode, Value)>);

#[derive(Clone)]
struct FrozenFunction {
    tx: mpsc::Sender<Invocation>,
}

impl FrozenFunction {
    fn start(cfg: Config) -> FrozenFunction {
        let (tx, rx) = mpsc::channel::<Invocation>();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let router = rt.block_on(async {
                let pool = db::pool_from_config(&cfg).expect("pool");
                http::pools_router(AppState::new(&cfg, pool))
            });
            // Blocking here, outside `block_on`, freezes the runtime.
            while let Ok((method, path, answer)) = rx.recv() {
                let resp = rt.block_on(send(&router, method, &path, ADMIN, None));
                let _ = answer.send(resp);
            }
        });
        FrozenFunction { tx }
    }

    fn invoke(&self, method: Method, path: &str) -> (StatusCode, Value) {
        let (atx, arx) = mpsc::channel();
        self.tx.send((method, path.to_owned(), atx)).unwrap();
        arx.recv_timeout(Duration::from_secs(30)).expect("the frozen function answers")
    }
}

#[tokio::test]
async fn a_connection_that_died_while_the_function_was_frozen_is_replaced_on_thaw() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    // Defaults except one connection: the connection check runs as on Lambda.
    let cfg = config_for(&app.db.app_url, &[("POOLMGR_DB_POOL_SIZE", "1")]);
    let f = FrozenFunction::start(cfg);
    let invoke = |f: &FrozenFunction| {
        let f = f.clone();
        tokio::task::spawn_blocking(move || f.invoke(Method::GET, "/v1/pools/default/ci"))
    };
    let first = invoke(&f).await.unwrap();
    assert_eq!(first.0, StatusCode::OK, "{}", first.1);

    // While frozen, the server side of its connection goes away.
    assert!(terminate_backends(&app).await >= 1);

    // Frozen for longer than POOLMGR_DB_CHECK_IDLE_SECONDS (1 s by default). The thawed
    // runtime has not read the close from the socket yet, so only the checkout's ping finds
    // the connection dead; it reconnects and the request succeeds.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = invoke(&f).await.unwrap();
    assert_eq!(second.0, StatusCode::OK, "{}", second.1);
    assert_eq!(second.1["spec"]["name"], json!("ci"));
}

#[tokio::test]
async fn an_unreachable_database_answers_503_with_retry_after_on_every_route() {
    // A port nothing listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // A connect timeout far above the bound below: a refused connection must fail at once,
    // not wait it out (issue 14 item 15: the bound was 5 s against a 2 s timeout, which told
    // neither apart nor survived a busy machine).
    let cfg = config_for(
        &format!("postgres://postgres@127.0.0.1:{port}/poolmgr"),
        &[("POOLMGR_DB_CONNECT_TIMEOUT_SECONDS", "120")],
    );
    let state = AppState::new(&cfg, db::pool_from_config(&cfg).expect("building the pool needs no database"));
    let router = http::router(state.clone());

    let t0 = Instant::now();
    let claim = json!({"pool": {"namespace": "default", "name": "ci"}, "request_id": "r-1"});
    let (status, body) = send(&router, Method::POST, "/v1/claims", CLIENT_A, Some(claim)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["status"], json!("UNAVAILABLE"));
    assert_eq!(body["error"]["code"], json!(503));
    assert_eq!(body["retry_after_header"], json!("1"));
    assert!(!body["error"]["message"].as_str().unwrap().contains(&port.to_string()), "no internals: {body}");

    let (status, body) = send(&router, Method::GET, "/healthz", ADMIN, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["status"], json!("UNAVAILABLE"));
    assert_eq!(body["retry_after_header"], json!("1"));
    assert!(t0.elapsed() < Duration::from_secs(60), "a refused connection fails fast: {:?}", t0.elapsed());

    // The reconcile function reports a retryable error instead of crashing.
    let err = poolmgr_core::reconcile::run_pass(&state).await.expect_err("no database");
    assert!(err.is_retryable(), "{err}");
    // And the Lambda says so in its error type and message.
    let event = serde_json::from_str(include_str!("../../../functions/reconcile/events/scheduled.json")).unwrap();
    let err = reconcile_fn::handle(&state, lambda_runtime::LambdaEvent::new(event, Default::default()))
        .await
        .expect_err("no database");
    let diagnostic = lambda_runtime::Diagnostic::from(err);
    assert_eq!(diagnostic.error_type, "Retryable", "{diagnostic:?}");
    assert!(diagnostic.error_message.contains("retry later"), "{diagnostic:?}");
}

#[tokio::test]
async fn a_schema_version_mismatch_answers_503_until_it_is_fixed() {
    let app = TestApp::spawn().await;
    // Pretend a newer poolmgr migrated the database.
    app.conn()
        .await
        .batch_execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum)
             VALUES (9999, 'from_the_future', '2030-01-01T00:00:00Z', '0')",
        )
        .await
        .unwrap();
    let cfg = config_for(&app.db.app_url, &[]);
    let router = http::router(AppState::new(&cfg, db::pool_from_config(&cfg).unwrap()));
    let (status, body) = send(&router, Method::GET, "/v1/pools", ADMIN, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["status"], json!("UNAVAILABLE"));

    app.conn().await.batch_execute("DELETE FROM refinery_schema_history WHERE version = 9999").await.unwrap();
    let (status, body) = send(&router, Method::GET, "/v1/pools", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn emf_metrics_carry_request_counters_and_the_pool_gauges_of_a_reconcile_pass() {
    let app = TestApp::spawn_with(|env| env.push(("POOLMGR_METRICS_FORMAT".into(), "emf".into()))).await;
    app.create_pool("ci", 2).await;
    app.seed_available("ci", 1).await;
    app.claim(CLIENT_A, "ci", Some("emf-1")).await.assert_ok(200);
    // The HTTP layer flushed the claim's line to stdout already; the gauges are recorded
    // by the reconcile function after its pass.
    assert!(app.state.metrics.take_emf_lines(1).is_empty(), "each request flushes its metrics");
    reconcile_fn::record_pool_gauges(&app.state).await.unwrap();
    let lines = app.state.metrics.take_emf_lines(1_700_000_000_000);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let doc: Value = serde_json::from_str(&lines[0]).unwrap();
    let directive = &doc["_aws"]["CloudWatchMetrics"][0];
    assert_eq!(directive["Namespace"], json!("poolmgr"));
    assert_eq!(directive["Dimensions"], json!([["pool_namespace", "pool_name"]]));
    let names: Vec<&str> =
        directive["Metrics"].as_array().unwrap().iter().map(|m| m["Name"].as_str().unwrap()).collect();
    for g in [
        "poolmgr_pool_size",
        "poolmgr_pool_available",
        "poolmgr_pool_leased",
        "poolmgr_pool_provisioning",
        "poolmgr_pool_quarantined",
    ] {
        assert!(names.contains(&g), "{g} in {names:?}");
    }
    assert_eq!(doc["pool_name"], json!("ci"));
    assert_eq!(doc["poolmgr_pool_size"], json!(2));
    assert_eq!(doc["poolmgr_pool_leased"], json!(1));
    assert_eq!(doc["poolmgr_pool_available"], json!(0));
}

/// Two stacks in one region write to namespaces of their own (the template sets
/// `POOLMGR_METRICS_NAMESPACE` to `poolmgr/<stack>`), so their series never mix.
#[tokio::test]
async fn emf_metrics_go_to_the_namespace_the_configuration_names() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_METRICS_FORMAT".into(), "emf".into()));
        env.push(("POOLMGR_METRICS_NAMESPACE".into(), "poolmgr/stack-b".into()));
    })
    .await;
    app.create_pool("ci", 1).await;
    reconcile_fn::record_pool_gauges(&app.state).await.unwrap();
    let lines = app.state.metrics.take_emf_lines(1_700_000_000_000);
    let doc: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(doc["_aws"]["CloudWatchMetrics"][0]["Namespace"], json!("poolmgr/stack-b"));
}

/// Regression (scripts/chaos.sh, pg-restart): a database outage that failed a pool's reconcile
/// step also failed the release of its reconcile lease, so no pass touched the pool for the
/// whole lease (~2 minutes) after the database was back, and claims answered 429 meanwhile.
/// The pass now retries the release until its deadline.
#[tokio::test]
async fn a_database_blip_during_a_pool_step_does_not_leave_the_reconcile_lease_behind() {
    let app = TestApp::spawn().await;
    // A create hook of 2 s keeps the pass inside the pool's step while the database goes away.
    app.sim
        .set_exec_rule("prepare", flintlock_sim::ExecRule { duration: Duration::from_secs(2), ..Default::default() });
    let mut spec = pool_spec("ci", 1);
    spec["create_commands"] = json!(["prepare"]);
    // Force the moment (issue 14 item 15): the guest agent stays down while passes settle the
    // VM, so none of them can run the hook (one that did left nothing for the pass under test
    // on a busy machine); it comes up, its backoff cleared, just before that pass.
    app.sim.set_guest_agent_delay(Duration::from_secs(3600));
    app.post(ADMIN, "/v1/pools", spec).await.assert_ok(201);
    // Its row says so (CREATE_HOOK_RUNNING): the simulator's state alone could turn CREATED
    // after the pass had polled it, and the next pass would only poll again.
    app.settle(50, "the VM is booted and its hook due", || async {
        app.count_phase("ci", "CREATE_HOOK_RUNNING").await == 1
    })
    .await;
    app.sim.set_guest_agent_delay(Duration::ZERO);
    app.conn().await.execute("UPDATE vms SET next_attempt_at = now() - interval '1 minute'", &[]).await.unwrap();

    // The pass that starts the hook is the one the outage must hit. The row can say
    // CREATE_HOOK_RUNNING a pass before the hook can start (the guest agent not up yet): a
    // pass that ended without starting it is followed by another, until one has.
    let spawn_pass = || {
        let state = app.state.clone();
        tokio::spawn(async move { poolmgr_core::reconcile::run_pass(&state).await })
    };
    let mut pass = spawn_pass();
    let t0 = Instant::now();
    while app.sim.exec_running() == 0 {
        // A bound against a hang, not a timing check: a busy machine may take a while to get there.
        assert!(t0.elapsed() < Duration::from_secs(120), "the create hook never started");
        if pass.is_finished() {
            pass.await.unwrap().expect("a pass before the hook started");
            pass = spawn_pass();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The database "goes away": its name stops existing for new connections, open ones die.
    let admin = db::connect_one(&admin_url(), &db::DbTls::default()).await.expect("admin connection");
    let (name, away) = (app.db.name.clone(), format!("{}_away", app.db.name));
    let mut renamed = false;
    for _ in 0..50 {
        terminate_backends(&app).await;
        if admin.batch_execute(&format!("ALTER DATABASE {name} RENAME TO {away}")).await.is_ok() {
            renamed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(renamed, "could not take the test database away");
    // Down past the end of the hook, so the step and the lease release both fail at first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    admin.batch_execute(&format!("ALTER DATABASE {away} RENAME TO {name}")).await.expect("bring the database back");

    let report = tokio::time::timeout(Duration::from_secs(60), pass).await.expect("pass ends").unwrap().expect("pass");
    assert!(
        report.errors.iter().any(|e| e.contains("default/ci")),
        "the pool's step failed during the outage: {:?}",
        report.errors
    );
    let lease_free: bool = app
        .conn()
        .await
        .query_one("SELECT reconcile_until <= now() FROM pools WHERE name = 'ci'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(lease_free, "the reconcile lease was left behind: the pool is stuck until it expires");
    // And the next passes finish the VM at once, not minutes later.
    app.settle(50, "the VM became AVAILABLE after the outage", || async {
        app.count_phase("ci", "AVAILABLE").await == 1
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Retryable database errors (issue 14 item 10)
// ---------------------------------------------------------------------------------------

/// Makes every `op` (`INSERT`, `DELETE`, …) on `table` raise SQLSTATE `sqlstate`, the first
/// `times` times (`i64::MAX`: always). Attempts are counted in the sequence
/// `test_attempts`, whose increments survive the rollback of the failed statement.
async fn fail_with(app: &TestApp, table: &str, op: &str, sqlstate: &str, times: i64) {
    let sql = format!(
        "DROP TRIGGER IF EXISTS test_fail ON {table};
         DROP SEQUENCE IF EXISTS test_attempts;
         CREATE SEQUENCE test_attempts;
         CREATE OR REPLACE FUNCTION test_fail() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('test_attempts') <= {times} THEN
                 RAISE EXCEPTION 'forced by the test' USING ERRCODE = '{sqlstate}';
             END IF;
             RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
         END $$;
         CREATE TRIGGER test_fail BEFORE {op} ON {table} FOR EACH ROW EXECUTE FUNCTION test_fail();"
    );
    app.conn().await.batch_execute(&sql).await.unwrap();
}

async fn no_more_failures(app: &TestApp, table: &str) {
    app.conn().await.batch_execute(&format!("DROP TRIGGER test_fail ON {table}")).await.unwrap();
}

/// How many times the failing trigger ran.
async fn attempts(app: &TestApp) -> i64 {
    app.scalar_i64("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM test_attempts").await
}

#[track_caller]
fn assert_unavailable_with_retry_after(r: &TestResponse) {
    r.assert_error(503, "UNAVAILABLE");
    assert_eq!(r.headers.get("retry-after").map(|v| v.to_str().unwrap()), Some("1"), "Retry-After: {:?}", r.headers);
    let message = r.body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("forced by the test"), "no internals in the message: {message}");
}

/// Issue 14 item 10: deadlock (40P01), serialization failure (40001), a cancelled query
/// (57014) and a lock not available (55P03) answer 503 UNAVAILABLE with Retry-After instead
/// of 500, and change nothing. The claim statement runs on its own (its own transaction,
/// rolled back whole by the error), so a deadlock or a serialization failure is run once
/// more inside the request; a cancelled statement or a lock timeout is not (the same wait
/// would likely happen again): the client backs off.
#[tokio::test]
async fn retryable_database_errors_answer_503_with_retry_after_and_change_nothing() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", poolmgr_core::domain::Phase::Available).await;
    for (sqlstate, runs) in [("40P01", 2), ("40001", 2), ("57014", 1), ("55P03", 1)] {
        fail_with(&app, "leases", "INSERT", sqlstate, i64::MAX).await;
        let r = app.claim(CLIENT_A, "ci", Some(&format!("r-{sqlstate}"))).await;
        assert_unavailable_with_retry_after(&r);
        assert_eq!(attempts(&app).await, runs, "{sqlstate}: statement runs");
        assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"), "{sqlstate}: the VM is untouched");
        assert_eq!(app.scalar_i64("SELECT count(*) FROM leases").await, 0, "{sqlstate}: no lease");
        assert_eq!(app.count_events("VM_CLAIMED").await, 0, "{sqlstate}: no event");
    }
    no_more_failures(&app, "leases").await;
    app.claimed(CLIENT_A, "ci", Some("r-after")).await;
}

/// Issue 14 item 10: a deadlock that hits the claim statement once is retried inside the
/// request, and the client sees a plain success.
#[tokio::test]
async fn a_claim_hit_by_a_deadlock_once_is_retried_inside_the_request() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", poolmgr_core::domain::Phase::Available).await;
    fail_with(&app, "leases", "INSERT", "40P01", 1).await;
    let c = app.claimed(CLIENT_A, "ci", Some("r-1")).await;
    assert_eq!(attempts(&app).await, 2, "one failed run, one that succeeded");
    assert!(!c.replayed);
    assert_eq!(c.vm.id, vm.id);
    assert_eq!(app.count_events("VM_CLAIMED").await, 1);
}

/// Issue 14 item 10: a forced pool delete is one transaction of several statements; a
/// deadlock or serialization failure inside it rolls all of it back, so the whole
/// transaction runs once more (204), and when the retry fails too the answer is 503 with
/// Retry-After and the pool is untouched.
#[tokio::test]
async fn a_pool_delete_transaction_is_retried_once_then_answers_503() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    let vm = app.seed_vm("ci", poolmgr_core::domain::Phase::Available).await;
    fail_with(&app, "vms", "UPDATE", "40001", i64::MAX).await;
    let r = app.delete(ADMIN, "/v1/pools/default/ci?force=true").await;
    assert_unavailable_with_retry_after(&r);
    assert_eq!(attempts(&app).await, 2, "the transaction ran twice");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM pools").await, 1, "the pool is still there");
    assert_eq!(app.phase_of(&vm.id).await.as_deref(), Some("AVAILABLE"));

    fail_with(&app, "vms", "UPDATE", "40P01", 1).await;
    app.delete(ADMIN, "/v1/pools/default/ci?force=true").await.assert_ok(204);
    assert_eq!(attempts(&app).await, 2, "failed once, then succeeded");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM pools").await, 0);
}

/// Issue 14 item 10: the reconcile pass sees these errors as retryable (the Lambda's error
/// type says so), not as a rejected statement.
#[tokio::test]
async fn a_deadlock_in_a_reconcile_step_is_a_retryable_step_error() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    fail_with(&app, "vms", "INSERT", "40P01", i64::MAX).await;
    let report = app.pass().await;
    assert_eq!(report.created, 0);
    assert!(report.errors.iter().any(|e| e.contains("default/ci")), "{:?}", report.errors);
    assert!(report.errors.iter().all(|e| e.contains("database busy")), "{:?}", report.errors);
    no_more_failures(&app, "vms").await;
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
}

/// The pool hands out the connection returned last (LIFO): under light load the same few
/// server processes serve every request and stay hot in the CPU's caches, instead of each
/// request waking the one idle longest (FIFO, deadpool's default), which made every one of
/// the pool's connections take turns even for 4 clients. Behind a transaction pooler the
/// connections left idle at the back also time out first, and are pinged before use.
#[tokio::test]
async fn an_idle_pool_hands_out_the_connection_returned_last() {
    use poolmgr_core::store::Executor;
    async fn backend(conn: &db::Conn) -> i32 {
        conn.pg().query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0)
    }
    let app = TestApp::spawn().await;
    let opts = db::PoolOptions {
        size: 4,
        connect_timeout: Duration::from_secs(10),
        check_idle: Duration::from_secs(60),
        statement_timeout: None,
        cancel_on_timeout: false,
        tls: db::DbTls::default(),
    };
    let pool = db::connect_pool(&app.db.url, &opts).unwrap();
    // Four connections open at once, returned in order: the fourth goes back last.
    let mut held = vec![];
    for _ in 0..4 {
        held.push(pool.get().await.unwrap());
    }
    let mut pids = vec![];
    for c in &held {
        pids.push(backend(c).await);
    }
    let distinct: std::collections::HashSet<_> = pids.iter().collect();
    assert_eq!(distinct.len(), 4, "four connections were held at once: {pids:?}");
    drop(held);
    // One request at a time: every one gets the connection returned last.
    for i in 0..8 {
        let conn = pool.get().await.unwrap();
        assert_eq!(backend(&conn).await, pids[3], "request {i} did not get the connection returned last ({pids:?})");
    }
}
