//! The integration-test harness: `TestApp` gives each test a fresh PostgreSQL database with
//! migrations applied, a `flintlock-sim` on a free port registered as host `sim`, the full
//! Router with known tokens, typed helpers per endpoint, and factories for VMs in any phase.
//!
//! Needs `POOLMGR_TEST_DATABASE_URL` (an admin URL that may create databases); `scripts/test.sh`
//! starts a private PostgreSQL and sets it. Without it (plain `cargo test`) the first test that
//! needs the database says how to run the suite and ends the run with status 2 ([`test_env`]). Each test's database is dropped when its `TestApp`
//! drops; `scripts/test.sh` drops leftovers of crashed runs before starting.
//!
//! Response bodies: [`TestResponse::json`] reads a body as its `poolmgr_core::api` type and
//! checks it serializes back to exactly the wire body, and the typed helpers per endpoint use
//! it: claims and leases ([`TestApp::claimed`], [`TestApp::get_lease`],
//! [`TestApp::heartbeated`], [`TestApp::list_leases`]), pools ([`TestApp::create_pool`],
//! [`TestApp::created_pool`], [`TestApp::get_pool`], [`TestApp::list_pools`],
//! [`TestApp::updated_pool`]), hosts ([`TestApp::created_host`], [`TestApp::get_host`],
//! [`TestApp::list_hosts`], [`TestApp::updated_host`], [`TestApp::cordoned`],
//! [`TestApp::uncordoned`]), VMs ([`TestApp::list_vms`], [`TestApp::get_vm`]) and events
//! ([`TestApp::events`]). The untyped [`TestResponse::body`] is for what a test checks on the
//! wire itself: error bodies, exact key sets and `null`s, and the contract-shape tests
//! (`bad_input`, `openapi`).
//!
//! With `POOLMGR_TEST_POOLER_URL_TEMPLATE` set (a URL containing `{db}`, e.g.
//! `postgres://postgres@127.0.0.1:6432/{db}`), the app under test reaches its database through
//! that pooler (`scripts/test-pgbouncer.sh`), while creating, migrating and dropping databases
//! and the tests' own SQL go straight to PostgreSQL.
//!
//! TLS: [`tls`] makes the certificate authorities of the TLS tests; `scripts/test.sh` starts a
//! second, TLS-only server for them ([`tls_server`]).
//!
//! [`local::LocalServer`] runs a real `poolmgr-local` process instead of the in-process Router,
//! for the tests of clients that talk to it over the network (`poolmgrctl`, `poolmgr-client`).

pub mod https;
pub mod local;
pub mod tls;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use flintlock_sim::{Sim, SimConfig, SimServer};
use http_body_util::BodyExt;
use poolmgr_core::config::Config;
use poolmgr_core::domain::{Phase, PoolRef};
use poolmgr_core::store::{self, VmInsert};
use poolmgr_core::{AppState, api, db, http};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tower::ServiceExt;

// At least 16 characters each: shorter tokens are refused at start.
pub const ADMIN: &str = "admin-token-0123456789";
pub const VIEWER: &str = "viewer-token-0123456789";
/// The apps' credentials key (`POOLMGR_CREDENTIALS_KEY`): hosts' secrets are sealed with it.
pub const CREDENTIALS_KEY: &str = "test-credentials-key-0123456789abcdef";
pub const CLIENT_A: &str = "client-a-token-0123456789";
pub const CLIENT_B: &str = "client-b-token-0123456789";
pub const SIM_HOST: &str = "sim";

pub fn admin_url() -> String {
    test_env("POOLMGR_TEST_DATABASE_URL")
}

/// A variable `scripts/test.sh` sets for the suite (the test server's URL, the TLS server's
/// port and CA). Plain `cargo test` has none of them: instead of every database test panicking
/// on its own, the first one to need one says once how to run the suite and ends the whole
/// run with exit status 2, so no such run can pass (CI always runs `scripts/test.sh`, which
/// sets them all, so this never happens there).
pub fn test_env(name: &str) -> String {
    if let Ok(v) = std::env::var(name)
        && !v.trim().is_empty()
    {
        return v;
    }
    static ONCE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _first = ONCE.lock();
    // Straight to the process's stderr: the test harness captures `eprintln!` and would drop
    // the message when the process exits.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "\n\
         error: {name} is not set, so there is no PostgreSQL to test against.\n\
         \n\
         The integration tests need a real PostgreSQL server. Run them with\n\
         \n\
         \x20   scripts/test.sh                                   # every test\n\
         \x20   scripts/test.sh -p poolmgr-tests --test api -- claims::   # some of them\n\
         \n\
         which starts a private PostgreSQL (and a TLS-only one) for the run and sets {name};\n\
         or set POOLMGR_TEST_DATABASE_URL to a superuser URL of a server you run and use\n\
         scripts/test.sh all the same. Stopping this run: no test result would mean anything.\n"
    );
    std::process::exit(2)
}

