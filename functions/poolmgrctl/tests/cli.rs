//! The real `poolmgrctl` binary against a real `poolmgr-local` on a fresh test database, with
//! an in-process `flintlock-sim` registered through the CLI itself
//! (`poolmgr_tests::local::LocalServer`).
//!
//! Needs `POOLMGR_TEST_DATABASE_URL` (run with `scripts/test.sh -p poolmgrctl`). The
//! `poolmgr-local` binary is built next to `poolmgrctl` with `cargo build` on first use (a
//! no-op when it is fresh).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use poolmgr_tests::local::LocalServer;
use poolmgr_tests::{ADMIN, CLIENT_A as CLIENT};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const CTL: &str = env!("CARGO_BIN_EXE_poolmgrctl");

// ---------------------------------------------------------------------------------------
// The stack
// ---------------------------------------------------------------------------------------

struct Stack {
    server: LocalServer,
    endpoint: String,
    http: reqwest::Client,
    dir: PathBuf,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one run of the CLI did.
#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    #[track_caller]
    fn ok(self) -> Out {
        assert_eq!(self.code, 0, "expected success: {self:#?}");
        self
    }

    #[track_caller]
    fn json(&self) -> Value {
        assert_eq!(self.code, 0, "expected success: {self:#?}");
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }

    /// The CLI failed with `code` and printed `status: message` on stderr.
    #[track_caller]
    fn fails(&self, code: i32, status: &str) {
        assert_eq!(self.code, code, "expected exit {code} ({status}): {self:#?}");
        let line = self.stderr.lines().last().unwrap_or_default();
        assert!(line.starts_with(&format!("{status}: ")) && line.len() > status.len() + 2, "{self:#?}");
    }

