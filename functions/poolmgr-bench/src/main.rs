//! `poolmgr-bench`: the measurements behind `docs/benchmarks.md`, driven by `scripts/bench-*.sh`.
//!
//! - `claims-load`, `pgbench-script`, `pgbench-summary`, `claims-seed`, `claims-verify`,
//!   `claims-report`: claims at a given concurrency for a fixed duration through the HTTP stack
//!   and through pgbench running the same statement; driven by `scripts/bench-claims.sh`.
//! - `claim-latency`: sequential claims through the HTTP stack, one client, latency percentiles.
//! - `reconcile`, `reconcile-report`: pools × VMs against in-process flintlock-sims; time of
//!   the passes that fill them, of a settled pass and of a pass with 1 % of the pools needing
//!   work, and the growth series' table and chart; driven by `scripts/bench-reconcile.sh`.
//! - `demand`, `demand-report`: claim traces replayed in scaled time against running stacks,
//!   pool policies side by side (static, autoscaled, with hints), local and deployed; driven by
//!   `scripts/bench-demand.sh` ([`demand`]); its `rollout` trace (issue 24) writes its own rows,
//!   `demand-rollout-report` their section.
//!
//! Measurements only: nothing here asserts a time.

mod demand;
mod growth;
mod load;
mod report;
mod rollout;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use poolmgr_core::{reconcile, service};
use serde_json::json;