/// `url` with its database name replaced.
/// The TLS test server that `scripts/test.sh` starts (`ssl = on`, TCP clients only over TLS):
/// its port on 127.0.0.1 and the path of the CA that signed its certificate for
/// [`tls::SERVER_NAME`] (`POOLMGR_TEST_TLS_PG_PORT`, `POOLMGR_TEST_TLS_CA_PEM`).
pub fn tls_server() -> (u16, String) {
    let port = test_env("POOLMGR_TEST_TLS_PG_PORT");
    let ca = test_env("POOLMGR_TEST_TLS_CA_PEM");
    (port.parse().expect("POOLMGR_TEST_TLS_PG_PORT is a port"), ca)
}

pub fn url_for(db_name: &str) -> String {
    let admin = admin_url();
    let (base, _) = admin.rsplit_once('/').expect("URL with a database name");
    let query = admin.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
    format!("{base}/{db_name}{query}")
}

/// The URL the app under test uses for database `db_name`: through the pooler of
/// `POOLMGR_TEST_POOLER_URL_TEMPLATE` if set, else [`url_for`].
pub fn app_url_for(db_name: &str) -> String {
    match std::env::var("POOLMGR_TEST_POOLER_URL_TEMPLATE") {
        Ok(t) if !t.is_empty() => {
            assert!(t.contains("{db}"), "POOLMGR_TEST_POOLER_URL_TEMPLATE must contain {{db}}: {t}");
            t.replace("{db}", db_name)
        }
        _ => url_for(db_name),
    }
}

/// The login [`TestApp`]'s app uses (granted by `poolmgr_core::db_role`, as migrate does).
pub const RUNTIME_USER: &str = "poolmgr_app_test";
pub const RUNTIME_PASSWORD: &str = "runtime-password-0123456789";

/// `url` logging in as `user` with `password` instead.
pub fn as_user(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let after = rest.split_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{user}:{password}@{after}")
}

/// Whether the app under test goes through a pooler (`POOLMGR_TEST_POOLER_URL_TEMPLATE`).
pub fn through_pooler() -> bool {
    std::env::var("POOLMGR_TEST_POOLER_URL_TEMPLATE").is_ok_and(|t| !t.is_empty())
}

/// A database created for one test and dropped with it.
pub struct TestDb {
    pub name: String,
    /// Straight to PostgreSQL: migrations, the tests' own SQL.
    pub url: String,
    /// What the app under test connects to (the pooler, when one is configured).
    pub app_url: String,
}

impl TestDb {
    /// Creates an empty database (no migrations).
    pub async fn create() -> TestDb {
        let name = format!("poolmgr_test_{}", ulid::Ulid::generate().to_string().to_lowercase());
        let admin = db::connect_one(&admin_url(), &db::DbTls::default()).await.expect("connect to the test server");
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create test database");
        TestDb { url: url_for(&name), app_url: app_url_for(&name), name }
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        db::connect_one(&self.url, &db::DbTls::default()).await.expect("connect to the test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside async context: use a private runtime on a plain thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                if let Ok(c) = db::connect_one(&admin_url(), &db::DbTls::default()).await {
                    let _ = c.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            });
        })
        .join();
    }
}

pub struct TestResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The body as untyped JSON (`Null` when empty, a string when not JSON): for wire-shape
    /// checks. Read contract objects with [`TestResponse::json`] instead.
    pub body: Value,
}

impl TestResponse {
    /// The body as the contract type `T` (a `poolmgr_core::api` type). Panics unless the body
    /// deserializes into `T` and `T` serializes back to exactly the body, so typing never
    /// hides a missing, extra or renamed field, a `null` turned absent, or a timestamp's
    /// format. Does not check the status: see [`TestResponse::assert_ok_response`].
    #[track_caller]
    pub fn json<T: DeserializeOwned + Serialize>(&self) -> T {
        typed(&self.body, "")
    }