    /// The table's header cells and rows, split on runs of two or more spaces.
    fn table(&self) -> Vec<Vec<String>> {
        self.stdout
            .lines()
            .map(|l| l.split("  ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect())
            .collect()
    }
}

fn out(o: std::process::Output) -> Out {
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `poolmgrctl` with no POOLMGR_* variable and a config directory of its own (empty unless
/// a test writes there), so the user's config file never takes part.
fn bare_cmd(config_home: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(CTL);
    for (k, _) in std::env::vars() {
        if k.starts_with("POOLMGR_") {
            c.env_remove(k);
        }
    }
    c.env("XDG_CONFIG_HOME", config_home).args(args).kill_on_drop(true);
    c
}

/// `poolmgrctl` with the endpoint and token in the environment.
fn ctl_cmd(endpoint: &str, token: &str, args: &[&str]) -> Command {
    let mut c = bare_cmd(Path::new("/nonexistent/poolmgrctl-test"), args);
    c.env("POOLMGR_ENDPOINT", endpoint).env("POOLMGR_TOKEN", token);
    c
}

async fn run(mut c: Command) -> Out {
    let o = tokio::time::timeout(Duration::from_secs(90), c.stdin(Stdio::null()).output())
        .await
        .expect("poolmgrctl did not finish within 90s")
        .expect("run poolmgrctl");
    out(o)
}

/// Runs the CLI without a server (local checks, completion, unreachable endpoints).
async fn ctl_offline(endpoint: &str, args: &[&str]) -> Out {
    run(ctl_cmd(endpoint, ADMIN, args)).await
}

fn sigint(child: &Child) {
    let pid = child.id().expect("child still running");
    let s = std::process::Command::new("kill").args(["-INT", &pid.to_string()]).status().expect("run kill");
    assert!(s.success());
}

/// Reads `child`'s stdout until `done` holds for what was read (at most `within`).
async fn read_until(child: &mut Child, within: Duration, done: impl Fn(&str) -> bool) -> String {
    let mut lines = BufReader::new(child.stdout.as_mut().expect("piped stdout")).lines();
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + within;
    while !done(&seen) {
        match tokio::time::timeout_at(deadline, lines.next_line()).await {
            Ok(Ok(Some(l))) => {
                seen.push_str(&l);
                seen.push('\n');
            }
            other => panic!("stdout ended or timed out ({other:?}) before the expected output; got:\n{seen}"),
        }
    }
    seen
}

impl Stack {
    async fn start() -> Stack {
        let server = LocalServer::start().await;
        let dir = std::env::temp_dir().join(format!("poolmgrctl-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Stack { endpoint: server.endpoint.clone(), server, http: reqwest::Client::new(), dir }
    }

    async fn ctl(&self, args: &[&str]) -> Out {
        self.ctl_as(ADMIN, args).await
    }

    async fn ctl_as(&self, token: &str, args: &[&str]) -> Out {
        run(ctl_cmd(&self.endpoint, token, args)).await
    }

    fn spawn_ctl(&self, args: &[&str]) -> Child {
        ctl_cmd(&self.endpoint, ADMIN, args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn poolmgrctl")
    }

    /// A direct HTTP call with the admin token: (status, body).
    async fn api(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut b = self.http.request(method, format!("{}{path}", self.endpoint)).bearer_auth(ADMIN);
        if let Some(v) = body {
            b = b.json(&v);
        }
        let r = b.send().await.expect("direct HTTP call");
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap() })
    }

    async fn get(&self, path: &str) -> Value {
        let (status, body) = self.api(reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    }

    /// A file with permissions `mode` (a token file must be 0600 or stricter).
    fn write_mode(&self, name: &str, text: &str, mode: u32) -> String {
        use std::os::unix::fs::PermissionsExt;
        let p = self.write(name, text);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    /// Registers the simulator as host `sim` through the CLI.
    async fn add_sim_host(&self) -> Out {
        let addr = self.server.sim_server.addr.to_string();
        self.ctl(&["host", "add", "sim", "--address", &addr, "--insecure"]).await.ok()
    }

    /// Creates pool default/`name` from a YAML file through the CLI.
    async fn create_pool(&self, name: &str, size: i32) -> Out {
        let f = self.write(&format!("{name}.yaml"), &spec_yaml(name, size));
        self.ctl(&["pool", "create", "--file", &f]).await.ok()
    }

    async fn wait_available(&self, pool: &str, n: i64) {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let p = self.get(&format!("/v1/pools/default/{pool}")).await;
            if p["status"]["available"].as_i64() == Some(n) && p["status"]["provisioning"] == json!(0) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pool {pool} never had {n} AVAILABLE VMs: {p}\nserver log:\n{}",
                self.server.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn spec_yaml(name: &str, size: i32) -> String {
    format!(
        r#"# A pool on the simulator.
namespace: default
name: {name}
size: {size}
flintlock_hosts: [sim]
replenishment:
  strategy: REPLACE_ON_DELETE
microvm_template:
  root_volume:
    id: root
    source: {{container_source: "ghcr.io/liquidmetal-dev/ubuntu:22.04"}}
  kernel: {{image: "ghcr.io/liquidmetal-dev/kernel:6.1", filename: boot/vmlinux, add_network_config: true}}
  interfaces: [{{device_id: eth1, type: TAP}}]
heartbeat_interval_seconds: 30
heartbeat_expiry_seconds: 120
"#
    )
}

fn cell(v: &Value) -> String {
    v.as_str().map(String::from).unwrap_or_else(|| v.to_string())
}

fn spec_json(name: &str, size: i32) -> Value {
    yaml_serde::from_str(&spec_yaml(name, size)).unwrap()
}

/// A port nothing listens on.
fn closed_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("http://127.0.0.1:{port}")
}

// ---------------------------------------------------------------------------------------
// Without a server
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn completion_scripts_and_local_errors() {
    let none = closed_endpoint();
    let bash = ctl_offline(&none, &["completion", "bash"]).await.ok();
    assert!(bash.stdout.contains("_poolmgrctl()") && bash.stdout.contains("complete -F _poolmgrctl"), "{bash:#?}");
    assert!(bash.stdout.contains("claim") && bash.stdout.contains("--auto-request-id"));
    let zsh = ctl_offline(&none, &["completion", "zsh"]).await.ok();
    assert!(zsh.stdout.starts_with("#compdef poolmgrctl"), "{zsh:#?}");
    let fish = ctl_offline(&none, &["completion", "fish"]).await.ok();
    assert!(fish.stdout.contains("complete -c poolmgrctl"), "{fish:#?}");

    // Usage errors: exit 2, before anything is sent.
    assert_eq!(ctl_offline(&none, &["frobnicate"]).await.code, 2);
    assert_eq!(ctl_offline(&none, &["completion", "tcsh"]).await.code, 2);
    let both = ctl_offline(&none, &["lease", "claim", "--pool", "ci", "--request-id", "r", "--auto-request-id"]).await;
    assert_eq!(both.code, 2, "{both:#?}");
    assert_eq!(ctl_offline(&none, &["host", "add", "h", "--address", "a:1"]).await.code, 2);
    assert_eq!(ctl_offline(&none, &["lease", "claim", "--pool", "ci", "--wait", "soon"]).await.code, 2);
    ctl_offline(&none, &["pool", "get", "Team/CI"]).await.fails(2, "invalid_argument");
    ctl_offline("localhost:8080", &["pool", "list"]).await.fails(2, "invalid_argument");
    let long = "r".repeat(256);
    ctl_offline(&none, &["lease", "claim", "--pool", "ci", "--request-id", &long]).await.fails(2, "invalid_argument");

    // A spec is validated locally and the error names the field.
    let dir = std::env::temp_dir().join(format!("poolmgrctl-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, spec_yaml("ci", 1).replace("REPLACE_ON_DELETE", "MIN_SIZE_THRESHOLD\n  min_size: 3")).unwrap();
    let o = ctl_offline(&none, &["pool", "create", "--file", bad.to_str().unwrap()]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("replenishment.min_size"), "{o:#?}");
    let typo = dir.join("typo.json");
    let mut v = spec_json("ci", 1);
    v["heartbeat_expiry_second"] = json!(60);
    std::fs::write(&typo, v.to_string()).unwrap();
    let o = ctl_offline(&none, &["pool", "update", "--file", typo.to_str().unwrap()]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("unknown field heartbeat_expiry_second"), "{o:#?}");
    let o = ctl_offline(&none, &["pool", "create", "--file", dir.join("missing.yaml").to_str().unwrap()]).await;
    o.fails(2, "invalid_argument");
    std::fs::remove_dir_all(&dir).unwrap();

    // Nothing listens: unavailable, exit 6.
    ctl_offline(&none, &["pool", "list"]).await.fails(6, "unavailable");
    // An idempotent claim retries connection failures with the same id until --wait elapses.
    let started = Instant::now();
    let o = ctl_offline(&none, &["lease", "claim", "--pool", "ci", "--auto-request-id", "--wait", "2s"]).await;
    o.fails(6, "unavailable");
    assert!(started.elapsed() >= Duration::from_secs(2), "gave up early: {o:#?}");
    assert!(o.stderr.starts_with("claim: request_id "), "{o:#?}");
    assert!(o.stderr.matches("retrying in").count() >= 2, "{o:#?}");
    // Without a request id (nor --wait, which generates one) a connection failure is not
    // retried: a claim might have happened.
    let o = ctl_offline(&none, &["lease", "claim", "--pool", "ci"]).await;
    o.fails(6, "unavailable");
    assert!(!o.stderr.contains("retrying"), "{o:#?}");
    // --wait alone claims with a generated id, so it may retry.
    let o = ctl_offline(&none, &["lease", "claim", "--pool", "ci", "--wait", "1s"]).await;
    o.fails(6, "unavailable");
    assert!(o.stderr.starts_with("claim: request_id ") && o.stderr.contains("retrying in"), "{o:#?}");
}

// ---------------------------------------------------------------------------------------
// Hosts
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts() {
    let s = Stack::start().await;
    let o = s.add_sim_host().await;
    let t = o.table();
    assert_eq!(t[0], ["NAME", "ADDRESS", "TLS", "EXEC", "CORDONED", "VMS", "REASON"]);
    assert_eq!(t[1], ["sim", &s.server.sim_server.addr.to_string(), "insecure", "auto", "false", "0", "<none>"]);
    let addr = s.server.sim_server.addr.to_string();
    s.ctl(&["host", "add", "sim", "--address", &addr, "--insecure"]).await.fails(4, "already_exists");
    s.ctl(&["host", "add", "bad", "--address", "no-port", "--insecure"]).await.fails(2, "invalid_argument");
    s.ctl(&["host", "add", "tls", "--address", "h:1", "--ca-file", "/nonexistent/ca.pem"])
        .await
        .fails(2, "invalid_argument");

    // A TLS host from PEM files (never contacted: no pool names it).
    let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    let (ca, cert, key) = (s.write("ca.pem", pem), s.write("c.pem", pem), s.write("k.pem", pem));
    let o = s
        .ctl(&[
            "-o",
            "json",
            "host",
            "add",
            "spare",
            "--address",
            "127.0.0.1:9",
            "--ca-file",
            &ca,
            "--cert-file",
            &cert,
            "--key-file",
            &key,
            "--basic-auth-token",
            "s3cret",
        ])
        .await;
    let spare = o.json();
    assert_eq!(spare["tls"]["insecure"], json!(false));
    assert_eq!(spare["tls"]["ca_pem"], json!(pem));
    assert_eq!(spare["tls"]["key_pem"], Value::Null, "secrets are write-only");
    assert_eq!(spare["basic_auth_token"], Value::Null);
    let t = s.ctl(&["host", "get", "spare"]).await.ok().table();
    assert_eq!(t[1][2], "mtls");

    // -o json is the API object; -o yaml is the same object.
    assert_eq!(s.ctl(&["-o", "json", "host", "get", "sim"]).await.json(), s.get("/v1/hosts/sim").await);
    let y = s.ctl(&["-o", "yaml", "host", "get", "sim"]).await.ok();
    assert_eq!(yaml_serde::from_str::<Value>(&y.stdout).unwrap(), s.get("/v1/hosts/sim").await);
    assert_eq!(s.ctl(&["-o", "json", "host", "list"]).await.json(), s.get("/v1/hosts").await);
    let t = s.ctl(&["host", "list"]).await.ok().table();
    assert_eq!(t.len(), 3, "{t:?}");
    assert_eq!(t[1][0], "sim");
    assert_eq!(t[2][0], "spare");

    // Update replaces address and transport.
    let o = s.ctl(&["-o", "json", "host", "update", "spare", "--address", "127.0.0.1:10", "--insecure"]).await;
    assert_eq!(o.json()["address"], json!("127.0.0.1:10"));
    assert_eq!(o.json()["tls"]["ca_pem"], Value::Null);
    s.ctl(&["host", "update", "ghost", "--address", "h:1", "--insecure"]).await.fails(3, "not_found");

    // Issue 14 item 17: --exec declares the host's exec support; without it, auto.
    let args = ["host", "update", "spare", "--address", "127.0.0.1:10", "--insecure", "--exec"];
    let o = s.ctl(&[&["-o", "json"][..], &args[..], &["enabled"][..]].concat()).await;
    assert_eq!(o.json()["exec"], json!("enabled"));
    assert_eq!(s.get("/v1/hosts/spare").await["exec"], json!("enabled"));
    assert_eq!(s.ctl(&["host", "get", "spare"]).await.ok().table()[1][3], "enabled");
    assert_eq!(s.ctl(&[&args[..], &["sometimes"][..]].concat()).await.code, 2);
    let o = s.ctl(&["-o", "json", "host", "update", "spare", "--address", "127.0.0.1:10", "--insecure"]).await;
    assert_eq!(o.json()["exec"], json!("auto"));
    let o = s
        .ctl(&["-o", "json", "host", "add", "nox", "--address", "127.0.0.1:11", "--insecure", "--exec", "disabled"])
        .await;
    assert_eq!(o.json()["exec"], json!("disabled"));
    s.ctl(&["host", "remove", "nox"]).await.ok();

    // Cordon and uncordon.
    let o = s.ctl(&["-o", "json", "host", "cordon", "sim", "--reason", "kernel upgrade"]).await;
    assert_eq!(o.json()["cordoned"], json!(true));
    assert_eq!(o.json()["cordoned_reason"], json!("kernel upgrade"));
    let t = s.ctl(&["host", "get", "sim"]).await.ok().table();
    assert_eq!(t[1][4..], ["true", "0", "kernel upgrade"]);
    let o = s.ctl(&["-o", "json", "host", "uncordon", "sim"]).await;
    assert_eq!(o.json()["cordoned"], json!(false));
    s.ctl(&["host", "cordon", "ghost"]).await.fails(3, "not_found");
    s.ctl(&["host", "uncordon", "ghost"]).await.fails(3, "not_found");

    // Remove: refused while a pool names the host.
    s.create_pool("ci", 0).await;
    s.ctl(&["host", "remove", "sim"]).await.fails(4, "failed_precondition");
    let o = s.ctl(&["host", "remove", "spare"]).await.ok();
    assert_eq!(o.stdout, "host spare removed\n");
    s.ctl(&["host", "get", "spare"]).await.fails(3, "not_found");
    s.ctl(&["host", "remove", "spare"]).await.fails(3, "not_found");

    // Roles and tokens.
    s.ctl_as(CLIENT, &["host", "list"]).await.fails(1, "permission_denied");
    s.ctl_as("wrong", &["host", "list"]).await.fails(1, "unauthenticated");
}

// ---------------------------------------------------------------------------------------
// Pools
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    let o = s.create_pool("ci", 1).await;
    let t = o.table();
    assert_eq!(t[0][..3], ["POOL", "SIZE", "AVAILABLE"]);
    assert_eq!(t[1][..3], ["default/ci", "1", "0"]);
    assert_eq!(t[1][8..], ["REPLACE_ON_DELETE", "sim"]);
    let f = s.write("ci.json", &spec_json("ci", 1).to_string());
    s.ctl(&["pool", "create", "--file", &f]).await.fails(4, "already_exists");
    let mut other = spec_json("other", 1);
    other["flintlock_hosts"] = json!(["nohost"]);
    let f = s.write("other.json", &other.to_string());
    s.ctl(&["pool", "create", "--file", &f]).await.fails(4, "failed_precondition");
    // The template is the server's to check; its answer names the field.
    let mut typo = spec_json("typo", 1);
    typo["microvm_template"]["kernel"]["imag"] = json!("x");
    let f = s.write("typo.json", &typo.to_string());
    let o = s.ctl(&["pool", "create", "--file", &f]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("imag"), "{o:#?}");
    s.wait_available("ci", 1).await;

    // get / list: -o json and -o yaml are the API objects.
    let direct = s.get("/v1/pools/default/ci").await;
    assert_eq!(s.ctl(&["-o", "json", "pool", "get", "default/ci"]).await.json(), direct);
    assert_eq!(s.ctl(&["-o", "json", "pool", "get", "ci"]).await.json(), direct);
    let y = s.ctl(&["-o", "yaml", "pool", "get", "ci"]).await.ok();
    assert_eq!(yaml_serde::from_str::<Value>(&y.stdout).unwrap(), direct);
    assert_eq!(s.ctl(&["-o", "json", "pool", "list"]).await.json(), s.get("/v1/pools").await);
    let t = s.ctl(&["pool", "list", "--namespace", "default"]).await.ok().table();
    assert_eq!(t.len(), 2);
    assert_eq!(s.ctl(&["pool", "list", "-n", "elsewhere"]).await.ok().table().len(), 1);
    s.ctl(&["pool", "get", "ghost"]).await.fails(3, "not_found");
    s.ctl(&["pool", "status", "ghost"]).await.fails(3, "not_found");

    // status
    let t = s.ctl(&["pool", "status", "ci"]).await.ok().table();
    assert_eq!(
        t,
        [
            [
                "POOL",
                "SIZE",
                "DESIRED",
                "REASON",
                "AVAILABLE",
                "CLAIMING",
                "LEASED",
                "PROVISIONING",
                "QUARANTINED",
                "DELETING",
                "CLAIMS/S",
                "REFUSED/S",
                "PROVISION_P90",
                "EXPECTED",
                "BATCH_BUFFER"
            ],
            ["default/ci", "1", "1", "STATIC", "1", "0", "0", "0", "0", "0", "-", "-", "-", "-", "-"],
        ]
    );
    assert_eq!(s.ctl(&["-o", "json", "pool", "status", "ci"]).await.json(), s.get("/v1/pools/default/ci").await);

    // status --watch redraws until Ctrl-C (into a pipe: one row per poll).
    let mut w = s.spawn_ctl(&["pool", "status", "ci", "--watch", "--interval", "200ms"]);
    let seen = read_until(&mut w, Duration::from_secs(20), |t| t.lines().count() >= 4).await;
    let lines: Vec<&str> = seen.lines().collect();
    assert!(lines[0].starts_with("POOL"), "{seen}");
    assert!(lines[1..].iter().all(|l| l.starts_with("default/ci")), "{seen}");
    sigint(&w);
    let status = tokio::time::timeout(Duration::from_secs(10), w.wait()).await.expect("watch stops").unwrap();
    assert_eq!(status.code(), Some(0));
    let mut w = s.spawn_ctl(&["-o", "json", "pool", "status", "ci", "--watch", "--interval", "200ms"]);
    let seen = read_until(&mut w, Duration::from_secs(20), |t| t.lines().count() >= 2).await;
    for l in seen.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["spec"]["name"], json!("ci"));
    }
    sigint(&w);
    assert_eq!(tokio::time::timeout(Duration::from_secs(10), w.wait()).await.unwrap().unwrap().code(), Some(0));

    // update
    let f = s.write("ci2.yaml", &spec_yaml("ci", 2));
    let o = s.ctl(&["-o", "json", "pool", "update", "--file", &f]).await;
    assert_eq!(o.json()["spec"]["size"], json!(2));
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["size"], json!(2));
    let f = s.write("ghost.yaml", &spec_yaml("ghost", 1));
    s.ctl(&["pool", "update", "--file", &f]).await.fails(3, "not_found");
    s.wait_available("ci", 2).await;

    // delete: refused while a VM is leased, unless --force.
    s.ctl(&["lease", "claim", "--pool", "ci"]).await.ok();
    s.ctl(&["pool", "delete", "ci"]).await.fails(4, "failed_precondition");
    let o = s.ctl(&["pool", "delete", "ci", "--force"]).await.ok();
    assert_eq!(o.stdout, "pool default/ci deleted\n");
    s.ctl(&["pool", "get", "ci"]).await.fails(3, "not_found");
    s.ctl(&["pool", "delete", "ci"]).await.fails(3, "not_found");
}

// ---------------------------------------------------------------------------------------
// Leases, VMs and events
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_vms_and_events() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 2).await;
    s.wait_available("ci", 2).await;

    // The same request id twice: the same lease, the second one replayed.
    let first = s.ctl(&["-o", "json", "lease", "claim", "--pool", "ci", "--request-id", "r-1"]).await.json();
    let again = s.ctl_as(ADMIN, &["-o", "json", "lease", "claim", "--pool", "default/ci", "--request-id", "r-1"]).await;
    let again = again.json();
    assert_eq!(first["replayed"], json!(false));
    assert_eq!(again["replayed"], json!(true));
    assert_eq!(first["lease"], again["lease"]);
    assert_eq!(first["vm"], again["vm"]);
    let lease_id = first["lease"]["lease_id"].as_str().unwrap().to_owned();
    let vm_id = first["vm"]["id"].as_str().unwrap().to_owned();
    assert_eq!(first["lease"], s.get(&format!("/v1/leases/{lease_id}")).await);
    let vm_uid = first["vm"]["uid"].as_str().unwrap().to_owned();
    assert_ne!(vm_uid, vm_id);
    let t = s.ctl(&["lease", "claim", "--pool", "ci", "--request-id", "r-1"]).await.ok().table();
    // One name for one thing: VM is the VM's id, UID its flintlock uid (as in `lease list`).
    assert_eq!(t[0], ["LEASE_ID", "POOL", "VM", "UID", "HOST", "EXPIRES", "REQUEST_ID", "REPLAYED"]);
    assert_eq!(t[1][..5], [lease_id.as_str(), "default/ci", vm_id.as_str(), vm_uid.as_str(), "sim"]);
    assert_eq!(t[1][6..], ["r-1", "true"]);

    // get / list
    let direct = s.get(&format!("/v1/leases/{lease_id}")).await;
    assert_eq!(s.ctl(&["-o", "json", "lease", "get", &lease_id]).await.json(), direct);
    let t = s.ctl(&["lease", "get", &lease_id]).await.ok().table();
    assert_eq!(t[0], ["LEASE_ID", "POOL", "UID", "EXPIRES", "REQUEST_ID"]);
    assert_eq!(direct["vm_uid"], json!(vm_uid));
    let row = [lease_id.as_str(), "default/ci", vm_uid.as_str(), direct["expires_at"].as_str().unwrap(), "r-1"];
    assert_eq!(t[1], row);
    let second = s.ctl(&["-o", "json", "lease", "claim", "--pool", "ci"]).await.json();
    assert_eq!(second["lease"]["request_id"], Value::Null);
    let t = s.ctl(&["lease", "list"]).await.ok().table();
    assert_eq!(t[0], ["LEASE_ID", "POOL", "UID", "EXPIRES", "REQUEST_ID"]);
    assert_eq!(t.len(), 3, "{t:?}");
    assert!(t.contains(&row.map(String::from).to_vec()), "{t:?}");
    assert!(t.iter().any(|r| r[0] == second["lease"]["lease_id"].as_str().unwrap() && r[4] == "<none>"), "{t:?}");
    assert_eq!(s.ctl(&["-o", "json", "lease", "list"]).await.json(), s.get("/v1/leases").await);
    // Pages are followed and merged into one answer.
    assert_eq!(s.ctl(&["-o", "json", "lease", "list", "--page-size", "1"]).await.json(), s.get("/v1/leases").await);
    assert_eq!(
        s.ctl(&["-o", "json", "lease", "list", "--pool", "default/ci"]).await.json(),
        s.get("/v1/leases?namespace=default&pool=ci").await
    );
    assert_eq!(s.ctl(&["lease", "list", "--pool", "other"]).await.ok().table().len(), 1);
    // A client token sees only the leases it claimed.
    let mine = s.ctl_as(CLIENT, &["-o", "json", "lease", "list"]).await.json();
    assert_eq!(mine["leases"], json!([]));

    // The pool is empty now: RESOURCE_EXHAUSTED at once, or after --wait with progress.
    s.ctl(&["lease", "claim", "--pool", "ci"]).await.fails(5, "resource_exhausted");
    let started = Instant::now();
    let o = s.ctl(&["lease", "claim", "--pool", "ci", "--wait", "1500ms"]).await;
    o.fails(5, "resource_exhausted");
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert!(o.stderr.contains("claim: attempt 1: resource_exhausted: "), "{o:#?}");
    s.ctl(&["lease", "claim", "--pool", "ghost"]).await.fails(3, "not_found");
    s.ctl(&["lease", "claim", "--pool", "ghost", "--auto-request-id"]).await.fails(3, "not_found");

    // heartbeat
    let hb = s.ctl(&["-o", "json", "lease", "heartbeat", &lease_id]).await.json();
    assert_eq!(hb["lease"]["lease_id"], json!(lease_id));
    assert!(hb["lease"]["expires_at"].as_str().unwrap() >= first["lease"]["expires_at"].as_str().unwrap());
    assert_eq!(hb["lease"], s.get(&format!("/v1/leases/{lease_id}")).await);
    let t = s.ctl(&["lease", "heartbeat", &lease_id]).await.ok().table();
    assert_eq!(t[1][0], lease_id);

    // VMs
    let vms = s.ctl(&["-o", "json", "vm", "list"]).await.json();
    assert_eq!(vms, s.get("/v1/vms").await);
    assert_eq!(vms["vms"].as_array().unwrap().len(), 2);
    let t = s.ctl(&["vm", "list", "--pool", "ci", "--phase", "leased"]).await.ok().table();
    assert_eq!(t[0], ["ID", "POOL", "HOST", "PHASE", "LEASE_ID", "CREATED"]);
    assert_eq!(t.len(), 3);
    assert!(t.iter().any(|r| r[0] == vm_id && r[3] == "LEASED" && r[4] == lease_id), "{t:?}");
    assert_eq!(s.ctl(&["vm", "list", "--phase", "available"]).await.ok().table().len(), 1);
    assert_eq!(s.ctl(&["vm", "list", "-n", "default"]).await.ok().table().len(), 3);
    assert_eq!(s.ctl(&["vm", "list", "--phase", "sleeping"]).await.code, 2);
    assert_eq!(s.ctl(&["-o", "json", "vm", "get", &vm_id]).await.json(), s.get(&format!("/v1/vms/{vm_id}")).await);
    s.ctl(&["vm", "get", "ci-nope"]).await.fails(3, "not_found");
    s.ctl_as(CLIENT, &["vm", "list"]).await.fails(1, "permission_denied");

    // Events: the feed so far, then followed.
    let direct = s.get("/v1/events?after=0&limit=1000").await;
    let all = direct["events"].as_array().unwrap();
    assert!(all.iter().any(|e| e["type"] == json!("VM_CLAIMED")), "{direct}");
    // The feed only grows (reconcile passes may add events): what the CLI printed starts with
    // what the direct call saw.
    let o = s.ctl(&["-o", "json", "events", "tail", "--no-follow", "--limit", "2"]).await.ok();
    let lines: Vec<Value> = o.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() >= all.len() && &lines[..all.len()] == all.as_slice(), "paged through the whole feed: {o:#?}");
    let first_id = all[0]["id"].to_string();
    let t = s.ctl(&["events", "tail", "--no-follow", "--pool", "ci", "--since", &first_id]).await.ok().table();
    assert_eq!(t[0], ["ID", "TIME", "TYPE", "POOL", "VM", "LEASE_ID"]);
    assert!(t.len() >= all.len(), "{t:?}");
    assert_eq!(
        t[1][..4],
        [all[1]["id"].to_string(), cell(&all[1]["created_at"]), cell(&all[1]["type"]), "default/ci".into()]
    );
    let last = direct["next_after"].as_i64().unwrap().to_string();
    let mut tail = s.spawn_ctl(&["events", "tail", "--pool", "default/ci", "--since", &last]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.ctl(&["lease", "release", second["lease"]["lease_id"].as_str().unwrap()]).await.ok();
    let seen = read_until(&mut tail, Duration::from_secs(20), |t| t.contains("VM_DELETED_ON_RELEASE")).await;
    assert!(seen.starts_with("ID "), "{seen}");
    sigint(&tail);
    let o = out(tokio::time::timeout(Duration::from_secs(10), tail.wait_with_output()).await.unwrap().unwrap());
    assert_eq!(o.code, 0, "{o:#?}");
    assert!(o.stderr.contains("resume with --since"), "{o:#?}");

    // release
    let o = s.ctl(&["lease", "release", &lease_id]).await.ok();
    assert_eq!(o.stdout, format!("lease {lease_id} released\n"));
    s.ctl(&["lease", "release", &lease_id]).await.fails(3, "not_found");
    s.ctl(&["lease", "heartbeat", &lease_id]).await.fails(3, "not_found");
    s.ctl(&["lease", "get", &lease_id]).await.fails(3, "not_found");
    // The request id is free again: a fresh claim (the pool refills one VM per release).
    s.wait_available("ci", 2).await;
    let fresh = s.ctl(&["-o", "json", "lease", "claim", "--pool", "ci", "--request-id", "r-1"]).await.json();
    assert_eq!(fresh["replayed"], json!(false));
    assert_ne!(fresh["lease"]["lease_id"], json!(lease_id));

    // Issue 14 item 5: `vm delete` discards a VM; a leased one is refused.
    let leased = fresh["vm"]["id"].as_str().unwrap();
    s.ctl(&["vm", "delete", leased]).await.fails(4, "failed_precondition");
    assert_eq!(s.get(&format!("/v1/vms/{leased}")).await["phase"], json!("LEASED"));
    let available = s.get("/v1/vms?phase=AVAILABLE").await;
    let spare = available["vms"][0]["id"].as_str().unwrap().to_owned();
    let o = s.ctl(&["vm", "delete", &spare]).await.ok();
    assert_eq!(o.stdout, format!("vm {spare} deleted\n"));
    s.ctl(&["vm", "get", &spare]).await.fails(3, "not_found");
    s.ctl(&["vm", "delete", &spare]).await.fails(3, "not_found");
    s.ctl_as(CLIENT, &["vm", "delete", leased]).await.fails(1, "permission_denied");
}

// ---------------------------------------------------------------------------------------
// Issue 26 item 5: script-friendly output and `pool wait`
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn bad_filters_and_formats_are_usage_errors_before_anything_is_sent() {
    // Nothing listens: a request would be `unavailable` (6); these fail first, with 2.
    let none = closed_endpoint();
    for args in [
        &["--jq", ".pools[", "pool", "list"][..],
        &["--jq", "nosuchfilter", "pool", "list"],
        &["-o", "yaml", "--jq", ".", "pool", "list"],
        &["-o", "name", "--jq", ".", "pool", "list"],
        &["-o", "jsonpath={.pools[}", "pool", "list"],
        &["-o", "jsonpath={range .pools[*]}{.spec.name}{end}", "pool", "list"],
        &["-o", "jsonpath=", "pool", "list"],
        &["-o", "xml", "pool", "list"],
        &["--jq", ".[", "context", "list"],
    ] {
        let o = ctl_offline(&none, args).await;
        assert_eq!(o.code, 2, "{args:?}: {o:#?}");
        assert!(!o.stderr.contains("connect"), "{args:?}: {o:#?}");
    }
    let o = ctl_offline(&none, &["--jq", ".pools[", "pool", "list"]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("--jq: expected"), "{o:#?}");
    // -o json with --jq is fine: the same JSON, filtered (and here nothing listens).
    ctl_offline(&none, &["-o", "json", "--jq", ".", "pool", "list"]).await.fails(6, "unavailable");
    // A program is compiled, never run, before the request: one that loops or recurses for
    // ever on any input gets as far as the (here refused) request.
    for code in ["repeat(.)", "def f: 1 + f; f", "[range(infinite)]"] {
        ctl_offline(&none, &["--jq", code, "pool", "list"]).await.fails(6, "unavailable");
    }
    // Modules and data files cannot be loaded: a usage error before anything is sent.
    for code in [r#"include "lib"; ."#, r#"import "lib" as $l; $l"#] {
        let o = ctl_offline(&none, &["--jq", code, "pool", "list"]).await;
        o.fails(2, "invalid_argument");
        assert!(o.stderr.contains("lib"), "{o:#?}");
    }
    let o = ctl_offline(&none, &["pool", "wait", "ci", "--available", "-1"]).await;
    assert_eq!(o.code, 2, "{o:#?}");
    // A poll interval under 100 ms would poll with no pause: refused before anything is sent.
    for args in [
        &["pool", "wait", "ci", "--available", "1", "--interval", "0"][..],
        &["pool", "wait", "ci", "--available", "1", "--interval", "50ms"],
        &["pool", "status", "ci", "--watch", "--interval", "0s"],
        &["pool", "rollout", "status", "ci", "--watch", "--interval", "0"],
    ] {
        let o = ctl_offline(&none, args).await;
        assert_eq!(o.code, 2, "{args:?}: {o:#?}");
        assert!(o.stderr.contains("at least 100ms") && !o.stderr.contains("connect"), "{args:?}: {o:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jq_jsonpath_and_name_print_what_scripts_need_and_pool_wait_waits() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 2).await;

    // pool wait: progress on stderr until 2 are AVAILABLE, then the pool.
    let o = s.ctl(&["--timeout", "60s", "pool", "wait", "ci", "--available", "2", "--interval", "200ms"]).await.ok();
    assert_eq!(o.stdout, "pool default/ci: 2 VMs AVAILABLE\n", "{o:#?}");
    assert!(o.stderr.contains("pool default/ci: 2 AVAILABLE (wanted 2)"), "{o:#?}");
    assert_eq!(s.get("/v1/pools/default/ci").await["status"]["available"], json!(2));
    let o = s.ctl(&["-o", "name", "pool", "wait", "ci", "--available", "1"]).await.ok();
    assert_eq!(o.stdout, "default/ci\n");
    // Never reached: exit 9 after --timeout, saying what the pool has and what to do.
    let started = Instant::now();
    let o = s.ctl(&["--timeout", "2s", "pool", "wait", "ci", "--available", "3", "--interval", "200ms"]).await;
    o.fails(9, "deadline_exceeded");
    assert!(started.elapsed() >= Duration::from_secs(2), "{o:#?}");
    assert!(o.stderr.contains("2/3 AVAILABLE") && o.stderr.contains("works towards 2 VMs"), "{o:#?}");
    assert!(o.stderr.contains("--timeout") && o.stderr.contains("events tail --pool default/ci"), "{o:#?}");
    assert!(o.stdout.is_empty(), "{o:#?}");
    s.ctl(&["pool", "wait", "ghost", "--available", "1"]).await.fails(3, "not_found");

    // --jq on a claim: the lease id alone, as a script wants it.
    let o = s.ctl(&["--jq", ".lease.lease_id", "lease", "claim", "--pool", "ci", "--request-id", "j-1"]).await.ok();
    let lease_id = o.stdout.strip_suffix('\n').unwrap_or_else(|| panic!("{o:#?}")).to_owned();
    let lease = s.get(&format!("/v1/leases/{lease_id}")).await;
    assert_eq!(lease["request_id"], json!("j-1"));
    // -o jsonpath: the same, kubectl's way; text around the braces kept.
    let o = s.ctl(&["-o", "jsonpath={.lease.lease_id}", "lease", "claim", "--pool", "ci", "--request-id", "j-1"]).await;
    assert_eq!(o.ok().stdout, format!("{lease_id}\n"));
    let o =
        s.ctl(&["-o", "jsonpath=vm={.vm.id} uid={.vm.uid}", "lease", "claim", "--pool", "ci", "--request-id", "j-1"]);
    let o = o.await.ok();
    let vms = s.get("/v1/vms?phase=LEASED").await;
    let vm = &vms["vms"][0];
    assert_eq!(o.stdout, format!("vm={} uid={}\n", cell(&vm["id"]), cell(&vm["uid"])));
    // Several results: jq one per line, jsonpath joined by a space; non-strings as JSON.
    let o = s.ctl(&["--jq", ".vms[].id", "vm", "list"]).await.ok();
    let direct: Vec<String> =
        s.get("/v1/vms").await["vms"].as_array().unwrap().iter().map(|v| cell(&v["id"])).collect();
    assert_eq!(o.stdout, format!("{}\n", direct.join("\n")));
    let o = s.ctl(&["-o", "jsonpath={.vms[*].id}", "vm", "list"]).await.ok();
    assert_eq!(o.stdout, format!("{}\n", direct.join(" ")));
    let o = s.ctl(&["--jq", r#".vms | map(select(.phase == "LEASED")) | length"#, "vm", "list"]).await.ok();
    assert_eq!(o.stdout, "1\n");
    let o = s.ctl(&["-o", "json", "--jq", "{size: .spec.size}", "pool", "get", "ci"]).await;
    assert_eq!(o.json(), json!({"size": 2}));
    let o = s.ctl(&["-o", "jsonpath={.spec.replenishment}", "pool", "get", "ci"]).await.ok();
    assert_eq!(serde_json::from_str::<Value>(&o.stdout).unwrap(), json!({"strategy": "REPLACE_ON_DELETE"}));
    // A filter that fails on the answer: exit 10 (the request succeeded), saying why, and the
    // answer on stdout as -o json prints it.
    let o = s.ctl(&["--jq", ".spec.name.first", "pool", "get", "ci"]).await;
    o.fails(10, "invalid_argument");
    assert!(o.stderr.contains("--jq") && o.stderr.contains("request succeeded"), "{o:#?}");
    let answer: Value = serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:#?}"));
    assert_eq!(answer["spec"]["name"], json!("ci"));
    // A result that is not JSON is named as the filter's, not blamed on the server's answer.
    let o = s.ctl(&["--jq", "{size: nan}", "pool", "get", "ci"]).await;
    o.fails(10, "invalid_argument");
    assert!(o.stderr.contains("result 1 of the filter is not JSON") && !o.stderr.contains("re-encode"), "{o:#?}");

    // -o name: NAMESPACE/NAME for pools, ids for leases and VMs, names for hosts.
    assert_eq!(s.ctl(&["-o", "name", "pool", "list"]).await.ok().stdout, "default/ci\n");
    assert_eq!(s.ctl(&["-o", "name", "pool", "get", "ci"]).await.ok().stdout, "default/ci\n");
    assert_eq!(s.ctl(&["-o", "name", "lease", "list"]).await.ok().stdout, format!("{lease_id}\n"));
    assert_eq!(s.ctl(&["-o", "name", "vm", "list"]).await.ok().stdout, format!("{}\n", direct.join("\n")));
    assert_eq!(s.ctl(&["-o", "name", "host", "list"]).await.ok().stdout, "sim\n");
    let o = s.ctl(&["-o", "name", "events", "tail", "--no-follow", "--pool", "ci"]).await.ok();
    let ids: Vec<String> = s.get("/v1/events?pool=ci&namespace=default&limit=1000").await["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].to_string())
        .collect();
    assert!(o.stdout.starts_with(&format!("{}\n", ids.join("\n"))), "{o:#?}");
    // A command that answers nothing prints the name it acted on.
    assert_eq!(s.ctl(&["-o", "name", "lease", "release", &lease_id]).await.ok().stdout, format!("{lease_id}\n"));
    s.ctl(&["lease", "get", &lease_id]).await.fails(3, "not_found");

    // After a claim that the filter fails on, the lease is not lost: its id is on stdout.
    let o = s.ctl(&["--jq", ".lease.lease_id.first", "lease", "claim", "--pool", "ci", "--request-id", "j-2"]).await;
    o.fails(10, "invalid_argument");
    let answer: Value = serde_json::from_str(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:#?}"));
    let lost = cell(&answer["lease"]["lease_id"]);
    assert_eq!(s.get(&format!("/v1/leases/{lost}")).await["request_id"], json!("j-2"));
}

// ---------------------------------------------------------------------------------------
// Issue 26 item 9: declarative pools (`pool apply`, `pool diff`)
// ---------------------------------------------------------------------------------------

/// A spec of pool `name` as YAML with only the fields a person writes (the server fills in the
/// rest), and `extra` lines appended.
fn short_yaml(name: &str, size: i32, extra: &str) -> String {
    format!(
        "name: {name}\nsize: {size}\nflintlock_hosts: [sim]\nreplenishment: {{strategy: REPLACE_ON_DELETE}}\n\
         microvm_template:\n  root_volume: {{id: root, source: {{container_source: \"ghcr.io/x/ubuntu:22.04\"}}}}\n  \
         kernel: {{image: \"ghcr.io/x/kernel:6.1\", filename: boot/vmlinux}}\n  interfaces: [{{device_id: eth1, type: TAP}}]\n{extra}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_apply_creates_updates_and_leaves_pools_and_pool_diff_says_what_differs() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    let dir = s.dir.join("pools");
    std::fs::create_dir_all(&dir).unwrap();
    let dir_s = dir.to_string_lossy().into_owned();
    let a = dir.join("a.yaml");
    std::fs::write(
        &a,
        format!("{}---\n{}", short_yaml("ci", 1, ""), short_yaml("batch", 0, "rollout: {max_surge: 1}\n")),
    )
    .unwrap();
    let other: Value = yaml_serde::from_str(&short_yaml("other", 0, "hook_failure_policy: QUARANTINE\n")).unwrap();
    std::fs::write(dir.join("b.json"), json!([other]).to_string()).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a spec").unwrap();

    // Nothing exists yet: every pool differs, as an addition.
    let o = s.ctl(&["pool", "diff", "-f", &dir_s]).await;
    assert_eq!(o.code, 1, "{o:#?}");
    assert!(o.stderr.is_empty(), "{o:#?}");
    assert!(o.stdout.contains("--- /dev/null\n+++ ") && o.stdout.contains("a.yaml (document 2)\n"), "{o:#?}");
    assert!(o.stdout.contains("+name: ci\n") && o.stdout.contains("+name: other\n"), "{o:#?}");
    // --dry-run says what it would do and does nothing.
    let o = s.ctl(&["pool", "apply", "-f", &dir_s, "--dry-run"]).await.ok();
    assert!(o.stdout.contains("pool default/ci created (dry run)\n"), "{o:#?}");
    assert_eq!(s.get("/v1/pools").await["pools"], json!([]));

    let o = s.ctl(&["pool", "apply", "-f", &dir_s]).await.ok();
    assert_eq!(o.stdout, "pool default/ci created\npool default/batch created\npool default/other created\n", "{o:#?}");
    let p = s.get("/v1/pools/default/other").await;
    assert_eq!(p["spec"]["hook_failure_policy"], json!("QUARANTINE"));
    assert_eq!(s.get("/v1/pools/default/batch").await["spec"]["rollout"]["max_surge"], json!(1));

    // The server filled in its defaults; the files did not name them: no difference, and a
    // second apply changes nothing (not even the ETag).
    let o = s.ctl(&["pool", "diff", "-f", &dir_s]).await;
    assert_eq!((o.code, o.stdout.as_str()), (0, ""), "{o:#?}");
    let before = s.http.get(format!("{}/v1/pools/default/ci", s.endpoint)).bearer_auth(ADMIN).send().await.unwrap();
    let etag = before.headers()["etag"].to_str().unwrap().to_owned();
    let o = s.ctl(&["pool", "apply", "-f", &dir_s]).await.ok();
    assert_eq!(o.stdout, "pool default/ci unchanged\npool default/batch unchanged\npool default/other unchanged\n");
    let after = s.http.get(format!("{}/v1/pools/default/ci", s.endpoint)).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(after.headers()["etag"].to_str().unwrap(), etag);

    // A change in one document: diff shows it, --dry-run shows it and changes nothing, apply
    // applies it and leaves the rest.
    let a_s = a.to_string_lossy().into_owned();
    std::fs::write(
        &a,
        format!("{}---\n{}", short_yaml("ci", 2, ""), short_yaml("batch", 0, "rollout: {max_surge: 1}\n")),
    )
    .unwrap();
    let o = s.ctl(&["pool", "diff", "-f", &a_s]).await;
    assert_eq!(o.code, 1, "{o:#?}");
    assert!(o.stdout.starts_with("--- pool default/ci (current)\n+++ "), "{o:#?}");
    assert!(o.stdout.contains("-size: 1\n+size: 2\n") && !o.stdout.contains("batch"), "{o:#?}");
    let o = s.ctl(&["pool", "apply", "-f", &a_s, "--dry-run"]).await.ok();
    assert!(o.stdout.contains("-size: 1\n+size: 2\n") && o.stdout.contains("pool default/ci configured (dry run)\n"));
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["size"], json!(1));
    let o = s.ctl(&["-o", "json", "pool", "apply", "-f", &a_s]).await;
    let applied = o.json();
    assert_eq!(
        applied["applied"][0],
        json!({"pool": "default/ci", "action": "configured", "source": format!("{a_s} (document 1)")})
    );
    assert_eq!(applied["applied"][1]["action"], json!("unchanged"));
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["size"], json!(2));
    let o = s.ctl(&["pool", "diff", "-f", &a_s]).await;
    assert_eq!(o.code, 0, "{o:#?}");

    // Bad input changes nothing: a bad document anywhere, or a pool named twice.
    let bad = s.write("bad.yaml", &format!("{}---\n{}", short_yaml("new1", 1, ""), short_yaml("new2", -1, "")));
    let o = s.ctl(&["pool", "apply", "-f", &bad]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("bad.yaml (document 2)"), "{o:#?}");
    let twice = s.write("twice.yaml", &format!("{}---\n{}", short_yaml("new1", 1, ""), short_yaml("new1", 2, "")));
    s.ctl(&["pool", "apply", "-f", &twice]).await.fails(2, "invalid_argument");
    s.ctl(&["pool", "get", "new1"]).await.fails(3, "not_found");
    let empty = s.dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    s.ctl(&["pool", "apply", "-f", empty.to_str().unwrap()]).await.fails(2, "invalid_argument");
    // An error in diff never exits 1 (which means "differences").
    assert_eq!(s.ctl_as("wrong", &["pool", "diff", "-f", &dir_s]).await.code, 8);
    s.ctl_as(CLIENT, &["pool", "apply", "-f", &dir_s]).await.fails(1, "permission_denied");
}

/// The ETag the server gives pool default/`name` now.
async fn etag_of(s: &Stack, name: &str) -> String {
    let r = s.http.get(format!("{}/v1/pools/default/{name}", s.endpoint)).bearer_auth(ADMIN).send().await.unwrap();
    r.headers()["etag"].to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_apply_compares_with_the_servers_defaults_filled_in_and_sees_blocks_and_empty_flags() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    // No interface `type`: the server writes "TAP" back. A second apply changes nothing.
    let plain = short_yaml("ci", 0, "").replace(", type: TAP", "");
    assert!(!plain.contains("type"), "{plain}");
    let f = s.write("ci.yaml", &plain);
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci created\n");
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["microvm_template"]["interfaces"][0]["type"], json!("TAP"));
    let etag = etag_of(&s, "ci").await;
    let o = s.ctl(&["pool", "diff", "-f", &f]).await;
    assert_eq!((o.code, o.stdout.as_str()), (0, ""), "{o:#?}");
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci unchanged\n");
    assert_eq!(etag_of(&s, "ci").await, etag);

    // `rollout: {}` (every default) turns rollouts on: a change, applied, then unchanged.
    std::fs::write(&f, format!("{plain}rollout: {{}}\n")).unwrap();
    let o = s.ctl(&["pool", "diff", "-f", &f]).await;
    assert!(o.code == 1 && o.stdout.contains("+rollout: {}\n"), "{o:#?}");
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci configured\n");
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["rollout"]["max_surge"], json!("25%"));
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci unchanged\n");
    // And taking the block out turns them off again.
    std::fs::write(&f, &plain).unwrap();
    let o = s.ctl(&["pool", "diff", "-f", &f]).await;
    assert!(o.code == 1 && o.stdout.contains("-rollout: {}\n"), "{o:#?}");
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci configured\n");
    assert!(s.get("/v1/pools/default/ci").await["spec"].get("rollout").is_none());

    // A kernel flag without a value (`quiet: ""`) is a change too, both ways.
    let quiet = plain.replace("filename: boot/vmlinux}", "filename: boot/vmlinux, cmdline: {quiet: \"\"}}");
    assert_ne!(quiet, plain);
    std::fs::write(&f, &quiet).unwrap();
    let o = s.ctl(&["pool", "diff", "-f", &f]).await;
    assert!(o.code == 1 && o.stdout.contains("quiet"), "{o:#?}");
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci configured\n");
    let spec = s.get("/v1/pools/default/ci").await["spec"].clone();
    assert_eq!(spec["microvm_template"]["kernel"]["cmdline"], json!({"quiet": ""}));
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci unchanged\n");
    std::fs::write(&f, &plain).unwrap();
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci configured\n");
    assert!(s.get("/v1/pools/default/ci").await["spec"]["microvm_template"]["kernel"].get("cmdline").is_none());
}

/// The test proxies' common part: `parts` and `body` sent on to `url` (every header but
/// `host` and `content-length`).
async fn pass_on(
    http: &reqwest::Client,
    url: &str,
    parts: &axum::http::request::Parts,
    body: &[u8],
) -> reqwest::Response {
    let mut b = http.request(parts.method.clone(), url).body(body.to_vec());
    for (k, v) in &parts.headers {
        if k != "host" && k != "content-length" {
            b = b.header(k.as_str(), v.as_bytes());
        }
    }
    b.send().await.unwrap()
}

/// The upstream's answer `r` as the proxy's own, status, headers and body.
async fn answer(r: reqwest::Response) -> axum::http::Response<axum::body::Body> {
    let mut out = axum::http::Response::builder().status(r.status().as_u16());
    for (k, v) in r.headers() {
        out = out.header(k.as_str(), v.as_bytes());
    }
    out.body(axum::body::Body::from(r.bytes().await.unwrap())).unwrap()
}

/// Serves a test proxy's router on a free loopback port; its base URL.
async fn serve_proxy(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// A proxy to `upstream` that, before passing a PUT on, changes the pool itself (size 9,
/// unconditionally): someone else's change between apply's read and its write.
async fn meddling_proxy(upstream: String) -> String {
    use axum::body::{Body, to_bytes};
    use axum::http::Request;
    let http = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (http, upstream) = (http.clone(), upstream.clone());
        async move {
            let (parts, body) = req.into_parts();
            let body = to_bytes(body, 1 << 20).await.unwrap();
            let url = format!("{upstream}{}", parts.uri);
            if parts.method == reqwest::Method::PUT {
                let mut theirs: Value = serde_json::from_slice(&body).unwrap();
                theirs["size"] = json!(9);
                let r = http.put(&url).bearer_auth(ADMIN).json(&theirs).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
            let r = pass_on(&http, &url, &parts, &body).await;
            answer(r).await
        }
    });
    serve_proxy(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_apply_does_not_overwrite_a_change_made_after_it_read_the_pool() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    let f = s.write("ci.yaml", &short_yaml("ci", 1, ""));
    s.ctl(&["pool", "apply", "-f", &f]).await.ok();
    let f = s.write("ci.yaml", &short_yaml("ci", 3, ""));
    let proxy = meddling_proxy(s.endpoint.clone()).await;
    let o = run(ctl_cmd(&proxy, ADMIN, &["pool", "apply", "-f", &f])).await;
    o.fails(4, "failed_precondition");
    assert!(o.stderr.contains("changed by someone else") && o.stderr.contains("re-run"), "{o:#?}");
    // Their change stands; ours was not written over it.
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["size"], json!(9));
    // Re-run (without the meddler): it compares with what the pool is now, and applies.
    let o = s.ctl(&["pool", "diff", "-f", &f]).await;
    assert!(o.code == 1 && o.stdout.contains("-size: 9\n+size: 3\n"), "{o:#?}");
    assert_eq!(s.ctl(&["pool", "apply", "-f", &f]).await.ok().stdout, "pool default/ci configured\n");
    assert_eq!(s.get("/v1/pools/default/ci").await["spec"]["size"], json!(3));
}

/// Issue 25 item 11: text a client or admin chose (a `request_id`, a cordon reason) reaches
/// the terminal written out, never as the escape sequences, controls and bidi overrides it
/// holds; JSON keeps it exactly, as escapes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_controls_in_request_ids_and_reasons_are_written_out_in_tables() {
    const HOSTILE: &str = "job\x1b[2J\x1b]0;owned\x07\u{9b}31m\x7f\u{202e}txt.exe\n\rFAKE";
    const SHOWN: &str = r"job\x1b[2J\x1b]0;owned\x07\u{9b}31m\x7f\u{202e}txt.exe\n\rFAKE";
    #[track_caller]
    fn assert_inert(o: &Out) {
        let bad: Vec<char> = o
            .stdout
            .chars()
            .filter(|c| (c.is_control() && *c != '\n') || ('\u{202a}'..='\u{202e}').contains(c))
            .collect();
        assert!(bad.is_empty(), "raw {bad:?} on stdout: {o:#?}");
    }
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 1).await;
    s.wait_available("ci", 1).await;
    let claim = json!({"pool": {"namespace": "default", "name": "ci"}, "request_id": HOSTILE});
    let r = s.http.post(format!("{}/v1/claims", s.endpoint)).bearer_auth(CLIENT).json(&claim).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let lease: Value = r.json().await.unwrap();
    let lease_id = lease["lease"]["lease_id"].as_str().unwrap().to_owned();
    let (status, body) = s.api(reqwest::Method::POST, "/v1/hosts/sim/cordon", Some(json!({"reason": HOSTILE}))).await;
    assert_eq!(status, 200, "{body}");

    for args in [&["lease", "list"][..], &["lease", "get", &lease_id]] {
        let o = s.ctl(args).await.ok();
        assert_inert(&o);
        let t = o.table();
        assert_eq!(t.len(), 2, "one header, one row: {o:#?}");
        assert_eq!(t[1][4], SHOWN, "{o:#?}");
    }
    let o = s.ctl_as(CLIENT, &["lease", "claim", "--pool", "ci", "--request-id", HOSTILE]).await.ok();
    assert_inert(&o);
    assert_eq!(o.table()[1][6..], [SHOWN, "true"]);
    for args in [&["host", "list"][..], &["host", "get", "sim"]] {
        let o = s.ctl(args).await.ok();
        assert_inert(&o);
        let t = o.table();
        assert_eq!(t.len(), 2, "{o:#?}");
        assert_eq!(t[1][6], SHOWN, "{o:#?}");
    }
    // JSON carries the value itself, escaped (serde_json alone leaves DEL, C1 and U+202E raw).
    for args in [&["-o", "json", "lease", "get", &lease_id][..], &["-o", "json", "lease", "list"]] {
        let o = s.ctl(args).await;
        assert_inert(&o);
        assert!(o.json().to_string().contains(&json!(HOSTILE).to_string()), "{o:#?}");
    }
    // A filter's JSON results are as inert as -o json; a string result into a pipe is the
    // exact value (a script reads it back), like `jq -r`.
    let o = s.ctl(&["--jq", "{r: .request_id}", "lease", "get", &lease_id]).await.ok();
    assert_inert(&o);
    assert_eq!(o.json()["r"], json!(HOSTILE));
    let o = s.ctl(&["--jq", ".request_id", "lease", "get", &lease_id]).await.ok();
    assert_eq!(o.stdout, format!("{HOSTILE}\n"));
    let o = s.ctl(&["-o", "jsonpath={.request_id}", "lease", "get", &lease_id]).await.ok();
    assert_eq!(o.stdout, format!("{HOSTILE}\n"));
}

// ---------------------------------------------------------------------------------------
// The safe scripted claim
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_request_id_waits_for_an_empty_pool_to_refill_and_gets_one_lease() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 0).await;

    let claim = s.spawn_ctl(&["-o", "json", "lease", "claim", "--pool", "ci", "--auto-request-id", "--wait", "60s"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (status, body) = s.api(reqwest::Method::PUT, "/v1/pools/default/ci", Some(spec_json("ci", 1))).await;
    assert_eq!(status, 200, "{body}");
    let o = out(tokio::time::timeout(Duration::from_secs(70), claim.wait_with_output()).await.unwrap().unwrap());
    let r = o.json();

    // stderr: the generated id first, then the retries while the pool was empty.
    let first = o.stderr.lines().next().unwrap();
    let id = first.strip_prefix("claim: request_id ").unwrap_or_else(|| panic!("{o:#?}"));
    assert!(uuid::Uuid::parse_str(id).is_ok_and(|u| u.get_version_num() == 4), "{o:#?}");
    assert!(o.stderr.contains("resource_exhausted"), "{o:#?}");
    assert!(o.stderr.lines().filter(|l| l.contains("retrying in")).count() >= 2, "{o:#?}");
    assert_eq!(r["lease"]["request_id"], json!(id));
    assert_eq!(r["replayed"], json!(false));

    // Exactly one lease exists, the one printed.
    let db = s.server.db.client().await;
    let rows = db.query("SELECT lease_id, request_id FROM leases", &[]).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<_, String>(0), r["lease"]["lease_id"].as_str().unwrap());
    assert_eq!(rows[0].get::<_, Option<String>>(1).as_deref(), Some(id));
    assert_eq!(s.get(&format!("/v1/leases/{}", rows[0].get::<_, String>(0))).await, r["lease"]);
}

// ---------------------------------------------------------------------------------------
// Issue 13 section 2: contexts, token files, headers, manual pages
// ---------------------------------------------------------------------------------------

/// `poolmgrctl` with its own config home and only the given POOLMGR_* variables.
async fn bare(home: &Path, env: &[(&str, &str)], args: &[&str]) -> Out {
    let mut c = bare_cmd(home, args);
    for (k, v) in env {
        c.env(k, v);
    }
    run(c).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contexts_give_endpoint_and_token_and_flags_then_environment_win() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    let home = s.dir.join("config-home");
    let admin_file = s.write_mode("admin.token", &format!("{ADMIN}\n"), 0o600);
    let wrong = "wrong-token-0123456789";
    let closed = closed_endpoint();
    let ep = s.endpoint.as_str();

    // Contexts are made from the global flags given with `context set`; the first becomes
    // current. The file keeps the token file's path, never its content.
    let o = bare(&home, &[], &["--endpoint", ep, "--token-file", &admin_file, "context", "set", "local"]).await.ok();
    let config = home.join("poolmgr/config.yaml");
    assert_eq!(o.stdout, format!("context local saved in {}\n", config.display()));
    bare(&home, &[], &["--endpoint", &closed, "--token", wrong, "context", "set", "broken"]).await.ok();
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("current_context: local") && !text.contains(ADMIN), "{text}");
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&config).unwrap().permissions().mode() & 0o777, 0o600);
    }
    let t = bare(&home, &[], &["context", "list"]).await.ok().table();
    assert_eq!(t[0], ["CURRENT", "NAME", "ENDPOINT", "TOKEN"]);
    assert_eq!(t[1], ["broken", closed.as_str(), "<in config>"]);
    assert_eq!(t[2], ["*", "local", ep, &format!("file {admin_file}")]);
    let j = bare(&home, &[], &["-o", "json", "context", "list"]).await.json();
    assert_eq!(j["current_context"], json!("local"));
    assert!(!j.to_string().contains(wrong), "tokens are never printed: {j}");