#[derive(Parser)]
#[command(about = "poolmgr benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// CONCURRENCY clients claiming (or replaying, or claiming and releasing) through running
    /// poolmgrs for DURATION seconds after a warm-up; appends one JSON line to --out. Exits 1
    /// if a VM was handed out twice or a replay answered another lease.
    ClaimsLoad {
        /// Client i talks to the (i mod N)th endpoint (repeat the option, or separate with commas).
        #[arg(long, env = "POOLMGR_ENDPOINT", value_delimiter = ',', required = true)]
        endpoint: Vec<String>,
        #[arg(long, env = "POOLMGR_TOKEN")]
        token: String,
        #[arg(long, default_value = "default/bench")]
        pool: String,
        #[arg(long)]
        concurrency: usize,
        #[arg(long, default_value_t = 10.0)]
        duration_secs: f64,
        #[arg(long, default_value_t = 1.0)]
        warmup_secs: f64,
        #[arg(long, value_enum, default_value = "claim")]
        mode: load::Mode,
        #[arg(long, default_value = "run")]
        label: String,
        /// The result's path: `http` (the in-process path) or `deployed` (the Lambda shape).
        #[arg(long, default_value = "http")]
        path: String,
        /// The run's place in a series of reseeded runs of the same processes (1, 2, 3).
        #[arg(long)]
        round: Option<u32>,
        #[arg(long)]
        out: PathBuf,
        /// The poolmgr-local pids (repeat, or separate with commas): their CPU time per
        /// operation goes into the result.
        #[arg(long, value_delimiter = ',')]
        server_pid: Vec<String>,
        /// PgBouncer's pid, likewise.
        #[arg(long)]
        pooler_pid: Option<String>,
        /// The postmaster's pid: only its cluster counts as PostgreSQL (default: every
        /// `postgres` process on the machine).
        #[arg(long)]
        postmaster_pid: Option<String>,
    },
    /// Print the pgbench script running the service's claim statement (`claim` or `replay`).
    PgbenchScript {
        #[arg(long, value_enum, default_value = "claim")]
        mode: load::Mode,
    },
    /// Summarize pgbench's per-transaction logs (--log --log-prefix=PREFIX) into --out.
    PgbenchSummary {
        #[arg(long)]
        log_prefix: PathBuf,
        #[arg(long)]
        concurrency: usize,
        #[arg(long)]
        duration_secs: f64,
        #[arg(long, value_enum, default_value = "claim")]
        mode: load::Mode,
        #[arg(long, default_value = "run")]
        label: String,
        #[arg(long)]
        out: PathBuf,
        /// The machine's busy CPU ms during the run (from /proc/stat) and pgbench's own user+sys ms.
        #[arg(long, requires = "client_cpu_ms")]
        machine_cpu_ms: Option<f64>,
        #[arg(long, requires = "machine_cpu_ms")]
        client_cpu_ms: Option<f64>,
        /// CPU ms of the postgres processes during the run.
        #[arg(long, requires = "machine_cpu_ms")]
        postgres_cpu_ms: Option<f64>,
    },
    /// Print the machine's busy CPU time and the postgres processes' CPU time (exited backends
    /// included), in ms, space-separated (for the pgbench side's accounting).
    MachineCpuMs {
        /// The postmaster's pid: only its cluster counts (default: every `postgres` process).
        #[arg(long)]
        postmaster_pid: Option<String>,
    },
    /// Empty the pool and seed it with VMS AVAILABLE rows on HOST.
    ClaimsSeed {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        #[arg(long, default_value = "default/bench")]
        pool: String,
        #[arg(long, default_value = "bench-host")]
        host: String,
        #[arg(long)]
        vms: i64,
    },
    /// Check that no VM is leased twice (and, with --expect-leases, that the database holds
    /// exactly the leases the clients got). Exits 1 on a violation.
    ClaimsVerify {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        #[arg(long)]
        expect_leases: Option<i64>,
    },
    /// Write the results of LABEL into the generated section of --doc and the chart --svg.
    ClaimsReport {
        #[arg(long)]
        results: PathBuf,
        #[arg(long)]
        label: String,
        #[arg(long)]
        machine: String,
        #[arg(long)]
        settings: String,
        #[arg(long)]
        doc: PathBuf,
        #[arg(long)]
        svg: PathBuf,
    },
    /// Sequential claims against a running poolmgr (one client).
    ClaimLatency {
        #[arg(long, env = "POOLMGR_ENDPOINT")]
        endpoint: String,
        #[arg(long, env = "POOLMGR_TOKEN")]
        token: String,
        #[arg(long, default_value = "default/bench")]
        pool: String,
        #[arg(long, default_value_t = 1000)]
        n: usize,
        /// Send a fresh request_id with every claim.
        #[arg(long)]
        request_ids: bool,
    },
    /// Claims on a pool with a pre-lease hook of HOOK_MS, CLIENTS concurrent clients, through
    /// the HTTP stack served in-process (DATABASE_URL must be an empty database).
    HookClaims {
        #[arg(long, default_value_t = 16)]
        clients: usize,
        #[arg(long, default_value_t = 20)]
        claims_per_client: usize,
        #[arg(long, default_value_t = 200)]
        hook_ms: u64,
    },
    /// Issue 24's rollout scenarios in real time (busy, idle, broken; DATABASE_URL must be an
    /// empty database; busy uses two, so give it a server where it may create them).
    Rollout {
        #[arg(long)]
        scenario: String,
        /// The simulator's boot time.
        #[arg(long, default_value_t = 2000)]
        boot_ms: u64,
        /// busy: an empty database for the run without a change.
        #[arg(long)]
        baseline_url: Option<String>,
        /// Append the result (one JSON line) to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Reconcile pass time for POOLS pools of VMS VMs each (DATABASE_URL must be an empty database).
    Reconcile {
        #[arg(long, default_value_t = 100)]
        pools: usize,
        #[arg(long, default_value_t = 20)]
        vms: i32,
        /// Virtual flintlock hosts (one in-process simulator each) every pool places on.
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        #[arg(long, default_value_t = 200)]
        max_passes: usize,
        /// Append the result (one JSON line) to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Settled passes over POOLS pools of VMS VMs seeded by SQL, and one pass with 1 % of
    /// them needing work (DATABASE_URL must be an empty database).
    ReconcileSettled {
        #[arg(long, default_value_t = 10000)]
        pools: usize,
        #[arg(long, default_value_t = 10)]
        vms: i32,
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        #[arg(long, default_value_t = 5)]
        passes: usize,
    },
    /// Replay claim traces against running poolmgrs, one pool per (trace, policy,
    /// configuration), in scaled time; rows to --results. Exits 1 on a double lease or a pool
    /// above its autoscaling max (the results are written first).
    Demand(Box<demand::Args>),
    /// Write a demand run (--results, --summary) into the generated section of --doc.
    DemandReport {
        #[arg(long)]
        results: PathBuf,
        #[arg(long)]
        summary: PathBuf,
        #[arg(long)]
        machine: String,
        /// What `poolmgr-check --settled` said, per configuration.
        #[arg(long, default_value = "")]
        checks: String,
        #[arg(long)]
        doc: PathBuf,
    },
    /// Write the `rollout` trace's rows (--results, as `demand --rollout-results` wrote them)
    /// into their own generated section of --doc.
    DemandRolloutReport {
        #[arg(long)]
        results: PathBuf,
        #[arg(long)]
        machine: String,
        /// What the script set up (scaled knobs, builds).
        #[arg(long, default_value = "")]
        settings: String,
        /// What `poolmgr-check --settled` said, per stack.
        #[arg(long, default_value = "")]
        checks: String,
        #[arg(long)]
        doc: PathBuf,
    },
    /// Write the growth series in --results into the generated section of --doc and the chart --svg.
    ReconcileReport {
        #[arg(long)]
        results: PathBuf,
        #[arg(long)]
        machine: String,
        #[arg(long)]
        doc: PathBuf,
        #[arg(long)]
        svg: PathBuf,
    },
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

async fn claim_latency(endpoint: &str, token: &str, pool: &str, n: usize, request_ids: bool) -> anyhow::Result<()> {
    let (ns, name) = pool.split_once('/').context("--pool is NAMESPACE/NAME")?;
    let client = reqwest::Client::builder().build()?;
    let url = format!("{}/v1/claims", endpoint.trim_end_matches('/'));
    let mut lat = Vec::with_capacity(n);
    eprintln!("==> {n} sequential claims on {pool} at {url}");
    for i in 0..n {
        let mut body = json!({"pool": {"namespace": ns, "name": name}});
        if request_ids {
            body["request_id"] = json!(format!("bench-{}", ulid::Ulid::generate()));
        }
        let t = Instant::now();
        let resp = client.post(&url).bearer_auth(token).json(&body).send().await?;
        let status = resp.status();
        let _ = resp.bytes().await?;
        lat.push(t.elapsed());
        if !status.is_success() {
            bail!("claim {i} answered {status}: seed at least {n} AVAILABLE VMs first");
        }
        if (i + 1) % 250 == 0 {
            eprintln!("    {} claims done", i + 1);
        }
    }
    lat.sort();
    println!(
        "claims={n} request_ids={request_ids} median={} p95={} p99={} max={}",
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.95)),
        ms(percentile(&lat, 0.99)),
        ms(*lat.last().unwrap())
    );
    Ok(())
}