    /// Like [`TestResponse::json`], for the part of the body at a JSON pointer (`"/lease"`):
    /// for a test that reads one part of a body whose rest it checks on the wire.
    #[track_caller]
    pub fn json_at<T: DeserializeOwned + Serialize>(&self, pointer: &str) -> T {
        let part = self.body.pointer(pointer).unwrap_or_else(|| panic!("no {pointer} in body: {}", self.body));
        typed(part, pointer)
    }

    /// The contract error status (`"ABORTED"`, …), or "" for a success.
    pub fn error_status(&self) -> &str {
        self.body["error"]["status"].as_str().unwrap_or("")
    }

    #[track_caller]
    pub fn assert_error(&self, http: u16, status: &str) {
        assert_eq!(self.status.as_u16(), http, "body: {}", self.body);
        assert_eq!(self.error_status(), status, "body: {}", self.body);
        assert_eq!(self.body["error"]["code"], json!(http), "body: {}", self.body);
        assert!(self.body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "body: {}", self.body);
        // Every error names a stable reason word and the request's correlation id.
        let reason = self.reason();
        assert!(
            !reason.is_empty() && reason.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
            "reason {reason:?}, body: {}",
            self.body
        );
        let id = self.headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
        assert!(!id.is_empty(), "an error answer carries x-request-id");
        assert_eq!(self.body["error"]["request_id"], json!(id), "body: {}", self.body);
    }

    /// The error body's `reason`.
    pub fn reason(&self) -> &str {
        self.body["error"]["reason"].as_str().unwrap_or("")
    }

    /// Like [`TestResponse::assert_error`], with the `reason` too.
    #[track_caller]
    pub fn assert_reason(&self, http: u16, status: &str, reason: &str) {
        self.assert_error(http, status);
        assert_eq!(self.reason(), reason, "body: {}", self.body);
    }

    #[track_caller]
    pub fn assert_ok(&self, http: u16) -> &Value {
        assert_eq!(self.status.as_u16(), http, "body: {}", self.body);
        &self.body
    }

    /// Like [`TestResponse::assert_ok`], returning the whole response.
    #[track_caller]
    pub fn assert_ok_response(&self, http: u16) -> &TestResponse {
        self.assert_ok(http);
        self
    }
}

/// `value` (the body's part at `pointer`) as `T`, checked to serialize back to exactly itself.
#[track_caller]
fn typed<T: DeserializeOwned + Serialize>(value: &Value, pointer: &str) -> T {
    let name = std::any::type_name::<T>();
    let t: T =
        serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("body{pointer} is not a {name}: {e}: {value}"));
    let back = serde_json::to_value(&t).unwrap_or_else(|e| panic!("{name} does not serialize: {e}"));
    assert_eq!(&back, value, "body{pointer} is not exactly a {name}: left is what {name} serializes to");
    t
}

pub struct TestApp {
    pub db: TestDb,
    pub state: AppState,
    pub router: Router,
    pub sim: Sim,
    pub sim_server: SimServer,
    /// A direct pool for the tests' own SQL, as the owning login (the app logs in as the
    /// runtime role, or through a pooler).
    direct: db::Db,
}

/// The template used by test pools: valid for flintlock's default provider.
pub fn template() -> Value {
    json!({
        "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
        "kernel": {"image": "ghcr.io/liquidmetal-dev/kernel:6.1", "filename": "boot/vmlinux", "add_network_config": true},
        "interfaces": [{"device_id": "eth1", "type": "TAP"}]
    })
}

pub fn pool_spec(name: &str, size: i32) -> Value {
    json!({
        "namespace": "default",
        "name": name,
        "size": size,
        "flintlock_hosts": [SIM_HOST],
        "replenishment": {"strategy": "REPLACE_ON_DELETE"},
        "microvm_template": template(),
        "heartbeat_interval_seconds": 30,
        "heartbeat_expiry_seconds": 120
    })
}

/// A port on 127.0.0.1 that nothing listens on (bound once, then released).
pub fn unused_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local address").port()
}

pub fn pool(name: &str) -> PoolRef {
    PoolRef { namespace: "default".into(), name: name.into() }
}