    // The current context alone: no flag, no variable.
    let t = bare(&home, &[], &["host", "list"]).await.ok().table();
    assert_eq!(t[1][0], "sim");
    // --context and POOLMGR_CONTEXT pick another one.
    bare(&home, &[], &["--context", "broken", "host", "list"]).await.fails(6, "unavailable");
    bare(&home, &[("POOLMGR_CONTEXT", "broken")], &["host", "list"]).await.fails(6, "unavailable");
    // The environment beats the context, field by field: endpoint from POOLMGR_ENDPOINT, the
    // token still the context's (wrong), then POOLMGR_TOKEN too.
    let env_ep = [("POOLMGR_ENDPOINT", ep)];
    bare(&home, &env_ep, &["--context", "broken", "host", "list"]).await.fails(1, "unauthenticated");
    bare(&home, &[env_ep[0], ("POOLMGR_TOKEN", ADMIN)], &["--context", "broken", "host", "list"]).await.ok();
    bare(&home, &[("POOLMGR_TOKEN_FILE", &admin_file), env_ep[0]], &["--context", "broken", "host", "list"]).await.ok();
    // Flags beat the environment.
    bare(&home, &env_ep, &["--endpoint", &closed, "host", "list"]).await.fails(6, "unavailable");
    bare(&home, &[("POOLMGR_TOKEN", wrong)], &["--token-file", &admin_file, "host", "list"]).await.ok();
    bare(&home, &[("POOLMGR_TOKEN", ADMIN)], &["--token", wrong, "host", "list"]).await.fails(1, "unauthenticated");
    assert_eq!(bare(&home, &[], &["--token", "a", "--token-file", &admin_file, "host", "list"]).await.code, 2);

