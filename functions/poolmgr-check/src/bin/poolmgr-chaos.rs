//! `poolmgr-chaos`: the load behind `scripts/chaos.sh`. It never injects a fault itself (the
//! script stops PostgreSQL, kills processes); it drives clients through them and says whether
//! what every client believes matches the database.
//!
//! - `claims`: concurrent clients claim with `request_id`s through the HTTP API, retrying the
//!   *same* id on 503, connection errors and timeouts until they get a lease; each replays a
//!   claim it saw succeed (the lease id must match), keeps its newest `--keep` leases and
//!   releases older ones (retrying too). At the end the database's leases of the principal
//!   must be exactly the ones the clients hold.
//! - `passes`: pools filled by rounds of N overlapping in-process reconcile passes (each with
//!   its own database pool and flintlock channels, like N Lambda instances), grown half-way;
//!   after every round no pool may be above its size and the always-invariants must hold.
//!
//! Prints progress on stderr and one `key=value` summary line on stdout; exit 0 when every
//! expectation held, 1 otherwise.

use std::collections::{HashMap, HashSet, VecDeque};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use clap::{Parser, Subcommand};
use poolmgr_check::{Class, Options};
use poolmgr_core::domain::{PoolRef, PoolSpec};
use poolmgr_core::{AppState, Config, db, reconcile, service};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(about = "Client load and overlapping reconcile passes for scripts/chaos.sh")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Concurrent claimers with request_ids that retry through failures.
    Claims(ClaimsArgs),
    /// Rounds of overlapping in-process reconcile passes until the pools are full.
    Passes(PassesArgs),
    /// A fault campaign's client load: records what every client was told (a history, as
    /// JSON lines) and checks it (`poolmgr_check::history`).
    Load(LoadArgs),
    /// Checks a recorded history again.
    CheckHistory(CheckArgs),
}

#[derive(clap::Args)]
struct LoadArgs {
    /// poolmgr-local base URLs, comma-separated; each retry goes to the next.
    #[arg(long, value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    #[arg(long, env = "POOLMGR_TOKEN")]
    token: String,
    /// Pools as NAMESPACE/NAME, comma-separated; client i claims from pool i mod n.
    #[arg(long, value_delimiter = ',', required = true)]
    pools: Vec<String>,
    #[arg(long, default_value_t = 6)]
    clients: usize,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20s")]
    duration: Duration,
    /// Created by the campaign once its faults are healed.
    #[arg(long)]
    heal_file: Option<std::path::PathBuf>,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "90s")]
    give_up: Duration,
    #[arg(long, value_parser = humantime::parse_duration, default_value = "8s")]
    request_timeout: Duration,
    #[arg(long, default_value_t = 2)]
    heartbeats: usize,
    /// Where the history goes (JSON lines).
    #[arg(long)]
    history: std::path::PathBuf,
    /// The pools' heartbeat expiry (seconds), for the lost-lease check.
    #[arg(long, default_value_t = 30.0)]
    lease_expiry: f64,
}

#[derive(clap::Args)]
struct CheckArgs {
    history: std::path::PathBuf,
    #[arg(long, default_value_t = 30.0)]
    lease_expiry: f64,
}

/// Checks `history`, printing each anomaly on stderr and one summary line on stdout:
/// `ops={…} anomalies=K`. `true`: none.
fn report_history(history: &[poolmgr_check::history::Op], lease_expiry: f64) -> bool {
    use poolmgr_check::history::{Rules, Tally, check};
    let anomalies = check(history, Rules { lease_expiry_seconds: lease_expiry, slack_seconds: 3.0 });
    for a in &anomalies {
        eprintln!("poolmgr-chaos: ANOMALY {}: {}", a.kind, a.detail);
    }
    let tally = Tally::of(history);
    println!("ops={} anomalies={}", serde_json::to_string(&tally.by_kind).unwrap_or_default(), anomalies.len());
    anomalies.is_empty()
}