/// `path?query`, or `path` alone for an empty query.
fn with_query(path: &str, query: &str) -> String {
    if query.is_empty() { path.to_owned() } else { format!("{path}?{query}") }
}

/// The harness's configuration of an app on `testdb`, with `extra` applied on top.
fn test_config(testdb: &TestDb, extra: impl Fn(&mut Vec<(String, String)>)) -> Config {
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), testdb.app_url.clone()),
        ("POOLMGR_ADMIN_TOKENS".into(), format!("admin:{ADMIN}")),
        ("POOLMGR_VIEWER_TOKENS".into(), format!("viewer:{VIEWER}")),
        ("POOLMGR_CREDENTIALS_KEY".into(), CREDENTIALS_KEY.into()),
        ("POOLMGR_CLIENT_TOKENS".into(), format!("client-a:{CLIENT_A},client-b:{CLIENT_B}")),
        ("POOLMGR_DB_POOL_SIZE".into(), "40".into()),
        ("POOLMGR_FLINTLOCK_TIMEOUT_SECONDS".into(), "3".into()),
        // Fast retries and an orphan scan on every pass keep reconcile tests short.
        ("POOLMGR_RECONCILE_BACKOFF_MS".into(), "10".into()),
        ("POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS".into(), "1".into()),
        ("POOLMGR_ORPHAN_SCAN_SECONDS".into(), "0".into()),
        // Reconcile loops (`reconcile::run_loop`) pass often and give up soon in tests.
        ("POOLMGR_RECONCILE_LOOP_INTERVAL_MS".into(), "50".into()),
        ("POOLMGR_RECONCILE_LINGER_MS".into(), "300".into()),
        // Probes check on every call, so tests that change the schema see it at once;
        // `monitoring::` tests the cache.
        ("POOLMGR_HEALTH_CACHE_SECONDS".into(), "0".into()),
    ];
    if through_pooler() {
        // As configured in production behind a transaction pooler: PgBouncer before 1.21
        // (Debian 12 ships 1.18) cannot keep a named prepared statement.
        env.push(("POOLMGR_DB_PREPARE_CLAIM".into(), "false".into()));
    }
    extra(&mut env);
    Config::from_lookup(|k| env.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.clone())).expect("test config")
}

impl TestApp {
    pub async fn spawn() -> TestApp {
        Self::spawn_with(|_| {}).await
    }

    /// Spawns with extra configuration (`POOLMGR_*` keys) applied on top of the defaults.
    pub async fn spawn_with(extra: impl Fn(&mut Vec<(String, String)>)) -> TestApp {
        Self::spawn_on(TestDb::create().await, extra).await
    }

    /// Spawns on an existing database (migrating it to the latest version first).
    pub async fn spawn_on(mut testdb: TestDb, extra: impl Fn(&mut Vec<(String, String)>)) -> TestApp {
        let mut client = testdb.client().await;
        db::migrate(&mut client, None).await.expect("migrate test database");
        // The app logs in as the runtime role migrate grants, as on AWS (issue 25 item 9): every
        // test then shows the functions need no more than DML. The tests' own SQL (`conn`)
        // stays on the owning login. Not through PgBouncer, whose auth file knows one user.
        if !through_pooler() {
            poolmgr_core::db_role::ensure(&mut client, RUNTIME_USER, RUNTIME_PASSWORD)
                .await
                .expect("grant the runtime role");
            testdb.app_url = as_user(&testdb.url, RUNTIME_USER, RUNTIME_PASSWORD);
        }
        let cfg = test_config(&testdb, extra);
        let pool = db::pool_from_config(&cfg).expect("pool");
        // An adjustable clock: tests move time with `advance_clock` instead of rewriting rows.
        let state = AppState::new(&cfg, pool).with_clock(poolmgr_core::clock::Clock::adjustable());
        let router = http::router(state.clone());
        let sim = Sim::new(SimConfig {
            boot_delay: Duration::from_millis(50),
            delete_delay: Duration::from_millis(20),
            basic_auth_token: None,
        });
        let sim_server = sim.serve("127.0.0.1:0".parse().unwrap()).await.expect("start flintlock-sim");
        let opts = db::PoolOptions { size: 8, ..db::PoolOptions::from_config(&cfg) };
        let direct = db::connect_pool(&testdb.url, &opts).expect("direct pool");
        let app = TestApp { db: testdb, state, router, sim, sim_server, direct };
        app.post(
            ADMIN,
            "/v1/hosts",
            json!({"name": SIM_HOST, "address": app.sim_server.addr.to_string(), "tls": {"insecure": true}}),
        )
        .await
        .assert_ok(201);
        // Each test starts with an empty feed: the registration's HOST_REGISTERED is the
        // harness's, not the test's.
        app.conn().await.batch_execute("DELETE FROM events").await.expect("clear the harness's events");
        app
    }