    // context use switches; an unknown one is refused and changes nothing.
    let o = bare(&home, &[], &["context", "use", "broken"]).await.ok();
    assert_eq!(o.stdout, format!("current context: broken ({closed})\n"));
    bare(&home, &[], &["host", "list"]).await.fails(6, "unavailable");
    let o = bare(&home, &[], &["context", "use", "nope"]).await;
    o.fails(3, "not_found");
    assert!(o.stderr.contains("it has: broken, local") && o.stderr.contains("context set nope"), "{o:#?}");
    bare(&home, &[], &["--context", "nope", "host", "list"]).await.fails(2, "invalid_argument");
    bare(&home, &[], &["context", "use", "local"]).await.ok();
    // A token file other users may read is refused, with the command that fixes it, however
    // it is named (the context's file, --token-file, POOLMGR_TOKEN_FILE).
    s.write_mode("admin.token", &format!("{ADMIN}\n"), 0o644);
    for o in [
        bare(&home, &[], &["host", "list"]).await,
        bare(&home, &[], &["--token-file", &admin_file, "host", "list"]).await,
        bare(&home, &[("POOLMGR_TOKEN_FILE", &admin_file), env_ep[0]], &["host", "list"]).await,
    ] {
        o.fails(2, "invalid_argument");
        assert!(o.stderr.contains(&format!("(mode 0644): run `chmod 600 {admin_file}`")), "{o:#?}");
        assert!(!o.stderr.contains(ADMIN), "{o:#?}");
    }
    s.write_mode("admin.token", &format!("{ADMIN}\n"), 0o600);
    bare(&home, &[], &["host", "list"]).await.ok();
    // An unreadable token file is a usage error naming it.
    std::fs::remove_file(&admin_file).unwrap();
    let o = bare(&home, &[], &["host", "list"]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains(&admin_file) && o.stderr.contains("context local"), "{o:#?}");