/// The in-process server's one token (at least 16 characters, or the configuration is refused).
const HOOK_BENCH_TOKEN: &str = "bench-token-0123456789";

async fn hook_claims(clients: usize, per_client: usize, hook_ms: u64) -> anyhow::Result<()> {
    let total = clients * per_client;
    let admin = format!("bench:{HOOK_BENCH_TOKEN}");
    let state =
        growth::bench_state(&[("POOLMGR_ADMIN_TOKENS", &admin), ("POOLMGR_RECONCILE_MAX_CREATES", "1000")]).await?;
    let (sim, _server) = growth::start_sim(&state, "sim", growth::bench_sim_config()).await?;
    sim.set_exec_rule(
        "prepare",
        flintlock_sim::ExecRule { duration: Duration::from_millis(hook_ms), ..Default::default() },
    );
    // HOOK_MS 0: no hook commands at all, so the claim is the checked one (a GetMicroVM on
    // the two-phase path) or, with POOLMGR_CLAIM_VERIFY=off, the one-statement claim.
    let commands: &[&str] = if hook_ms == 0 { &[] } else { &["prepare --for-job"] };
    let spec = growth::bench_pool("hook", total as i32, &["sim"], commands)?;
    service::pool::create(&state, spec, "bench").await.map_err(|e| anyhow::anyhow!("{e}"))?;
    eprintln!("==> filling pool default/hook with {total} VMs");
    for _ in 0..200 {
        reconcile::run_pass(&state).await?;
        let conn = state.db.raw().get().await?;
        let available: i64 = conn.query_one("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'", &[]).await?.get(0);
        if available as usize >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(axum::serve(listener, poolmgr_core::http::router(state.clone())).into_future());
    let url = format!("http://{addr}/v1/claims");
    eprintln!("==> {clients} clients x {per_client} claims, pre-lease hook {hook_ms} ms, via {url}");
    let client = reqwest::Client::new();
    let workers = (0..clients).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let mut lat = vec![];
            for _ in 0..per_client {
                let body = json!({"pool": {"namespace": "default", "name": "hook"}, "request_id": ulid::Ulid::generate().to_string()});
                let t = Instant::now();
                let resp = client.post(&url).bearer_auth(HOOK_BENCH_TOKEN).json(&body).send().await?;
                let status = resp.status();
                let _ = resp.bytes().await?;
                if !status.is_success() {
                    bail!("claim answered {status}");
                }
                lat.push(t.elapsed());
            }
            Ok::<_, anyhow::Error>(lat)
        }
    });
    let t0 = Instant::now();
    let (cpu0, gets0) = (own_cpu_seconds(), sim.calls(flintlock_sim::METHOD_GET));
    let mut lat = vec![];
    for r in futures::future::join_all(workers).await {
        lat.extend(r?);
    }
    let wall = t0.elapsed();
    let cpu = own_cpu_seconds() - cpu0;
    let gets = sim.calls(flintlock_sim::METHOD_GET) - gets0;
    lat.sort();
    println!(
        "hook_ms={hook_ms} verify={} clients={clients} claims={total} median={} p95={} p99={} max={} throughput={:.1}/s \
         process_cpu_per_claim={:.0}us get_micro_vm_calls={gets}",
        state.config.hooks.claim_verify,
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.95)),
        ms(percentile(&lat, 0.99)),
        ms(*lat.last().unwrap()),
        total as f64 / wall.as_secs_f64(),
        cpu * 1e6 / total as f64,
    );
    Ok(())
}