    /// The same database and flintlock-sim behind a redeployed app: the harness's configuration
    /// again with `extra` on top, as when an operator changes a setting and the data stays.
    pub fn redeployed(mut self, extra: impl Fn(&mut Vec<(String, String)>)) -> TestApp {
        let cfg = test_config(&self.db, extra);
        let pool = db::pool_from_config(&cfg).expect("pool");
        self.state = AppState::new(&cfg, pool).with_clock(poolmgr_core::clock::Clock::adjustable());
        self.router = http::router(self.state.clone());
        self
    }

    /// A host's secrets as the app opens them from its row (sealed at rest, issue 25 item 4).
    pub async fn host_secrets(&self, name: &str) -> poolmgr_core::credentials::Secrets {
        let (h, _) = poolmgr_core::store::host_get(&**self.conn().await, name).await.unwrap().expect("host exists");
        self.state.config.credentials.open(name, &h.stored_credentials()).expect("the app opens its hosts' secrets")
    }

    /// Forgets every event so far (the setup's audit events, issue 25 item 3), for a test that
    /// reads the feed of what follows.
    pub async fn forget_events(&self) {
        self.conn().await.batch_execute("DELETE FROM events").await.expect("forget the events");
    }

    /// The same app with `waker` behind its Router (claims, releases and hints wake it).
    pub fn with_waker(mut self, waker: poolmgr_core::wake::Waker) -> TestApp {
        self.state = self.state.clone().with_waker(waker);
        self.router = http::router(self.state.clone());
        self
    }