    // --no-headers: the rows only, in every table.
    let o = s.ctl(&["--no-headers", "host", "list"]).await.ok();
    assert_eq!(o.table().len(), 1);
    assert!(o.stdout.starts_with("sim "), "{o:#?}");
    let t = bare(&home, &[], &["--no-headers", "context", "list"]).await.ok().table();
    assert_eq!(t.len(), 2);
    s.create_pool("ci", 0).await;
    let t = s.ctl(&["--no-headers", "pool", "status", "ci"]).await.ok().table();
    assert_eq!(t, [["default/ci", "0", "0", "STATIC", "0", "0", "0", "0", "0", "0", "-", "-", "-", "-", "-"]]);
}

/// Issue 22: `pool expect` announces demand (client or admin token), the autoscaled pool's
/// status shows the desired size and why; bad input is refused before anything is sent.
#[tokio::test]
async fn pool_expect_prewarms_an_autoscaled_pool_and_status_says_why() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    let spec = format!("{}autoscaling: {{min: 1, max: 5, target_warm_ratio: 0.99}}\n", spec_yaml("ci", 1));
    let f = s.write("auto.yaml", &spec);
    s.ctl(&["pool", "create", "--file", &f]).await.ok();
    let o = s.ctl_as(CLIENT, &["pool", "expect", "ci", "--claims", "50", "--within", "1m"]).await.ok();
    assert!(o.stdout.contains("working towards 5 VMs"), "{o:#?}");
    let o = s.ctl(&["-o", "json", "pool", "expect", "ci", "--claims", "2", "--within", "30s"]).await;
    assert_eq!(o.json()["desired_size"], json!(5));
    let t = s.ctl(&["pool", "status", "ci"]).await.ok().table();
    assert_eq!(&t[1][..4], ["default/ci", "1", "5", "CEILING"], "{t:?}");
    assert_eq!(t[1][13], "52", "{t:?}");
    let o = s.ctl(&["pool", "expect", "ci", "--claims", "0"]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("claims must be between 1 and"), "{o:#?}");
    let o = s.ctl(&["pool", "expect", "ci", "--claims", "5", "--within", "2h"]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("within_seconds"), "{o:#?}");
    s.ctl(&["pool", "expect", "ghost", "--claims", "5"]).await.fails(3, "not_found");
}