async fn load(a: LoadArgs) -> anyhow::Result<bool> {
    let pools = a
        .pools
        .iter()
        .map(|p| p.split_once('/').map(|(n, m)| (n.to_owned(), m.to_owned())).context("--pools are NAMESPACE/NAME"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let opts = poolmgr_check::campaign::LoadOptions {
        endpoints: a.endpoints.iter().map(|e| e.trim_end_matches('/').to_owned()).collect(),
        token: a.token,
        pools,
        clients: a.clients,
        duration: a.duration,
        heal_file: a.heal_file,
        give_up: a.give_up,
        request_timeout: a.request_timeout,
        heartbeats: a.heartbeats,
    };
    eprintln!(
        "poolmgr-chaos: load: {} clients over {} endpoints for {:?}",
        opts.clients,
        opts.endpoints.len(),
        opts.duration
    );
    let history = poolmgr_check::campaign::run_load(opts).await?;
    let text: String = history.iter().map(|o| serde_json::to_string(o).unwrap_or_default() + "\n").collect();
    std::fs::write(&a.history, text).with_context(|| format!("writing {}", a.history.display()))?;
    Ok(report_history(&history, a.lease_expiry))
}

fn check_history(a: CheckArgs) -> anyhow::Result<bool> {
    let text = std::fs::read_to_string(&a.history).with_context(|| format!("reading {}", a.history.display()))?;
    let history = poolmgr_check::history::parse(&text).map_err(|e| anyhow!(e))?;
    Ok(report_history(&history, a.lease_expiry))
}

#[derive(clap::Args)]
struct ClaimsArgs {
    #[arg(long, env = "POOLMGR_ENDPOINT")]
    endpoint: String,
    /// A client token; its principal owns the leases.
    #[arg(long, env = "POOLMGR_TOKEN")]
    token: String,
    /// The token's principal (the name in `name:token`), to find its leases in the database.
    #[arg(long)]
    principal: String,
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    #[arg(long, default_value = "default/chaos")]
    pool: String,
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Leases each client keeps at the end (older ones are released as it goes).
    #[arg(long, default_value_t = 1)]
    keep: usize,
    /// Clients start new claims for this long, then finish what they are doing.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "15s")]
    duration: Duration,
    /// ... and, when given, until this file exists: the script creates it once its fault is
    /// over, so the fault always meets the load however slow the machine (at most 10 minutes
    /// past `--duration`).
    #[arg(long)]
    until_file: Option<std::path::PathBuf>,
    /// A client retrying one operation longer than this gives up (a failure).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "90s")]
    give_up: Duration,
    /// Fail unless some answers were 503 (the fault really hit the load).
    #[arg(long)]
    expect_503: bool,
    /// Fail unless some requests failed to connect or lost their answer.
    #[arg(long)]
    expect_conn_errors: bool,
    /// Prefix of the request_ids (unique per run): the comparison with the database looks at
    /// this run's leases only.
    #[arg(long, default_value = "chaos")]
    id_prefix: String,
    /// Each client waits this long after a claim (and its replay and release) before the
    /// next: the default keeps the pool busy, a longer one is a light load beside a fault
    /// that must find the pool mostly warm (scenario 6, rollout-kills).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "20ms")]
    pause: Duration,
}

#[derive(clap::Args)]
struct PassesArgs {
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// The registered flintlock host the pools use.
    #[arg(long, default_value = "sim")]
    host: String,
    /// Overlapping passes per round.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    #[arg(long, default_value_t = 4)]
    pools: usize,
    #[arg(long, default_value_t = 5)]
    size: i32,
    /// After `--grow-after` rounds every pool grows to this size.
    #[arg(long, default_value_t = 9)]
    grow_to: i32,
    #[arg(long, default_value_t = 2)]
    grow_after: usize,
    #[arg(long, default_value_t = 80)]
    max_rounds: usize,
    #[arg(long, default_value = "overlap")]
    pool_prefix: String,
}

/// Counters shared by the clients.
#[derive(Default)]
struct Stats {
    claims_ok: AtomicU64,
    fresh: AtomicU64,
    replayed_after_error: AtomicU64,
    replay_checks: AtomicU64,
    http_503: AtomicU64,
    http_503_without_retry_after: AtomicU64,
    conn_errors: AtomicU64,
    exhausted: AtomicU64,
    /// 409 ABORTED: the claim raced one that won its request_id (say, one whose process was
    /// killed during its pre-lease hook); the contract says retrying is correct.
    aborted: AtomicU64,
    retries: AtomicU64,
    releases: AtomicU64,
    unexpected: std::sync::Mutex<Vec<String>>,
}

impl Stats {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
    fn unexpected(&self, what: String) {
        eprintln!("poolmgr-chaos: UNEXPECTED {what}");
        self.unexpected.lock().expect("stats").push(what);
    }
}

enum Attempt {
    Ok(Value, bool),
    /// Retry the same request.
    Retry,
}

struct Claimer {
    http: reqwest::Client,
    endpoint: String,
    token: String,
    pool: PoolRef,
    stats: Arc<Stats>,
    give_up: Duration,
}

impl Claimer {
    /// Sends one request and classifies the answer; 503 / connection errors / 429 → retry.
    async fn attempt(&self, req: reqwest::RequestBuilder, what: &str) -> Attempt {
        let resp = match req.bearer_auth(&self.token).timeout(Duration::from_secs(20)).send().await {
            Ok(r) => r,
            Err(e) => {
                Stats::bump(&self.stats.conn_errors);
                tracing_err(what, &e.to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
                return Attempt::Retry;
            }
        };
        let status = resp.status().as_u16();
        let retry_after =
            resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
        let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
        let body: Value = match resp.bytes().await {
            Ok(b) if b.is_empty() => Value::Null,
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|_| json!(String::from_utf8_lossy(&b))),
            Err(e) => {
                // The answer was lost half-way: the request may or may not have happened.
                Stats::bump(&self.stats.conn_errors);
                tracing_err(what, &e.to_string());
                return Attempt::Retry;
            }
        };
        match status {
            200 | 204 => Attempt::Ok(body, replayed),
            503 => {
                Stats::bump(&self.stats.http_503);
                if retry_after.is_none() {
                    Stats::bump(&self.stats.http_503_without_retry_after);
                }
                let wait = retry_after.unwrap_or(1).min(1);
                tokio::time::sleep(Duration::from_millis(200).max(Duration::from_secs(wait) / 4)).await;
                Attempt::Retry
            }
            429 => {
                Stats::bump(&self.stats.exhausted);
                tokio::time::sleep(Duration::from_millis(150)).await;
                Attempt::Retry
            }
            409 if body["error"]["status"] == "ABORTED" => {
                Stats::bump(&self.stats.aborted);
                tokio::time::sleep(Duration::from_secs(retry_after.unwrap_or(1).min(2)) / 2).await;
                Attempt::Retry
            }
            _ => {
                self.stats.unexpected(format!("{what}: HTTP {status}: {body}"));
                tokio::time::sleep(Duration::from_millis(200)).await;
                Attempt::Retry
            }
        }
    }

    /// Claims with `request_id` until a lease comes back; returns (lease_id, attempts).
    /// `replay`: the id's claim was already answered, so every answer must be a replay.
    async fn claim(&self, request_id: &str, replay: bool) -> anyhow::Result<(String, u32)> {
        let t0 = Instant::now();
        let url = format!("{}/v1/claims", self.endpoint);
        let body =
            json!({"pool": {"namespace": self.pool.namespace, "name": self.pool.name}, "request_id": request_id});
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            if attempts > 1 {
                Stats::bump(&self.stats.retries);
            }
            match self.attempt(self.http.post(&url).json(&body), &format!("claim {request_id}")).await {
                Attempt::Ok(v, replayed) => {
                    let lease = v["lease"]["lease_id"]
                        .as_str()
                        .ok_or_else(|| anyhow!("claim answered without a lease: {v}"))?;
                    if v["lease"]["request_id"] != json!(request_id) {
                        self.stats.unexpected(format!(
                            "claim {request_id}: the lease carries request_id {}",
                            v["lease"]["request_id"]
                        ));
                    }
                    Stats::bump(&self.stats.claims_ok);
                    match (replay, replayed) {
                        (true, true) => {}
                        (true, false) => self.stats.unexpected(format!(
                            "claim {request_id}: a replay of an answered claim was not answered as a replay"
                        )),
                        // A retry whose earlier attempt committed: the answer lost, the lease not.
                        (false, true) if attempts > 1 => Stats::bump(&self.stats.replayed_after_error),
                        (false, true) => self.stats.unexpected(format!(
                            "claim {request_id}: the first attempt of a fresh id answered replayed"
                        )),
                        (false, false) => Stats::bump(&self.stats.fresh),
                    }
                    return Ok((lease.to_string(), attempts));
                }
                Attempt::Retry if t0.elapsed() > self.give_up => {
                    return Err(anyhow!("claim {request_id} still failing after {:?}; gave up", self.give_up));
                }
                Attempt::Retry => {}
            }
        }
    }

    /// Releases `lease` until the API confirms it (204, or 404 once an earlier attempt may
    /// have done it).
    async fn release(&self, lease: &str) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let url = format!("{}/v1/leases/{lease}", self.endpoint);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            if attempts > 1 {
                Stats::bump(&self.stats.retries);
            }
            let resp = self.http.delete(&url).bearer_auth(&self.token).timeout(Duration::from_secs(20)).send().await;
            match resp.map(|r| r.status().as_u16()) {
                Ok(204) => {
                    Stats::bump(&self.stats.releases);
                    return Ok(());
                }
                Ok(404) if attempts > 1 => {
                    Stats::bump(&self.stats.releases);
                    return Ok(());
                }
                Ok(503) => Stats::bump(&self.stats.http_503),
                Ok(s) => self.stats.unexpected(format!("release {lease}: HTTP {s}")),
                Err(e) => {
                    Stats::bump(&self.stats.conn_errors);
                    tracing_err(&format!("release {lease}"), &e.to_string());
                }
            }
            if t0.elapsed() > self.give_up {
                return Err(anyhow!("release {lease} still failing after {:?}; gave up", self.give_up));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn tracing_err(what: &str, e: &str) {
    tracing::debug!(what, error = e, "request failed; retrying with the same request");
}

/// What one client ends up believing.
struct ClientEnd {
    held: Vec<(String, String)>,
    gave_up: Option<String>,
}

/// Whether the load should keep starting claims: for `duration`, then until `until_file`
/// exists (bounded).
fn keep_going(t0: Instant, duration: Duration, until_file: Option<&std::path::Path>) -> bool {
    let elapsed = t0.elapsed();
    elapsed < duration || until_file.is_some_and(|f| !f.exists() && elapsed < duration + Duration::from_secs(600))
}

async fn run_client(
    c: Arc<Claimer>,
    idx: usize,
    keep: usize,
    duration: Duration,
    until_file: Option<std::path::PathBuf>,
    prefix: String,
    pause: Duration,
) -> ClientEnd {
    let t0 = Instant::now();
    let mut held: VecDeque<(String, String)> = VecDeque::new();
    let mut k = 0usize;
    while keep_going(t0, duration, until_file.as_deref()) || held.len() < keep {
        let rid = format!("{prefix}-c{idx}-{k}");
        k += 1;
        let lease = match c.claim(&rid, false).await {
            Ok((lease, _)) => lease,
            Err(e) => return ClientEnd { held: held.into(), gave_up: Some(e.to_string()) },
        };
        // The answer was seen: a replay must return the very same lease.
        match c.claim(&rid, true).await {
            Ok((again, _)) => {
                Stats::bump(&c.stats.replay_checks);
                if again != lease {
                    c.stats.unexpected(format!("replay of {rid} returned lease {again}, the first answer was {lease}"));
                }
            }
            Err(e) => return ClientEnd { held: held.into(), gave_up: Some(e.to_string()) },
        }
        held.push_back((lease, rid));
        while held.len() > keep {
            let (old, _) = held.pop_front().expect("non-empty");
            if let Err(e) = c.release(&old).await {
                // Still ours as far as the database knows: count it as held for the comparison.
                held.push_front((old, String::new()));
                return ClientEnd { held: held.into(), gave_up: Some(e.to_string()) };
            }
        }
        tokio::time::sleep(pause).await;
    }
    ClientEnd { held: held.into(), gave_up: None }
}

async fn claims(a: ClaimsArgs) -> anyhow::Result<bool> {
    let (ns, name) = a.pool.split_once('/').context("--pool is NAMESPACE/NAME")?;
    let stats = Arc::new(Stats::default());
    let claimer = Arc::new(Claimer {
        http: reqwest::Client::builder().pool_max_idle_per_host(a.clients).build()?,
        endpoint: a.endpoint.trim_end_matches('/').to_string(),
        token: a.token.clone(),
        pool: PoolRef { namespace: ns.into(), name: name.into() },
        stats: stats.clone(),
        give_up: a.give_up,
    });
    eprintln!(
        "==> poolmgr-chaos claims: {} clients on {} for {:?}, keeping {} lease(s) each",
        a.clients, a.pool, a.duration, a.keep
    );
    let t0 = Instant::now();
    let progress = {
        let stats = stats.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                eprintln!(
                    "    {:>4.0}s claims_ok={} 503s={} conn_errors={} retries={} releases={}",
                    t0.elapsed().as_secs_f64(),
                    Stats::get(&stats.claims_ok),
                    Stats::get(&stats.http_503),
                    Stats::get(&stats.conn_errors),
                    Stats::get(&stats.retries),
                    Stats::get(&stats.releases)
                );
            }
        })
    };
    let ends = futures::future::join_all((0..a.clients).map(|i| {
        tokio::spawn(run_client(
            claimer.clone(),
            i,
            a.keep,
            a.duration,
            a.until_file.clone(),
            a.id_prefix.clone(),
            a.pause,
        ))
    }))
    .await;
    progress.abort();

    let mut failures: Vec<String> = vec![];
    let mut believed: HashMap<String, (usize, String)> = HashMap::new();
    for (i, end) in ends.into_iter().enumerate() {
        let end = end.context("client task panicked")?;
        if let Some(e) = end.gave_up {
            failures.push(format!("client {i} gave up: {e}"));
        } else if end.held.len() != a.keep {
            failures.push(format!("client {i} holds {} leases, expected {}", end.held.len(), a.keep));
        }
        for (lease, rid) in end.held {
            if believed.insert(lease.clone(), (i, rid)).is_some() {
                failures.push(format!("lease {lease} is held by two clients"));
            }
        }
    }

    // What the database says this principal holds on this pool.
    let db = db::connect_one(&a.database_url, &db::DbTls::from_env().map_err(anyhow::Error::msg)?)
        .await
        .context("connecting to the database to compare leases")?;
    let rows = db
        .query(
            "SELECT l.lease_id, coalesce(l.request_id, ''), coalesce(v.phase, 'NO ROW') FROM leases l
             LEFT JOIN vms v ON v.id = l.vm_id
             WHERE l.principal = $1 AND l.pool_namespace = $2 AND l.pool_name = $3
               AND starts_with(l.request_id, $4)",
            &[&a.principal, &ns, &name, &format!("{}-", a.id_prefix)],
        )
        .await?;
    let mut in_db: HashSet<String> = HashSet::new();
    for r in &rows {
        let (lease, rid, phase): (String, String, String) = (r.get(0), r.get(1), r.get(2));
        match believed.get(&lease) {
            None => failures.push(format!(
                "lease {lease} (request_id {rid}) exists in the database but no client holds it: a duplicate or a release that did not happen"
            )),
            Some((i, want)) if !want.is_empty() && *want != rid => {
                failures.push(format!("lease {lease} of client {i} has request_id {rid} in the database, the client used {want}"))
            }
            Some(_) if phase != "LEASED" => failures.push(format!("lease {lease} is held but its VM is {phase}")),
            Some(_) => {}
        }
        in_db.insert(lease);
    }
    for (lease, (i, rid)) in &believed {
        if !in_db.contains(lease) {
            failures.push(format!(
                "client {i} holds lease {lease} (request_id {rid}) but the database has no such lease: lost"
            ));
        }
    }
    let unexpected = stats.unexpected.lock().expect("stats").clone();
    failures.extend(unexpected.iter().map(|u| format!("unexpected answer: {u}")));
    if a.expect_503 && Stats::get(&stats.http_503) == 0 {
        failures.push("no 503 was seen: the outage did not hit the load (did the fault happen during it?)".into());
    }
    if a.expect_503 && Stats::get(&stats.http_503_without_retry_after) > 0 {
        failures
            .push(format!("{} answers were 503 without Retry-After", Stats::get(&stats.http_503_without_retry_after)));
    }
    if a.expect_conn_errors && Stats::get(&stats.conn_errors) == 0 {
        failures.push("no connection error was seen: the kill did not hit the load".into());
    }
    for f in &failures {
        eprintln!("poolmgr-chaos: FAIL {f}");
    }
    println!(
        "claims_ok={} fresh={} replayed_after_error={} replay_checks={} 503s={} conn_errors={} exhausted_429={} aborted_409={} retries={} releases={} leases_held={} leases_in_db={} unexpected={} failures={} secs={:.1}",
        Stats::get(&stats.claims_ok),
        Stats::get(&stats.fresh),
        Stats::get(&stats.replayed_after_error),
        Stats::get(&stats.replay_checks),
        Stats::get(&stats.http_503),
        Stats::get(&stats.conn_errors),
        Stats::get(&stats.exhausted),
        Stats::get(&stats.aborted),
        Stats::get(&stats.retries),
        Stats::get(&stats.releases),
        believed.len(),
        rows.len(),
        unexpected.len(),
        failures.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(failures.is_empty())
}

fn pass_config(database_url: &str) -> anyhow::Result<Config> {
    let url = database_url.to_string();
    Ok(Config::from_lookup(move |k| match k {
        "DATABASE_URL" => Some(url.clone()),
        "POOLMGR_ADMIN_TOKENS" => Some("chaos:unused-by-passes".into()),
        "POOLMGR_DB_POOL_SIZE" => Some("4".into()),
        "POOLMGR_ORPHAN_SCAN_SECONDS" => Some("0".into()),
        "POOLMGR_RECONCILE_BACKOFF_MS" => Some("50".into()),
        "POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS" => Some("1".into()),
        k => std::env::var(k).ok(),
    })?)
}

async fn passes(a: PassesArgs) -> anyhow::Result<bool> {
    let cfg = pass_config(&a.database_url)?;
    // One state per "instance": its own connections and flintlock channels.
    let states: Vec<AppState> = (0..a.concurrency)
        .map(|_| Ok(AppState::new(&cfg, db::pool_from_config(&cfg)?)))
        .collect::<anyhow::Result<_>>()?;
    let admin = &states[0];
    let spec = |i: usize, size: i32| -> anyhow::Result<PoolSpec> {
        Ok(serde_json::from_value(json!({
            "name": format!("{}-{i}", a.pool_prefix), "size": size, "flintlock_hosts": [a.host],
            "replenishment": {"strategy": "REPLACE_ON_DELETE"},
            "microvm_template": {
                "root_volume": {"id": "root", "source": {"container_source": "ghcr.io/liquidmetal-dev/ubuntu:22.04"}},
                "interfaces": [{"device_id": "eth1", "type": "TAP"}]
            }
        }))?)
    };
    for i in 0..a.pools {
        service::pool::create(admin, spec(i, a.size)?, "chaos")
            .await
            .map_err(|e| anyhow!("creating pool {}-{i}: {e} (is host {} registered?)", a.pool_prefix, a.host))?;
    }
    eprintln!(
        "==> poolmgr-chaos passes: {} pools of {} (growing to {} after round {}), {} overlapping passes per round",
        a.pools, a.size, a.grow_to, a.grow_after, a.concurrency
    );
    let check_opts = Options {
        database_url: a.database_url.clone(),
        db_tls: cfg.db_tls.clone(),
        flintlock_overrides: vec![],
        namespace_prefix: cfg.flintlock_namespace_prefix.clone(),
        deployment_id: cfg.deployment_id.clone(),
        flintlock_timeout: Duration::from_secs(5),
        credentials: Default::default(),
    };
    let t0 = Instant::now();
    let mut failures: Vec<String> = vec![];
    let (mut created, mut adopted, mut orphans, mut errors, mut max_over) = (0usize, 0usize, 0usize, 0usize, 0i64);
    let mut size = a.size;
    let mut rounds = 0;
    let mut full = false;
    let prefix = format!("{}-%", a.pool_prefix);
    for round in 1..=a.max_rounds {
        rounds = round;
        if round == a.grow_after + 1 && a.grow_to != a.size {
            size = a.grow_to;
            for i in 0..a.pools {
                let p = PoolRef { namespace: "default".into(), name: format!("{}-{i}", a.pool_prefix) };
                service::pool::update(admin, &p, spec(i, size)?, "poolmgr-chaos")
                    .await
                    .map_err(|e| anyhow!("growing {p}: {e}"))?;
            }
            eprintln!("    round {round}: pools grown to {size}");
        }
        let reports = futures::future::join_all(states.iter().map(reconcile::run_pass)).await;
        for r in reports {
            match r {
                Ok(r) => {
                    created += r.created;
                    adopted += r.adopted;
                    orphans += r.orphans_deleted;
                    errors += r.errors.len();
                    for e in &r.errors {
                        eprintln!("    pass error (retried by a later pass): {e}");
                    }
                }
                Err(e) => failures.push(format!("a pass failed to run: {e}")),
            }
        }
        // Never above size: every live VM of a pool counted, after every round.
        let conn = admin.db.raw().get().await?;
        let rows = conn
            .query(
                "SELECT p.name, p.size,
                        count(v.id) FILTER (WHERE v.phase NOT IN ('DELETING', 'FAILED', 'QUARANTINED')),
                        count(v.id) FILTER (WHERE v.phase = 'AVAILABLE')
                 FROM pools p LEFT JOIN vms v ON v.pool_namespace = p.namespace AND v.pool_name = p.name
                 WHERE p.name LIKE $1 GROUP BY p.name, p.size ORDER BY p.name",
                &[&prefix],
            )
            .await?;
        drop(conn);
        let mut available_total = 0;
        for r in &rows {
            let (name, psize, live, available): (String, i32, i64, i64) = (r.get(0), r.get(1), r.get(2), r.get(3));
            let over = live - i64::from(psize);
            if over > 0 {
                failures.push(format!("round {round}: pool default/{name} has {live} live VMs, size {psize}"));
            }
            max_over = max_over.max(over);
            available_total += available;
        }
        let outcome = poolmgr_check::check_once(&check_opts).await.map_err(|e| anyhow!("{e}"))?;
        for f in outcome.findings.iter().filter(|f| f.class == Class::Always) {
            failures.push(format!("round {round}: {f}"));
        }
        let target = a.pools as i64 * i64::from(size);
        eprintln!(
            "    round {round}: available {available_total}/{target}, created so far {created}, pass errors {errors}"
        );
        if size == a.grow_to && available_total == target && round > a.grow_after {
            full = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    if !full {
        failures.push(format!("pools not full after {} rounds", a.max_rounds));
    }
    for f in &failures {
        eprintln!("poolmgr-chaos: FAIL {f}");
    }
    println!(
        "rounds={rounds} passes={} created={created} adopted={adopted} orphans_deleted={orphans} pass_errors={errors} max_over_size={max_over} failures={} secs={:.1}",
        rounds * a.concurrency,
        failures.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(failures.is_empty())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .init();
    let result = match Cli::parse().cmd {
        Cmd::Claims(a) => claims(a).await,
        Cmd::Passes(a) => passes(a).await,
        Cmd::Load(a) => load(a).await,
        Cmd::CheckHistory(a) => check_history(a),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("poolmgr-chaos: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