/// CPU seconds (user + system) this process used so far: the HTTP server, the claim code
/// and the in-process flintlock-sim together (PostgreSQL's are its own processes').
fn own_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name and state;
    // in clock ticks, 100 per second on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

fn print_run(r: &load::RunResult) {
    let errors: u64 = r.errors.values().sum();
    eprintln!(
        "    {} {:?} x{}: {:.0}/s, p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {} ok, {errors} errors {:?}",
        r.path, r.mode, r.concurrency, r.throughput, r.p50_ms, r.p95_ms, r.p99_ms, r.max_ms, r.ok, r.errors
    );
}

fn fail_on(violations: Vec<String>) -> anyhow::Result<()> {
    if violations.is_empty() {
        return Ok(());
    }
    for v in &violations {
        eprintln!("VIOLATION: {v}");
    }
    bail!("{} violations; see above", violations.len())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::ClaimsLoad {
            endpoint,
            token,
            pool,
            concurrency,
            duration_secs,
            warmup_secs,
            mode,
            label,
            path,
            round,
            out,
            server_pid,
            pooler_pid,
            postmaster_pid,
        } => {
            let (ns, name) = pool.split_once('/').context("--pool is NAMESPACE/NAME")?;
            let (r, violations) = load::http_load(load::HttpLoad {
                endpoints: endpoint,
                token,
                namespace: ns.into(),
                pool: name.into(),
                concurrency,
                duration: Duration::from_secs_f64(duration_secs),
                warmup: Duration::from_secs_f64(warmup_secs),
                mode,
                label,
                path,
                round,
                server_pids: server_pid,
                pooler_pid,
                postmaster_pid,
            })
            .await?;
            print_run(&r);
            load::append_result(&out, &r)?;
            println!("{}", r.leases_created);
            fail_on(violations)
        }
        Cmd::PgbenchScript { mode } => {
            print!("{}", load::pgbench_script(mode)?);
            Ok(())
        }
        Cmd::PgbenchSummary {
            log_prefix,
            concurrency,
            duration_secs,
            mode,
            label,
            out,
            machine_cpu_ms,
            client_cpu_ms,
            postgres_cpu_ms,
        } => {
            let cpu = machine_cpu_ms.zip(client_cpu_ms).map(|(m, c)| (m, c, postgres_cpu_ms));
            let duration = Duration::from_secs_f64(duration_secs);
            let r = load::pgbench_summary(&log_prefix, &label, mode, concurrency, duration, cpu)?;
            print_run(&r);
            load::append_result(&out, &r)?;
            println!("{}", r.leases_created);
            Ok(())
        }
        Cmd::MachineCpuMs { postmaster_pid } => {
            let machine = load::machine_busy_ms().context("cannot read /proc/stat")?;
            let postgres = load::postgres_cpu_ms(postmaster_pid.as_deref()).context("cannot read /proc")?;
            println!("{machine:.0} {postgres:.0}");
            Ok(())
        }
        Cmd::ClaimsSeed { database_url, pool, host, vms } => {
            let (ns, name) = pool.split_once('/').context("--pool is NAMESPACE/NAME")?;
            load::seed(&database_url, ns, name, &host, vms).await
        }
        Cmd::ClaimsVerify { database_url, expect_leases } => fail_on(load::verify(&database_url, expect_leases).await?),
        Cmd::ClaimsReport { results, label, machine, settings, doc, svg } => {
            let rs: Vec<load::RunResult> = report::read_jsonl(&results)?;
            let chart_name = svg.file_name().context("--svg needs a file name")?.to_string_lossy().to_string();
            let section = report::markdown(&rs, &label, &machine, &settings, &chart_name)?;
            let old = std::fs::read_to_string(&doc).unwrap_or_default();
            std::fs::write(&doc, report::splice(&old, &section, report::BEGIN, report::END))
                .with_context(|| format!("writing {}", doc.display()))?;
            report::chart(&rs, &label, &svg)?;
            eprintln!("==> wrote {} and {}", doc.display(), svg.display());
            Ok(())
        }
        Cmd::ClaimLatency { endpoint, token, pool, n, request_ids } => {
            claim_latency(&endpoint, &token, &pool, n, request_ids).await
        }
        Cmd::Rollout { scenario, boot_ms, baseline_url, out } => {
            rollout::run(&scenario, boot_ms, baseline_url.as_deref(), out.as_deref()).await
        }
        Cmd::Reconcile { pools, vms, hosts, max_passes, out } => {
            growth::run(pools, vms, hosts, max_passes, out.as_deref()).await
        }
        Cmd::ReconcileSettled { pools, vms, hosts, passes } => growth::settled(pools, vms, hosts, passes).await,
        Cmd::ReconcileReport { results, machine, doc, svg } => {
            let rs: Vec<growth::SizeResult> = report::read_jsonl(&results)?;
            let chart_name = svg.file_name().context("--svg needs a file name")?.to_string_lossy().to_string();
            let section = growth::markdown(&rs, &machine, &chart_name);
            let old = std::fs::read_to_string(&doc).unwrap_or_default();
            std::fs::write(&doc, report::splice(&old, &section, growth::BEGIN, growth::END))
                .with_context(|| format!("writing {}", doc.display()))?;
            growth::chart(&rs, &svg)?;
            eprintln!("==> wrote {} and {}", doc.display(), svg.display());
            Ok(())
        }
        Cmd::Demand(args) => {
            if demand::run(*args).await? {
                Ok(())
            } else {
                bail!("the demand run broke an invariant; see the VIOLATION lines above")
            }
        }
        Cmd::DemandReport { results, summary, machine, checks, doc } => {
            let rows: Vec<demand::metrics::Row> = report::read_jsonl(&results)?;
            let summary = demand::report::read_summary(&summary)?;
            let section = demand::report::markdown(&rows, &summary, &machine, &checks);
            let old = std::fs::read_to_string(&doc).unwrap_or_default();
            std::fs::write(&doc, report::splice(&old, &section, demand::report::BEGIN, demand::report::END))
                .with_context(|| format!("writing {}", doc.display()))?;
            eprintln!("==> wrote {}", doc.display());
            Ok(())
        }
        Cmd::DemandRolloutReport { results, machine, settings, checks, doc } => {
            let rows: Vec<demand::rollout::RolloutRow> = report::read_jsonl(&results)?;
            let section = demand::rollout_report::markdown(&rows, &machine, &settings, &checks);
            let old = std::fs::read_to_string(&doc).unwrap_or_default();
            let (begin, end) = (demand::rollout_report::BEGIN, demand::rollout_report::END);
            std::fs::write(&doc, report::splice(&old, &section, begin, end))
                .with_context(|| format!("writing {}", doc.display()))?;
            eprintln!("==> wrote {}", doc.display());
            Ok(())
        }
        Cmd::HookClaims { clients, claims_per_client, hook_ms } => {
            hook_claims(clients, claims_per_client, hook_ms).await
        }
    }
}