/// Issue 24 item 4: `pool rollout status|history|pause|resume|undo` against a running
/// poolmgr-local: an update with a new image rolls the pool (status shows it until COMPLETE),
/// history lists both revisions, pause with nothing running is a conflict, and undo goes back
/// to revision 1 with a rollout to it.
#[tokio::test]
async fn pool_rollout_shows_steers_and_undoes_a_rollout() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    let rolling = |image: &str| {
        spec_yaml("ci", 2).replace("ghcr.io/liquidmetal-dev/ubuntu:22.04", image) + "rollout: {max_surge: 2}\n"
    };
    let f = s.write("rolling.yaml", &rolling("ghcr.io/x/runner:1"));
    s.ctl(&["pool", "create", "--file", &f]).await.ok();
    s.wait_available("ci", 2).await;
    let t = s.ctl(&["pool", "rollout", "status", "ci"]).await.ok().table();
    assert_eq!(t[0][..3], ["POOL", "REVISION", "STATE"], "{t:?}");
    assert_eq!(t[1][..3], ["default/ci", "1", "-"], "no rollout ever ran: {t:?}");
    let f2 = s.write("rolling-2.yaml", &rolling("ghcr.io/x/runner:2"));
    s.ctl(&["pool", "update", "--file", &f2]).await.ok();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let t = s.ctl(&["pool", "rollout", "status", "ci"]).await.ok().table();
        if t[1][2] == "COMPLETE" {
            assert_eq!(t[1][3..5], ["2", "2"], "{t:?}");
            assert_eq!(t[1][7], "2", "two idle VMs replaced: {t:?}");
            break;
        }
        assert!(Instant::now() < deadline, "never completed: {t:?}\n{}", s.server.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let h = s.ctl(&["pool", "rollout", "history", "ci"]).await.ok().table();
    assert_eq!(h.len(), 3, "{h:?}");
    assert_eq!((h[1][0].as_str(), h[1][2].as_str(), h[1][3].as_str()), ("2", "true", "ghcr.io/x/runner:2"), "{h:?}");
    assert_eq!((h[2][0].as_str(), h[2][3].as_str()), ("1", "ghcr.io/x/runner:1"), "{h:?}");
    let o = s.ctl(&["pool", "rollout", "pause", "ci"]).await;
    o.fails(4, "failed_precondition");
    assert!(o.stderr.contains("no rollout running"), "{o:#?}");
    let o = s.ctl(&["-o", "json", "pool", "rollout", "undo", "ci"]).await.ok();
    let p = o.json();
    assert_eq!(p["revision"], json!(1));
    assert_eq!(p["status"]["rollout"]["state"], json!("PROGRESSING"));
    s.ctl(&["pool", "rollout", "undo", "ci", "--to-revision", "0"]).await.fails(2, "invalid_argument");
    s.ctl(&["pool", "rollout", "history", "ghost"]).await.fails(3, "not_found");
}

