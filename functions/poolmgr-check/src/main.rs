//! `poolmgr-check`: verify poolmgr's invariants against the database and every flintlock host
//! it names. Exit code 0 = clean, 1 = violations, 2 = could not check. See the library docs
//! for the list of checks.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use poolmgr_check::{Mode, Options, run};

#[derive(Parser)]
#[command(
    about = "Verify poolmgr's invariants against the database and the flintlock hosts",
    long_about = "Verify poolmgr's invariants against the database and the flintlock hosts.\n\n\
        Always-checks (must hold in every committed state): a LEASED VM has exactly one lease and \
        every lease's VM is LEASED (or DELETING, a release in progress); no VM has two leases; no \
        (principal, request_id) has two leases; leases and VMs agree on the pool; no claimable VM \
        lacks a uid; no VM is on an unregistered host or of a deleted pool; no microVM has two rows.\n\n\
        Settled-checks (--settled / --wait): no VM in transition, every pool at its size and none \
        above it, no orphan microVM in a managed flintlock namespace, no row whose microVM is gone.\n\n\
        TLS to the database: sslmode in the URL, POOLMGR_DATABASE_SSLMODE and POOLMGR_DATABASE_CA_PEM, \
        as for poolmgr itself (docs/deploy.md, \"TLS to PostgreSQL\").\n\n\
        Hosts whose secrets are encrypted at rest are reached with POOLMGR_CREDENTIALS_KEY and \
        POOLMGR_CREDENTIALS_OLD_KEYS, as poolmgr reaches them.\n\n\
        Exit code: 0 clean, 1 violations, 2 could not check (database or a host unreachable)."
)]
struct Cli {
    /// PostgreSQL URL of poolmgr's database (read only).
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// List host NAME at ADDR instead of the address in the hosts table (repeatable).
    #[arg(long = "flintlock", value_name = "NAME=ADDR", value_parser = parse_override)]
    flintlock: Vec<(String, String)>,
    /// poolmgr's flintlock namespaces start with this.
    #[arg(long, env = "POOLMGR_FLINTLOCK_NAMESPACE_PREFIX", default_value = "poolmgr-")]
    namespace_prefix: String,
    /// The deployment's id, when set in its configuration; default: the one in its database.
    /// Only microVMs in this deployment's flintlock namespaces are checked.
    #[arg(long, env = "POOLMGR_DEPLOYMENT_ID")]
    deployment_id: Option<String>,
    /// Also treat the settled checks as violations (the system must be quiet).
    #[arg(long)]
    settled: bool,
    /// Wait up to this long (e.g. 60s) for the settled checks to pass, printing progress;
    /// implies --settled. An always-check violation ends the wait at once.
    #[arg(long, value_parser = humantime::parse_duration)]
    wait: Option<Duration>,
    /// Limit of each flintlock call.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    flintlock_timeout: Duration,
}

fn parse_override(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, a)) if !n.is_empty() && !a.is_empty() => Ok((n.to_string(), a.to_string())),
        _ => Err(format!("expected NAME=ADDR (e.g. sim=127.0.0.1:9090), got {s:?}")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let db_tls = match poolmgr_core::db::DbTls::from_env() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("poolmgr-check: {e}");
            return ExitCode::from(2);
        }
    };
    let credentials = match poolmgr_core::credentials::Keyring::from_lookup(&|k: &str| std::env::var(k).ok()) {
        Ok(k) => std::sync::Arc::new(k),
        Err(e) => {
            eprintln!("poolmgr-check: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = Options {
        credentials,
        database_url: cli.database_url,
        db_tls,
        flintlock_overrides: cli.flintlock,
        namespace_prefix: cli.namespace_prefix,
        deployment_id: cli.deployment_id.filter(|id| !id.is_empty()),
        flintlock_timeout: cli.flintlock_timeout,
    };
    let mode = match (cli.wait, cli.settled) {
        (Some(d), _) => Mode::WaitSettled(d),
        (None, true) => Mode::Settled,
        (None, false) => Mode::Once,
    };
    let (verdict, _) = run(&opts, mode).await;
    ExitCode::from(verdict.exit_code())
}
