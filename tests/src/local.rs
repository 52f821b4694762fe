//! A real `poolmgr-local` process for tests of what talks to it over the network
//! (`poolmgrctl`, `poolmgr-client`): a fresh test database, an in-process `flintlock-sim` on
//! port 0 (not registered: the test registers it through the client under test), and the
//! server binary on a free port, killed when the [`LocalServer`] drops.
//!
//! The binary is built into the test binary's own target directory and profile with
//! `cargo build -p poolmgr-local` on first use (a no-op when it is fresh).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use flintlock_sim::{Sim, SimConfig, SimServer};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::{ADMIN, CLIENT_A, TestDb};

/// Bytes of the server's log kept: all of a trace-level run of a test or two (one that scans
/// the log for secrets must see every line: [`LocalServer::full_log`]).
const KEPT_LOG_BYTES: usize = 32 * 1024 * 1024;

/// What the server wrote on standard error.
#[derive(Default)]
struct Log {
    text: String,
    /// Lines dropped because the log outgrew [`KEPT_LOG_BYTES`].
    dropped: u64,
}

/// `poolmgr-local`, built next to the running test binary (`target/<profile>/`).
pub fn server_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let mut profile_dir = exe.parent().expect("a directory").to_path_buf();
        if profile_dir.file_name().is_some_and(|n| n == "deps") {
            profile_dir.pop();
        }
        let bin = profile_dir.join(format!("poolmgr-local{}", std::env::consts::EXE_SUFFIX));
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(other) => other,
        }
        .to_owned();
        let target_dir = profile_dir.parent().expect("a target directory");
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        // Always asked: a no-op when the binary is fresh, a rebuild when the server changed.
        let status = std::process::Command::new(&cargo)
            .args(["build", "--quiet", "-p", "poolmgr-local", "--bin", "poolmgr-local", "--profile", &profile])
            .arg("--target-dir")
            .arg(target_dir)
            .current_dir(&root)
            .status();
        match status {
            Ok(s) if s.success() && bin.exists() => bin,
            other => panic!(
                "poolmgr-local is needed at {} and `{cargo} build -p poolmgr-local` failed ({other:?}); build it first \
                 (cargo build -p poolmgr-local) or run scripts/test.sh",
                bin.display()
            ),
        }
    })
}

pub struct LocalServer {
    // Fields drop in order: the server goes before its database.
    pub server: Child,
    log: Arc<Mutex<Log>>,
    pub db: TestDb,
    pub sim_server: SimServer,
    pub sim: Sim,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.server.start_kill();
    }
}

impl LocalServer {
    /// Tokens [`ADMIN`] (principal `admin`) and [`CLIENT_A`] (principal `client-a`), a reconcile
    /// pass every second, fast flintlock backoff.
    pub async fn start() -> LocalServer {
        Self::start_with(&[]).await
    }

    /// As [`LocalServer::start`], with extra environment variables for the server.
    pub async fn start_with(env: &[(&str, &str)]) -> LocalServer {
        let bin = server_bin();
        let db = TestDb::create().await;
        let sim = Sim::new(SimConfig {
            boot_delay: Duration::from_millis(50),
            delete_delay: Duration::from_millis(20),
            basic_auth_token: None,
        });
        let sim_server = sim.serve("127.0.0.1:0".parse().unwrap()).await.expect("start flintlock-sim");
        let mut cmd = Command::new(bin);
        for (k, _) in std::env::vars() {
            if k.starts_with("POOLMGR_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("DATABASE_URL", &db.url)
            .env("POOLMGR_HTTP_ADDR", "127.0.0.1:0")
            .env("POOLMGR_ADMIN_TOKENS", format!("admin:{ADMIN}"))
            .env("POOLMGR_CLIENT_TOKENS", format!("client-a:{CLIENT_A}"))
            .env("POOLMGR_CREDENTIALS_KEY", crate::CREDENTIALS_KEY)
            .env("POOLMGR_RECONCILE_INTERVAL_SECONDS", "1")
            .env("POOLMGR_RECONCILE_BACKOFF_MS", "50")
            .env("POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS", "1")
            .env("POOLMGR_FLINTLOCK_TIMEOUT_SECONDS", "3")
            .env("RUST_LOG", "warn");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut server = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn poolmgr-local");
        let log = Arc::new(Mutex::new(Log::default()));
        {
            let log = log.clone();
            let mut err = BufReader::new(server.stderr.take().unwrap()).lines();
            tokio::spawn(async move {
                while let Ok(Some(l)) = err.next_line().await {
                    let mut log = log.lock().unwrap();
                    if log.text.len() + l.len() < KEPT_LOG_BYTES {
                        log.text.push_str(&l);
                        log.text.push('\n');
                    } else {
                        log.dropped += 1;
                    }
                }
            });
        }
        // The server prints its address once it listens (after migrating the database).
        let mut stdout = BufReader::new(server.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match stdout.next_line().await {
                    Ok(Some(l)) if l.contains("listening on ") => return Some(l),
                    Ok(Some(_)) => continue,
                    _ => return None,
                }
            }
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("poolmgr-local did not start; its log:\n{}", log.lock().unwrap().text));
        tokio::spawn(async move { while let Ok(Some(_)) = stdout.next_line().await {} });
        let endpoint = line.rsplit("listening on ").next().unwrap().trim().to_owned();
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match http.get(format!("{endpoint}/healthz")).send().await {
                Ok(r) if r.status().is_success() => break,
                other if Instant::now() > deadline => panic!("/healthz never answered 200: {other:?}"),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        LocalServer { server, log, db, sim_server, sim, endpoint }
    }

    /// What the server wrote on standard error so far (JSON log lines), up to 32 MiB.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().text.clone()
    }

    /// Every line the server wrote on standard error so far, or `None` if some were
    /// dropped (more than 32 MiB).
    pub fn full_log(&self) -> Option<String> {
        let log = self.log.lock().unwrap();
        (log.dropped == 0).then(|| log.text.clone())
    }
}