#[tokio::test]
async fn manual_pages_come_from_the_command_tree() {
    let none = closed_endpoint();
    let top = ctl_offline(&none, &["man"]).await.ok();
    assert!(top.stdout.contains(".TH poolmgrctl 1"), "{top:#?}");
    assert!(top.stdout.contains("\\-\\-token\\-file") && top.stdout.contains("context"), "{top:#?}");
    let dir = std::env::temp_dir().join(format!("poolmgrctl-man-{}", uuid::Uuid::new_v4()));
    let o = ctl_offline(&none, &["man", "--dir", dir.to_str().unwrap()]).await.ok();
    assert!(o.stderr.starts_with("wrote ") && o.stderr.contains("manual pages"), "{o:#?}");
    let claim = std::fs::read_to_string(dir.join("poolmgrctl-lease-claim.1")).unwrap();
    assert!(
        claim.contains(".TH poolmgrctl\\-lease\\-claim 1") || claim.contains(".TH poolmgrctl-lease-claim 1"),
        "{claim}"
    );
    assert!(claim.contains("auto\\-request\\-id"), "{claim}");
    for page in ["poolmgrctl.1", "poolmgrctl-context-use.1", "poolmgrctl-pool-status.1", "poolmgrctl-man.1"] {
        assert!(dir.join(page).exists(), "{page} missing");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------
// Issue 26: lease run, private CAs
// ---------------------------------------------------------------------------------------

impl Stack {
    /// Creates pool default/`name` with these heartbeat settings through the API.
    async fn pool_with_heartbeats(&self, name: &str, size: i32, interval: i32, expiry: i32) {
        let mut spec = spec_json(name, size);
        spec["heartbeat_interval_seconds"] = json!(interval);
        spec["heartbeat_expiry_seconds"] = json!(expiry);
        let (status, body) = self.api(reqwest::Method::POST, "/v1/pools", Some(spec)).await;
        assert_eq!(status, 201, "{body}");
    }

    async fn lease_ids(&self) -> Vec<String> {
        let db = self.server.db.client().await;
        db.query("SELECT lease_id FROM leases", &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
    }

    /// Waits until no lease is left (the release is part of the CLI's exit, so this is quick).
    async fn no_lease_left(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.lease_ids().await.is_empty() {
            assert!(Instant::now() < deadline, "a lease was left behind: {:?}", self.lease_ids().await);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `KEY=VALUE` lines as a map.
fn env_file(path: &str) -> std::collections::BTreeMap<String, String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

fn signal(child: &Child, sig: &str) {
    let pid = child.id().expect("child still running");
    let s = std::process::Command::new("kill").args([sig, &pid.to_string()]).status().expect("run kill");
    assert!(s.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_exports_the_vm_and_passes_the_commands_exit_through_after_releasing() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 3).await;
    s.wait_available("ci", 3).await;
    let env_out = s.dir.join("env").to_string_lossy().into_owned();

    // A failing command: its code comes back, and the lease is gone by then.
    let script = format!("env | grep '^POOLMGR_' | grep -v -e TOKEN -e ENDPOINT > {env_out}; exit 3");
    let o = s.ctl(&["lease", "run", "--pool", "ci", "--", "sh", "-c", &script]).await;
    assert_eq!(o.code, 3, "{o:#?}");
    assert!(s.lease_ids().await.is_empty(), "released before exiting: {o:#?}");
    let env = env_file(&env_out);
    let lease_id = env["POOLMGR_LEASE_ID"].clone();
    assert!(
        o.stderr.contains(&format!("claimed lease {lease_id} (VM {} on host sim)", env["POOLMGR_VM_ID"])),
        "{o:#?}"
    );
    assert!(o.stderr.contains(&format!("released lease {lease_id}")), "{o:#?}");
    assert_eq!(env["POOLMGR_POOL"], "default/ci");
    assert_eq!(env["POOLMGR_HOST"], "sim");
    assert_eq!(env["POOLMGR_HOST_ADDRESS"], s.server.sim_server.addr.to_string());
    assert!(uuid::Uuid::parse_str(&env["POOLMGR_REQUEST_ID"]).is_ok(), "{env:?}");
    let claim: Value = serde_json::from_str(&env["POOLMGR_CLAIM_JSON"]).unwrap();
    assert_eq!(claim["lease"]["lease_id"], json!(lease_id));
    assert_eq!(claim["vm"]["uid"], json!(env["POOLMGR_VM_UID"]));
    // Every interface of the claim answer, in device id order (eth1 is the template's).
    let ifaces = claim["vm"]["network_interfaces"].as_object().unwrap();
    let mut devices: Vec<&String> = ifaces.keys().collect();
    devices.sort();
    assert!(devices.iter().any(|d| *d == "eth1"), "{claim}");
    let joined: Vec<&str> = devices.iter().map(|d| d.as_str()).collect();
    assert_eq!(env["POOLMGR_VM_INTERFACES"], joined.join(" "));
    for (n, d) in devices.iter().enumerate() {
        let i = &ifaces[d.as_str()];
        assert_eq!(env[&format!("POOLMGR_VM_IFACE_{n}_DEVICE")], **d);
        assert_eq!(json!(env[&format!("POOLMGR_VM_IFACE_{n}_MAC")]), i["mac_address"]);
        assert_eq!(json!(env[&format!("POOLMGR_VM_IFACE_{n}_HOST_DEVICE")]), i["host_device_name"]);
        assert_eq!(env[&format!("POOLMGR_VM_IFACE_{n}_INDEX")], i["index"].to_string());
    }
    assert_eq!(json!(env["POOLMGR_VM_MAC"]), ifaces[devices[0].as_str()]["mac_address"]);
    let (status, _) = s.api(reqwest::Method::GET, &format!("/v1/leases/{lease_id}"), None).await;
    assert_eq!(status, 404);

    // Success, with a request id of our own.
    let o = s
        .ctl(&[
            "lease",
            "run",
            "--pool",
            "ci",
            "--request-id",
            "job-1",
            "--",
            "sh",
            "-c",
            "test \"$POOLMGR_REQUEST_ID\" = job-1",
        ])
        .await;
    assert_eq!(o.code, 0, "{o:#?}");
    // A command that cannot be found: 127, released all the same.
    let o = s.ctl(&["lease", "run", "--pool", "ci", "--", "/nonexistent/poolmgr-cmd"]).await;
    assert_eq!(o.code, 127, "{o:#?}");
    assert!(o.stderr.contains("cannot run") && o.stderr.contains("released lease"), "{o:#?}");
    // Killed by a signal: 128 + 9, released.
    let o = s.ctl(&["lease", "run", "--pool", "ci", "--", "sh", "-c", "kill -KILL $$"]).await;
    assert_eq!(o.code, 137, "{o:#?}");
    assert!(o.stderr.contains("released lease"), "{o:#?}");
    assert!(s.lease_ids().await.is_empty());
    // No command: a usage error, nothing claimed.
    let o = s.ctl(&["lease", "run", "--pool", "ci"]).await;
    assert_eq!(o.code, 2, "{o:#?}");
}

/// A command that says it started, then waits; on SIGTERM it writes `marker` and exits 143.
fn trapping_script(marker: &str) -> String {
    format!("trap 'echo term > {marker}; exit 143' TERM; echo started; while :; do sleep 0.1; done")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_forwards_sigterm_to_the_command_and_releases_before_exiting_with_its_code() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 1).await;
    s.wait_available("ci", 1).await;
    let marker = s.dir.join("term").to_string_lossy().into_owned();
    let mut run = s.spawn_ctl(&["lease", "run", "--pool", "ci", "--", "sh", "-c", &trapping_script(&marker)]);
    read_until(&mut run, Duration::from_secs(60), |o| o.contains("started")).await;
    assert_eq!(s.lease_ids().await.len(), 1, "the command runs under a lease");
    signal(&run, "-TERM");
    let o = out(tokio::time::timeout(Duration::from_secs(60), run.wait_with_output()).await.unwrap().unwrap());
    assert_eq!(o.code, 143, "{o:#?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap_or_default(), "term\n", "the command got SIGTERM: {o:#?}");
    assert!(o.stderr.contains("SIGTERM; forwarding it") && o.stderr.contains("released lease"), "{o:#?}");
    assert!(s.lease_ids().await.is_empty(), "{o:#?}");

    // SIGINT too (not in a terminal here, so it is forwarded).
    s.wait_available("ci", 1).await;
    let _ = std::fs::remove_file(&marker);
    let script = format!("trap 'echo int > {marker}; exit 130' INT; echo started; while :; do sleep 0.1; done");
    let mut run = s.spawn_ctl(&["lease", "run", "--pool", "ci", "--", "sh", "-c", &script]);
    read_until(&mut run, Duration::from_secs(60), |o| o.contains("started")).await;
    sigint(&run);
    let o = out(tokio::time::timeout(Duration::from_secs(60), run.wait_with_output()).await.unwrap().unwrap());
    assert_eq!(o.code, 130, "{o:#?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap_or_default(), "int\n", "{o:#?}");
    s.no_lease_left().await;
}

/// A proxy to `upstream` that passes every request on and holds the answer of each claim
/// (`POST /v1/claims`) once the server has given it: it notifies `committed`, then waits for
/// `go` before answering. The claim committed, the CLI still waits for it.
async fn claim_holding_proxy(
    upstream: String,
    committed: std::sync::Arc<tokio::sync::Notify>,
    go: std::sync::Arc<tokio::sync::Notify>,
) -> String {
    use axum::body::{Body, to_bytes};
    use axum::http::Request;
    let http = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (http, upstream, committed, go) = (http.clone(), upstream.clone(), committed.clone(), go.clone());
        async move {
            let (parts, body) = req.into_parts();
            let body = to_bytes(body, 1 << 20).await.unwrap();
            let r = pass_on(&http, &format!("{upstream}{}", parts.uri), &parts, &body).await;
            if parts.method == reqwest::Method::POST && parts.uri.path() == "/v1/claims" {
                committed.notify_one();
                go.notified().await;
            }
            answer(r).await
        }
    });
    serve_proxy(app).await
}

/// A signal before the command started: the command never runs. Forced at the two moments a
/// claim can be in: refused and waiting for a VM (an empty pool, --wait), and committed on the
/// server with its answer not yet back (a proxy holds it). The first leaves no lease; the
/// second says under which request_id a lease may exist, and claiming it again as it says
/// replays that lease, which can then be released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_stopped_by_a_signal_while_claiming_never_starts_the_command() {
    use std::sync::Arc;
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("empty", 0).await;
    let marker = s.dir.join("ran").to_string_lossy().into_owned();
    let touch = format!("touch {marker}");
    let mut run = s.spawn_ctl(&[
        "lease",
        "run",
        "--pool",
        "empty",
        "--wait",
        "5m",
        "--request-id",
        "job-1",
        "--",
        "sh",
        "-c",
        &touch,
    ]);
    // Refused at least once: the run is waiting for a VM.
    let mut seen = String::new();
    {
        let mut lines = BufReader::new(run.stderr.as_mut().expect("piped stderr")).lines();
        while !seen.contains("claim: attempt 1:") {
            let l = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await;
            seen += &l.expect("a refused claim within 60 s").unwrap().expect("stderr open");
            seen.push('\n');
        }
    }
    signal(&run, "-TERM");
    let o = out(tokio::time::timeout(Duration::from_secs(60), run.wait_with_output()).await.unwrap().unwrap());
    assert_eq!(o.code, 143, "{seen}{o:#?}");
    assert!(o.stderr.contains("SIGTERM while claiming"), "{o:#?}");
    assert!(!Path::new(&marker).exists(), "the command never ran");
    assert!(s.lease_ids().await.is_empty());

    // A claim that committed while its answer was on the way.
    s.create_pool("ci", 1).await;
    s.wait_available("ci", 1).await;
    let (committed, go) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
    let proxy = claim_holding_proxy(s.endpoint.clone(), committed.clone(), go.clone()).await;
    let run =
        ctl_cmd(&proxy, ADMIN, &["lease", "run", "--pool", "ci", "--request-id", "job-2", "--", "sh", "-c", &touch])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    tokio::time::timeout(Duration::from_secs(60), committed.notified()).await.expect("the claim reached the server");
    let ids = s.lease_ids().await;
    assert_eq!(ids.len(), 1, "committed");
    signal(&run, "-TERM");
    let o = out(tokio::time::timeout(Duration::from_secs(60), run.wait_with_output()).await.unwrap().unwrap());
    go.notify_one();
    assert_eq!(o.code, 143, "{o:#?}");
    assert!(
        o.stderr.contains("SIGTERM while claiming") && o.stderr.contains("lease claim --request-id job-2"),
        "says how to find the lease: {o:#?}"
    );
    assert!(!Path::new(&marker).exists(), "the command never ran");
    // As it says: the same request_id replays the lease, which is then released.
    let again = s.ctl(&["lease", "claim", "--pool", "ci", "--request-id", "job-2", "-o", "json"]).await.ok().json();
    assert_eq!(again["lease"]["lease_id"], json!(ids[0]), "{again}");
    assert_eq!(again["replayed"], json!(true), "{again}");
    s.ctl(&["lease", "release", &ids[0]]).await.ok();
    s.no_lease_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_heartbeats_and_when_the_lease_is_lost_stops_the_command_and_exits_7() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    // Heartbeats every second keep a 3 s lease; the command outlives several windows.
    s.pool_with_heartbeats("ci", 1, 1, 3).await;
    s.wait_available("ci", 1).await;
    let marker = s.dir.join("term").to_string_lossy().into_owned();
    let mut run = s.spawn_ctl(&["lease", "run", "--pool", "ci", "--", "sh", "-c", &trapping_script(&marker)]);
    read_until(&mut run, Duration::from_secs(60), |o| o.contains("started")).await;
    let ids = s.lease_ids().await;
    assert_eq!(ids.len(), 1);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let lease = s.get(&format!("/v1/leases/{}", ids[0])).await;
    assert_ne!(lease["last_heartbeat_at"], lease["claimed_at"], "heartbeats kept it: {lease}");

    // Released elsewhere: the next heartbeat finds it gone.
    let (status, _) = s.api(reqwest::Method::DELETE, &format!("/v1/leases/{}", ids[0]), None).await;
    assert_eq!(status, 204);
    let o = out(tokio::time::timeout(Duration::from_secs(60), run.wait_with_output()).await.unwrap().unwrap());
    assert_eq!(o.code, 7, "{o:#?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap_or_default(), "term\n", "{o:#?}");
    assert!(o.stderr.contains(&format!("lease {} lost (not_found", ids[0])), "{o:#?}");
    assert!(o.stderr.contains("nothing to release"), "{o:#?}");
}

/// A proxy to `upstream` that passes every request on and, for the first `lose` lease
/// releases (`DELETE /v1/leases/…`), answers a bare 502 of its own once the server has
/// answered: the release committed, its answer never reached the CLI.
async fn release_answer_losing_proxy(upstream: String, lose: usize) -> String {
    use axum::body::{Body, to_bytes};
    use axum::http::{Request, Response};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let http = reqwest::Client::new();
    let left = std::sync::Arc::new(AtomicUsize::new(lose));
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (http, upstream, left) = (http.clone(), upstream.clone(), left.clone());
        async move {
            let (parts, body) = req.into_parts();
            let body = to_bytes(body, 1 << 20).await.unwrap();
            let url = format!("{upstream}{}", parts.uri);
            let r = pass_on(&http, &url, &parts, &body).await;
            let release = parts.method == reqwest::Method::DELETE && parts.uri.path().starts_with("/v1/leases/");
            if release && left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                assert_eq!(r.status(), 204, "the release committed upstream");
                return Response::builder().status(502).body(Body::from("bad gateway")).unwrap();
            }
            answer(r).await
        }
    });
    serve_proxy(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_release_whose_first_answer_is_lost_reports_released() {
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.create_pool("ci", 1).await;
    s.wait_available("ci", 1).await;
    let claim = s.ctl_as(CLIENT, &["lease", "claim", "--pool", "ci", "-o", "json"]).await.json();
    let id = claim["lease"]["lease_id"].as_str().unwrap().to_owned();
    let proxy = release_answer_losing_proxy(s.endpoint.clone(), 1).await;
    // The first DELETE released it (its answer was replaced by a 502); the retry finds it gone.
    let o = run(ctl_cmd(&proxy, CLIENT, &["lease", "release", &id])).await.ok();
    assert!(o.stdout.contains(&format!("lease {id} released")), "{o:#?}");
    assert!(s.lease_ids().await.is_empty());
    // Released already, with nothing lost on the way: NOT_FOUND.
    run(ctl_cmd(&proxy, CLIENT, &["lease", "release", &id])).await.fails(3, "not_found");
}

/// A proxy to `upstream` whose heartbeats follow `mode`: 0 pass, 1 every other one refused
/// (a 429, then a bare 500 of its own), 2 never answered. Counts the refused ones.
async fn heartbeat_proxy(
    upstream: String,
    mode: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> String {
    use axum::body::{Body, to_bytes};
    use axum::http::{Request, Response};
    use std::sync::atomic::Ordering;
    let http = reqwest::Client::new();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (http, upstream, mode, refused, seen) =
            (http.clone(), upstream.clone(), mode.clone(), refused.clone(), seen.clone());
        async move {
            let (parts, body) = req.into_parts();
            if parts.uri.path().ends_with("/heartbeat") {
                match (mode.load(Ordering::SeqCst), seen.fetch_add(1, Ordering::SeqCst) % 4) {
                    (1, 0) => {
                        refused.fetch_add(1, Ordering::SeqCst);
                        let body = r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","reason":"RESOURCE_EXHAUSTED","message":"slow down","request_id":"q"}}"#;
                        return Response::builder().status(429).body(Body::from(body)).unwrap();
                    }
                    (1, 2) => {
                        refused.fetch_add(1, Ordering::SeqCst);
                        return Response::builder().status(500).body(Body::from("proxy error")).unwrap();
                    }
                    (2, _) => std::future::pending::<()>().await,
                    _ => {}
                }
            }
            let body = to_bytes(body, 1 << 20).await.unwrap();
            let r = pass_on(&http, &format!("{upstream}{}", parts.uri), &parts, &body).await;
            answer(r).await
        }
    });
    serve_proxy(app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_reports_refused_heartbeats_and_kills_a_command_that_outlives_an_expired_lease() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let s = Stack::start().await;
    s.add_sim_host().await;
    s.pool_with_heartbeats("ci", 1, 1, 3).await;
    s.wait_available("ci", 1).await;
    let (mode, refused) = (Arc::new(AtomicUsize::new(1)), Arc::new(AtomicUsize::new(0)));
    let proxy = heartbeat_proxy(s.endpoint.clone(), mode.clone(), refused.clone()).await;
    // A command that ignores SIGTERM: only the SIGKILL after --kill-after stops it.
    let script = "trap '' TERM; echo started; while :; do sleep 0.1; done";
    let mut run =
        ctl_cmd(&proxy, ADMIN, &["lease", "run", "--pool", "ci", "--kill-after", "1s", "--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    read_until(&mut run, Duration::from_secs(60), |o| o.contains("started")).await;
    let ids = s.lease_ids().await;
    assert_eq!(ids.len(), 1);

    // Half the heartbeats refused (429, a proxy's 500) for more than two expiry windows: the
    // command keeps running under the lease.
    let until = Instant::now() + Duration::from_secs(40);
    while refused.load(Ordering::SeqCst) < 4 {
        assert!(Instant::now() < until, "too few heartbeats");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(run.try_wait().unwrap().is_none(), "lease run ended on a refused heartbeat");
    assert_eq!(s.lease_ids().await, ids);

    // Heartbeats never answered: the lease expires, the command is stopped, exit 7.
    mode.store(2, Ordering::SeqCst);
    let o = out(tokio::time::timeout(Duration::from_secs(60), run.wait_with_output()).await.unwrap().unwrap());
    assert_eq!(o.code, 7, "{o:#?}");
    assert!(o.stderr.contains(&format!("heartbeat of lease {} failed (resource_exhausted", ids[0])), "{o:#?}");
    assert!(o.stderr.contains("failed (internal: "), "{o:#?}");
    assert!(o.stderr.contains(&format!("lease {} lost (deadline_exceeded", ids[0])), "{o:#?}");
    assert!(o.stderr.contains("sending SIGKILL"), "{o:#?}");
    s.no_lease_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_endpoint_is_trusted_through_the_ca_flag_environment_context_or_system_store() {
    let s = Stack::start().await;
    let front = poolmgr_tests::https::HttpsFront::start(&s.endpoint).await;
    let ca = s.write("ca.pem", &front.ca_pem);
    let ep = front.endpoint.as_str();

    // Without the CA: unavailable (exit 6), and the message says why.
    let o = s.ctl_via(ep, &[], &["pool", "list"]).await;
    o.fails(6, "unavailable");
    assert!(o.stderr.to_lowercase().contains("certificate"), "{o:#?}");
    // The flag, the environment.
    s.ctl_via(ep, &[], &["--server-ca-file", &ca, "pool", "list"]).await.ok();
    s.ctl_via(ep, &[("POOLMGR_CA_FILE", ca.as_str())], &["pool", "list"]).await.ok();
    // The system's trust store (here: the file rustls-native-certs is pointed at).
    s.ctl_via(ep, &[("SSL_CERT_FILE", ca.as_str())], &["pool", "list"]).await.ok();
    // A context's ca_file.
    let home = s.dir.join("home");
    let token = s.write_mode("admin.token", ADMIN, 0o600);
    bare(&home, &[], &["--endpoint", ep, "--token-file", &token, "--server-ca-file", &ca, "context", "set", "tls"])
        .await
        .ok();
    let config = std::fs::read_to_string(home.join("poolmgr/config.yaml")).unwrap();
    assert!(config.contains("ca_file:") && config.contains("ca.pem"), "{config}");
    bare(&home, &[], &["pool", "list"]).await.ok();
    // A CA file that is no certificate: a usage error naming it.
    let junk = s.write("junk.pem", "junk");
    let o = s.ctl_via(ep, &[], &["--server-ca-file", &junk, "pool", "list"]).await;
    o.fails(2, "invalid_argument");
    assert!(o.stderr.contains("junk.pem"), "{o:#?}");
}

impl Stack {
    /// The CLI against `endpoint` with the admin token and extra environment variables.
    async fn ctl_via(&self, endpoint: &str, env: &[(&str, &str)], args: &[&str]) -> Out {
        let mut c = ctl_cmd(endpoint, ADMIN, args);
        for (k, v) in env {
            c.env(k, v);
        }
        run(c).await
    }
}