    /// Sends one request through the Router, exactly as the HTTP server would.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> TestResponse {
        let mut b = Request::builder().method(method).uri(path);
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = match body {
            Some(v) => b.header("content-type", "application/json").body(Body::from(v.to_string())),
            None => b.body(Body::empty()),
        }
        .unwrap();
        self.send(req).await
    }

    pub async fn send(&self, req: Request<Body>) -> TestResponse {
        let resp = self.router.clone().oneshot(req).await.expect("router is infallible");
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        TestResponse { status, headers, body }
    }

    pub async fn get(&self, token: &str, path: &str) -> TestResponse {
        self.request(Method::GET, path, Some(token), None, &[]).await
    }

    pub async fn post(&self, token: &str, path: &str, body: Value) -> TestResponse {
        self.request(Method::POST, path, Some(token), Some(body), &[]).await
    }

    pub async fn put(&self, token: &str, path: &str, body: Value) -> TestResponse {
        self.request(Method::PUT, path, Some(token), Some(body), &[]).await
    }

    pub async fn delete(&self, token: &str, path: &str) -> TestResponse {
        self.request(Method::DELETE, path, Some(token), None, &[]).await
    }

    /// `POST /v1/claims` on pool default/`pool` with an optional request_id.
    pub async fn claim(&self, token: &str, pool: &str, request_id: Option<&str>) -> TestResponse {
        let mut body = json!({"pool": {"namespace": "default", "name": pool}});
        if let Some(r) = request_id {
            body["request_id"] = json!(r);
        }
        self.post(token, "/v1/claims", body).await
    }

    /// `POST /v1/claims` on pool default/`pool`, expecting 200: the ClaimVM response.
    pub async fn claimed(&self, token: &str, pool: &str, request_id: Option<&str>) -> api::ClaimResponse {
        self.claim(token, pool, request_id).await.assert_ok_response(200).json()
    }

    pub async fn heartbeat(&self, token: &str, lease_id: &str) -> TestResponse {
        self.request(Method::POST, &format!("/v1/leases/{lease_id}/heartbeat"), Some(token), None, &[]).await
    }

    /// `POST /v1/leases/{lease_id}/heartbeat`, expecting 200: the body's `lease` (the body is
    /// exactly a `HeartbeatResponse`, `{"lease": LeaseRecord}`).
    pub async fn heartbeated(&self, token: &str, lease_id: &str) -> api::LeaseRecord {
        self.heartbeat(token, lease_id).await.assert_ok_response(200).json::<api::HeartbeatResponse>().lease
    }

    pub async fn release(&self, token: &str, lease_id: &str) -> TestResponse {
        self.delete(token, &format!("/v1/leases/{lease_id}")).await
    }

    /// `GET /v1/leases/{lease_id}`, expecting 200.
    pub async fn get_lease(&self, token: &str, lease_id: &str) -> api::LeaseRecord {
        self.get(token, &format!("/v1/leases/{lease_id}")).await.assert_ok_response(200).json()
    }

    /// `GET /v1/leases?{query}` (`""`: no query), expecting 200: one page and its
    /// `next_page_token`.
    pub async fn list_leases(&self, token: &str, query: &str) -> (Vec<api::LeaseRecord>, String) {
        let list: api::LeaseList =
            self.get(token, &with_query("/v1/leases", query)).await.assert_ok_response(200).json();
        (list.leases, list.next_page_token)
    }

    /// Creates pool default/`name` on the simulator host ([`pool_spec`]).
    pub async fn create_pool(&self, name: &str, size: i32) -> api::Pool {
        self.created_pool(pool_spec(name, size)).await
    }

    /// `POST /v1/pools` with `spec`, expecting 201: the new pool.
    pub async fn created_pool(&self, spec: Value) -> api::Pool {
        self.post(ADMIN, "/v1/pools", spec).await.assert_ok_response(201).json()
    }

    /// `GET /v1/pools/default/{name}`, expecting 200.
    pub async fn get_pool(&self, name: &str) -> api::Pool {
        self.get(ADMIN, &format!("/v1/pools/default/{name}")).await.assert_ok_response(200).json()
    }

    /// `GET /v1/pools?{query}` (`""`: no query), expecting 200: the pools.
    pub async fn list_pools(&self, query: &str) -> Vec<api::Pool> {
        self.get(ADMIN, &with_query("/v1/pools", query)).await.assert_ok_response(200).json::<api::PoolList>().pools
    }

    /// `PUT /v1/pools/default/{name}` with `spec`, expecting 200: the updated pool.
    pub async fn updated_pool(&self, name: &str, spec: Value) -> api::Pool {
        self.put(ADMIN, &format!("/v1/pools/default/{name}"), spec).await.assert_ok_response(200).json()
    }

    /// `POST /v1/hosts` with `body` (a HostSpec), expecting 201: the new host.
    pub async fn created_host(&self, body: Value) -> api::Host {
        self.post(ADMIN, "/v1/hosts", body).await.assert_ok_response(201).json()
    }

    /// `GET /v1/hosts/{name}`, expecting 200.
    pub async fn get_host(&self, name: &str) -> api::Host {
        self.get(ADMIN, &format!("/v1/hosts/{name}")).await.assert_ok_response(200).json()
    }

    /// `GET /v1/hosts`, expecting 200: the hosts, in the order answered.
    pub async fn list_hosts(&self) -> Vec<api::Host> {
        self.get(ADMIN, "/v1/hosts").await.assert_ok_response(200).json::<api::HostList>().hosts
    }

    /// `PUT /v1/hosts/{name}` with `body` (a HostSpec), expecting 200: the updated host.
    pub async fn updated_host(&self, name: &str, body: Value) -> api::Host {
        self.put(ADMIN, &format!("/v1/hosts/{name}"), body).await.assert_ok_response(200).json()
    }

    /// `POST /v1/hosts/{name}/cordon` with `body` (`None`: no body at all), expecting 200.
    pub async fn cordoned(&self, name: &str, body: Option<Value>) -> api::Host {
        self.request(Method::POST, &format!("/v1/hosts/{name}/cordon"), Some(ADMIN), body, &[])
            .await
            .assert_ok_response(200)
            .json()
    }

    /// `POST /v1/hosts/{name}/uncordon` without a body, expecting 200.
    pub async fn uncordoned(&self, name: &str) -> api::Host {
        self.request(Method::POST, &format!("/v1/hosts/{name}/uncordon"), Some(ADMIN), None, &[])
            .await
            .assert_ok_response(200)
            .json()
    }

    /// `GET /v1/vms?{query}` (`""`: no query), expecting 200: the VM records.
    pub async fn list_vms(&self, query: &str) -> Vec<api::VmRecord> {
        self.get(ADMIN, &with_query("/v1/vms", query)).await.assert_ok_response(200).json::<api::VmList>().vms
    }

    /// `GET /v1/vms/{id}`, expecting 200.
    pub async fn get_vm(&self, id: &str) -> api::VmRecord {
        self.get(ADMIN, &format!("/v1/vms/{id}")).await.assert_ok_response(200).json()
    }

    /// `GET /v1/events?{query}` (`""`: no query), expecting 200: the events and `next_after`.
    pub async fn events(&self, query: &str) -> api::EventList {
        self.get(ADMIN, &with_query("/v1/events", query)).await.assert_ok_response(200).json()
    }

    /// Runs one reconcile pass.
    /// Moves the app's clock forward: lease expiry and its warning, heartbeats, abandoned
    /// claims and the reconciler's timeouts compare times by it (the database's `now()` while
    /// it is unmoved). Use it instead of rewriting timestamps or sleeping.
    pub fn advance_clock(&self, by: Duration) {
        self.state.clock.advance(by);
    }

    /// The app's clock back at the real time.
    pub fn reset_clock(&self) {
        self.state.clock.reset();
    }

    pub async fn pass(&self) -> poolmgr_core::reconcile::PassReport {
        poolmgr_core::reconcile::run_pass(&self.state).await.expect("reconcile pass")
    }

    /// Runs reconcile passes until `done` holds (checked after each pass), at most `max`
    /// passes, pausing briefly between them so simulated VMs can boot. Panics if it never holds.
    pub async fn settle<F, Fut>(&self, max: usize, what: &str, done: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        for _ in 0..max {
            self.pass().await;
            if done().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        panic!("not settled after {max} passes: {what}");
    }

    /// Starts another simulator and registers it as host `name`.
    pub async fn add_sim_host(&self, name: &str) -> (Sim, SimServer) {
        let sim = Sim::new(SimConfig {
            boot_delay: Duration::from_millis(50),
            delete_delay: Duration::from_millis(20),
            basic_auth_token: None,
        });
        let server = sim.serve("127.0.0.1:0".parse().unwrap()).await.expect("start flintlock-sim");
        self.post(
            ADMIN,
            "/v1/hosts",
            json!({"name": name, "address": server.addr.to_string(), "tls": {"insecure": true}}),
        )
        .await
        .assert_ok(201);
        (sim, server)
    }

    /// Number of VM rows of pool default/`pool` in `phase`.
    pub async fn count_phase(&self, pool: &str, phase: &str) -> i64 {
        self.conn()
            .await
            .query_one(
                "SELECT count(*) FROM vms WHERE pool_namespace = 'default' AND pool_name = $1 AND phase = $2",
                &[&pool, &phase],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// The uids of a simulator's live (not DELETING) microVMs, in any namespace.
    pub fn sim_live_uids(sim: &Sim) -> std::collections::HashSet<String> {
        use flintlock_proto::types::micro_vm_status::MicroVmState;
        sim.vms()
            .into_iter()
            .filter(|m| m.status.as_ref().is_some_and(|s| s.state != MicroVmState::Deleting as i32))
            .filter_map(|m| m.spec.and_then(|s| s.uid))
            .collect()
    }

    /// Live (not DELETING) simulator VMs in a deployment's namespace for `default` pools
    /// (`poolmgr-<deployment id>-default`, whichever deployment: a test's simulator serves one).
    pub fn sim_live(sim: &Sim) -> Vec<flintlock_proto::types::MicroVm> {
        use flintlock_proto::types::micro_vm_status::MicroVmState;
        let of_default_pools = |ns: &str| {
            ns.strip_prefix("poolmgr-").and_then(|rest| rest.split_once('-')).is_some_and(|(id, pool_ns)| {
                poolmgr_core::deployment::validate_deployment_id(id).is_ok() && pool_ns == "default"
            })
        };
        sim.vms()
            .into_iter()
            .filter(|m| {
                m.spec.as_ref().is_some_and(|s| of_default_pools(&s.namespace))
                    && m.status.as_ref().is_some_and(|s| s.state != MicroVmState::Deleting as i32)
            })
            .collect()
    }

    /// The flintlock namespace this app's deployment creates pool namespace `pool_namespace`'s
    /// VMs in (`poolmgr-<deployment id>-<pool namespace>`).
    pub async fn flintlock_namespace(&self, pool_namespace: &str) -> String {
        self.state.flintlock_namespace(pool_namespace).await.expect("the deployment id")
    }

    /// A pooled connection for direct SQL (straight to PostgreSQL, even when the app goes
    /// through a pooler: the tests' SQL uses named prepared statements).
    pub async fn conn(&self) -> deadpool_postgres::Object {
        self.direct.raw().get().await.expect("test connection")
    }

    /// Inserts only a VM row of pool default/`pool_name` on `host` in `phase` with `uid`
    /// (`None`: an intent whose create was never answered); no microVM is created.
    pub async fn insert_vm_row(&self, pool_name: &str, id: &str, host: &str, phase: Phase, uid: Option<&str>) {
        let pref = pool(pool_name);
        store::vm_insert(
            &**self.conn().await,
            &VmInsert { id, uid, pool: &pref, flintlock_host: host, phase, network_interfaces: &json!({}) },
        )
        .await
        .unwrap_or_else(|e| panic!("insert vm row {id}: {e}"));
    }

    /// Creates a VM in the simulator and its row in `phase`, as provisioning would.
    pub async fn seed_vm(&self, pool_name: &str, phase: Phase) -> store::VmRow {
        self.seed_vm_in("default", pool_name, phase).await
    }

    /// [`TestApp::seed_vm`] in a pool of any namespace.
    pub async fn seed_vm_in(&self, namespace: &str, pool_name: &str, phase: Phase) -> store::VmRow {
        let pool = PoolRef { namespace: namespace.into(), name: pool_name.into() };
        let id = format!("{pool_name}-{}", ulid::Ulid::generate().to_string().to_lowercase());
        let host = {
            let conn = self.conn().await;
            store::host_get(&**conn, SIM_HOST).await.unwrap().unwrap().0
        };
        let tpl: poolmgr_core::template::MicroVmTemplate = serde_json::from_value(template()).unwrap();
        let created = self
            .state
            .flintlock
            .create(&host.endpoint(), tpl.to_spec(&id, &self.flintlock_namespace(namespace).await))
            .await
            .expect("sim create");
        let uid = created.spec.and_then(|s| s.uid).expect("uid");
        let nics =
            json!({"eth1": {"host_device_name": "fltap0000001", "index": 7, "mac_address": "aa:bb:cc:dd:ee:01"}});
        let conn = self.conn().await;
        store::vm_insert(
            &**conn,
            &VmInsert {
                id: &id,
                uid: Some(&uid),
                pool: &pool,
                flintlock_host: SIM_HOST,
                phase,
                network_interfaces: &nics,
            },
        )
        .await
        .expect("insert vm row")
    }

    pub async fn seed_available(&self, pool_name: &str, n: usize) -> Vec<store::VmRow> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.seed_vm(pool_name, Phase::Available).await);
        }
        out
    }

    /// One scalar from SQL.
    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        self.conn().await.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0)
    }

    /// VM phases of a pool, by id.
    pub async fn phase_of(&self, vm_id: &str) -> Option<String> {
        self.conn().await.query_opt("SELECT phase FROM vms WHERE id = $1", &[&vm_id]).await.unwrap().map(|r| r.get(0))
    }

    pub async fn count_events(&self, kind: &str) -> i64 {
        self.conn().await.query_one("SELECT count(*) FROM events WHERE type = $1", &[&kind]).await.unwrap().get(0)
    }

    /// `GET /metrics` with the admin token: the Prometheus text (200, `text/plain`).
    /// Scrapes `/metrics` the way the monitoring kit does: with a viewer token.
    pub async fn scrape(&self) -> String {
        let r = self.get(VIEWER, "/metrics").await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.body);
        let ct = r.headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
        assert!(ct.starts_with("text/plain"), "Prometheus text, got content-type {ct:?}");
        r.body.as_str().unwrap_or_else(|| panic!("metrics body is text: {}", r.body)).to_owned()
    }

    /// Value of a counter line in the Prometheus text, 0 if absent.
    pub fn metric(&self, line_prefix: &str) -> f64 {
        self.state
            .metrics
            .render()
            .lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}
