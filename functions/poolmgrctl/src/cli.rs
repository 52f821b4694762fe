//! The command tree: clap derive definitions only, no behaviour.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use poolmgr_client::Phase;

/// Operate poolmgr: warm pools of flintlock microVMs.
///
/// Exit codes: 0 success, 1 other errors, 2 usage or invalid argument, 3 not found,
/// 4 conflict (already exists, aborted, failed precondition), 5 resource exhausted,
/// 6 unavailable (server, database or flintlock unreachable, connection failures, time-outs),
/// 7 lease lost during `lease run`, 8 `pool diff` failed (1 there means "differences"),
/// 9 `pool wait` timed out, 10 the request succeeded but the `--jq` filter failed on its
/// answer (printed as JSON instead). `lease run` otherwise exits with its command's code
/// (128+N for a command killed by signal N, 127 when it cannot be found, 126 when it cannot
/// be run).
#[derive(Debug, Parser)]
#[command(name = "poolmgrctl", version, propagate_version = true, max_term_width = 100)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Global options")]
pub struct Global {
    /// Base URL of the poolmgr HTTP API [env: POOLMGR_ENDPOINT; else the context's; else
    /// http://127.0.0.1:8080].
    #[arg(long, global = true, value_name = "URL")]
    pub endpoint: Option<String>,
    /// API token, sent as `Authorization: Bearer <token>` [env: POOLMGR_TOKEN; else the
    /// context's]. Prefer --token-file: a flag's value shows in `ps`.
    #[arg(long, global = true, value_name = "TOKEN", conflicts_with = "token_file")]
    pub token: Option<String>,
    /// Read the API token from this file (surrounding whitespace ignored) [env:
    /// POOLMGR_TOKEN_FILE, below POOLMGR_TOKEN].
    #[arg(long, global = true, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Use this context of the config file instead of its current one [env: POOLMGR_CONTEXT].
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// The config file [env: POOLMGR_CONFIG; default $XDG_CONFIG_HOME/poolmgr/config.yaml,
    /// or ~/.config/poolmgr/config.yaml].
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Output format: table (the default), json, yaml, name (one resource name per line:
    /// NAMESPACE/NAME for pools, ids for leases and VMs, names for hosts), or
    /// jsonpath=TEMPLATE (kubectl's: `-o jsonpath='{.lease.lease_id}'`).
    #[arg(short = 'o', long, global = true, value_name = "FORMAT", value_parser = parse_format)]
    pub output: Option<Format>,
    /// Filter the JSON output with a jq program (jaq), each result on a line, strings as
    /// their text like `jq -r` (e.g. `--jq .lease.lease_id`). Implies -o json. Compiled, never
    /// run, before the request; if it fails on the answer: exit 10, the answer as JSON.
    #[arg(long, global = true, value_name = "EXPR")]
    pub jq: Option<String>,
    /// Tables without their header line.
    #[arg(long, global = true)]
    pub no_headers: bool,
    /// Time-out of one HTTP request (e.g. 30s, 2m, 1500ms; a bare number is seconds).
    #[arg(long, global = true, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Time-out of opening a connection to the endpoint, TLS handshake included.
    #[arg(long, global = true, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// Trust the CA certificates (PEM) of this file for an https:// endpoint, on top of the
    /// system's trust store [env: POOLMGR_CA_FILE; else the context's ca_file]. (Not
    /// `--ca-file`: `host add --ca-file` is the flintlock host's CA.)
    #[arg(long, global = true, value_name = "FILE")]
    pub server_ca_file: Option<PathBuf>,
}

/// What a command prints (`-o`, `--jq`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// Aligned columns for people.
    Table,
    /// The API's JSON objects, as the API returned them.
    Json,
    /// The API's objects as YAML.
    Yaml,
    /// One name per line: what the command showed or acted on.
    Name,
    /// A kubectl-style JSONPath template over the JSON (`crate::filter::Template`).
    JsonPath(String),
    /// A jq program over the JSON (`--jq`; `crate::filter::jq`).
    Jq(String),
}

/// `-o`: `table`, `json`, `yaml`, `name` or `jsonpath=TEMPLATE` (checked here, before
/// anything is sent).
pub fn parse_format(s: &str) -> Result<Format, String> {
    match s {
        "table" => Ok(Format::Table),
        "json" => Ok(Format::Json),
        "yaml" => Ok(Format::Yaml),
        "name" => Ok(Format::Name),
        _ => match s.split_once('=') {
            Some(("jsonpath", t)) => {
                crate::filter::Template::parse(t)?;
                Ok(Format::JsonPath(t.to_owned()))
            }
            _ => Err("use table, json, yaml, name or jsonpath=TEMPLATE (e.g. jsonpath='{.lease.lease_id}')".into()),
        },
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Pools: desired state and live counts.
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Leases: claim a VM, heartbeat, release.
    #[command(subcommand)]
    Lease(LeaseCmd),
    /// VMs poolmgr manages.
    #[command(subcommand)]
    Vm(VmCmd),
    /// flintlock hosts.
    #[command(subcommand)]
    Host(HostCmd),
    /// The event feed.
    #[command(subcommand)]
    Events(EventsCmd),
    /// Named endpoints and tokens in the config file.
    #[command(subcommand)]
    Context(ContextCmd),
    /// Print a shell completion script (e.g. `poolmgrctl completion bash > /etc/bash_completion.d/poolmgrctl`).
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), or write one page per command into --dir
    /// (e.g. `poolmgrctl man --dir /usr/local/share/man/man1`).
    Man {
        /// Write poolmgrctl.1, poolmgrctl-pool.1, poolmgrctl-pool-create.1, … here.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ContextCmd {
    /// List the contexts (the current one marked `*`). Tokens are never printed.
    List,
    /// Make NAME the current context.
    Use { name: String },
    /// Create or change context NAME from the global --endpoint, --token, --token-file and
    /// --server-ca-file given with it (e.g. `poolmgrctl --endpoint URL --token-file F context set prod`); what
    /// is not given keeps its value. The file is written with mode 0600.
    Set {
        name: String,
        /// Also make it the current context.
        #[arg(long)]
        current: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum PoolCmd {
    /// Create a pool from a PoolSpec file (JSON or YAML), validated locally first.
    Create(SpecFile),
    /// Replace a pool's spec from a PoolSpec file; the pool is the one the file names.
    Update(SpecFile),
    /// Create or update the pools the files describe (kubectl apply). Each pool is read with
    /// its ETag, compared with the file, and created, left as it is, or updated with
    /// If-Match: a pool someone changed since the read is not overwritten (exit 4, re-run).
    /// Every file is checked before anything is sent.
    Apply {
        /// A PoolSpec file (YAML documents separated by `---`, or a JSON object or array;
        /// `-` reads standard input), or a directory: its *.yaml, *.yml and *.json files,
        /// sorted by name.
        #[arg(long, short = 'f', value_name = "FILE|DIR")]
        file: PathBuf,
        /// Print what would change (a diff per pool) and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Show how the pools the files describe differ from what they are: a unified diff of
    /// each current spec (server defaults left out) against the file's. Exit 0: no
    /// difference; 1: differences; 2 or more: an error (8 for one of class 1).
    Diff {
        /// A PoolSpec file or directory, as for `pool apply`.
        #[arg(long, short = 'f', value_name = "FILE|DIR")]
        file: PathBuf,
    },
    /// Show one pool.
    Get {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
    },
    /// List pools.
    List {
        /// Only pools of this namespace.
        #[arg(long, short = 'n')]
        namespace: Option<String>,
    },
    /// Delete (drain) a pool.
    Delete {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
        /// Delete even while VMs are leased: their leases end.
        #[arg(long)]
        force: bool,
    },
    /// Announce demand: CLAIMS claims are coming within --within (a CI matrix about to start).
    /// The pool pre-warms for them up to its autoscaling ceiling (without autoscaling it only
    /// refills faster); the hint expires by itself. Client or admin token.
    Expect {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
        /// How many claims are coming (1-10000).
        #[arg(long)]
        claims: i32,
        /// Within how long from now (1s-1h).
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
        within: Duration,
    },
    /// A pool's template rollouts: where the last one stands, the kept revisions, and
    /// pausing, resuming or undoing one (admin token).
    #[command(subcommand)]
    Rollout(RolloutCmd),
    /// Wait until a pool has at least --available VMs AVAILABLE, polling its status, with
    /// progress on standard error; then print the pool. The global --timeout bounds the whole
    /// wait here (default 30s, like `kubectl wait`). Exit 0 once met; 9 when --timeout passed
    /// first (the message says what the pool has and what to do); 3 for an unknown pool.
    Wait {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
        /// How many AVAILABLE VMs to wait for.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(0..=10000))]
        available: i64,
        /// Poll interval (at least 100ms).
        #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_interval)]
        interval: Duration,
    },
    /// Show a pool's live counts, its desired size and why (autoscaling: the measured claim
    /// and refusal rates, the provisioning time, announced claims).
    Status {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
        /// Keep polling and redrawing until Ctrl-C.
        #[arg(long, short = 'w')]
        watch: bool,
        /// Poll interval of --watch (at least 100ms).
        #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_interval)]
        interval: Duration,
    },
}

#[derive(Debug, Subcommand)]
pub enum RolloutCmd {
    /// The rollout's state, current and target revision, VMs per revision, stale leased VMs,
    /// extra boots and why it halted.
    Status {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
        /// Keep polling and redrawing until Ctrl-C.
        #[arg(long, short = 'w')]
        watch: bool,
        /// Poll interval of --watch (at least 100ms).
        #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_interval)]
        interval: Duration,
    },
    /// The kept revisions (the last 10), newest first.
    History {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
    },
    /// Pause the running rollout: nothing more is surged or retired until resumed.
    Pause {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
    },
    /// Resume a paused rollout.
    Resume {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
    },
    /// Go back to a kept revision (default: the previous one) with a rollout to it.
    Undo {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        pool: String,
        /// The revision to go back to (`rollout history` lists them).
        #[arg(long, value_name = "N")]
        to_revision: Option<i32>,
    },
}

#[derive(Debug, Args)]
pub struct SpecFile {
    /// PoolSpec file: .json or .yaml/.yml (`-` reads standard input).
    #[arg(long, short = 'f', value_name = "FILE")]
    pub file: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum LeaseCmd {
    /// Claim a VM from a pool.
    ///
    /// With a request id (--request-id, --auto-request-id, or generated for --wait) the claim
    /// is idempotent: transient failures (UNAVAILABLE, ABORTED, connection errors, resets,
    /// time-outs) are retried with the same id and jittered exponential backoff until --wait
    /// elapses (30s without --wait), and a retry never claims a second VM. RESOURCE_EXHAUSTED
    /// (no VM available) is retried while --wait lasts. Without an id and --wait: one attempt.
    /// Progress goes to standard error.
    #[command(group(ArgGroup::new("idempotency").args(["request_id", "auto_request_id"])))]
    Claim {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        #[arg(long)]
        pool: String,
        /// Idempotency key: a retry with the same id returns the same lease.
        #[arg(long, value_name = "ID")]
        request_id: Option<String>,
        /// Generate a UUID request id and retry transient failures with it.
        #[arg(long)]
        auto_request_id: bool,
        /// How long to keep retrying (e.g. 30s, 5m), with a generated request id unless
        /// --request-id is given. Without it an empty pool fails at once.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        wait: Option<Duration>,
    },
    /// Run a command under a lease: claim, heartbeat while it runs, release when it ends.
    ///
    /// Claims like `lease claim` with a request id (a generated UUID unless --request-id),
    /// then runs CMD with the VM's facts in its environment: POOLMGR_LEASE_ID,
    /// POOLMGR_REQUEST_ID, POOLMGR_POOL (NAMESPACE/NAME), POOLMGR_VM_ID, POOLMGR_VM_UID,
    /// POOLMGR_HOST and POOLMGR_HOST_ADDRESS (the flintlock host), POOLMGR_LEASE_EXPIRES_AT,
    /// POOLMGR_VM_INTERFACES (device ids, space-separated), per interface N (0, 1, … in device
    /// id order) POOLMGR_VM_IFACE_N_DEVICE, POOLMGR_VM_IFACE_N_MAC,
    /// POOLMGR_VM_IFACE_N_HOST_DEVICE, POOLMGR_VM_IFACE_N_INDEX, POOLMGR_VM_MAC (the first
    /// interface's), and POOLMGR_CLAIM_JSON (the whole claim answer). The contract carries no
    /// IP address: find the guest by its MAC address or TAP device.
    ///
    /// The lease is heartbeated while CMD runs and released when CMD exits, whatever the exit
    /// (the release is retried for 30s). A failed heartbeat (no answer, a throttle, a proxy's
    /// error, a token being rotated) is said on standard error and tried again, backing off,
    /// until the lease's expires_at. SIGTERM and SIGHUP are forwarded to CMD, and SIGINT too
    /// unless poolmgrctl runs in a terminal's foreground (the terminal already sent it to
    /// CMD); poolmgrctl then waits for CMD. A signal that arrives before CMD was started stops
    /// the run: the lease is released and poolmgrctl exits 128+N. If the lease is lost while
    /// CMD runs (the server says it is gone — it expired or was released elsewhere: its VM is
    /// being deleted — or its expires_at passed without a successful heartbeat), CMD is sent
    /// SIGTERM, then SIGKILL if it has not exited after --kill-after, and poolmgrctl exits 7
    /// once CMD has exited. Otherwise it exits with CMD's code, 128+N when CMD was killed by
    /// signal N. Only a SIGKILL of poolmgrctl skips the release: the lease then expires after
    /// the pool's heartbeat_expiry_seconds. What it does is said on standard error.
    Run {
        /// NAMESPACE/NAME, or NAME in namespace `default`.
        #[arg(long)]
        pool: String,
        /// Idempotency key of the claim (default: a generated UUID).
        #[arg(long, value_name = "ID")]
        request_id: Option<String>,
        /// How long to wait for a VM (e.g. 30s, 5m). Without it an empty pool fails at once;
        /// transient failures are retried for 30s.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        wait: Option<Duration>,
        /// Once the lease is lost, how long CMD has to exit after SIGTERM before it is sent
        /// SIGKILL.
        #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
        kill_after: Duration,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Extend a lease: expires_at becomes now + the pool's heartbeat_expiry_seconds.
    Heartbeat { lease_id: String },
    /// Release a lease: its VM is deleted.
    Release { lease_id: String },
    /// Show one lease.
    Get { lease_id: String },
    /// List leases (a client token sees only its own). Every page is fetched.
    List {
        /// Only leases of this pool: NAMESPACE/NAME, or NAME in namespace `default`.
        #[arg(long)]
        pool: Option<String>,
        /// Leases per request (the server's default when absent).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
        page_size: Option<i64>,
    },
}

#[derive(Debug, Subcommand)]
pub enum VmCmd {
    /// List VMs.
    List {
        /// Only VMs of this pool: NAMESPACE/NAME, or NAME in namespace `default`.
        #[arg(long, conflicts_with = "namespace")]
        pool: Option<String>,
        /// Only VMs of pools in this namespace.
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        /// Only VMs in this phase (e.g. AVAILABLE, LEASED).
        #[arg(long, value_parser = parse_phase)]
        phase: Option<Phase>,
    },
    /// Show one VM.
    Get { id: String },
    /// Discard a VM (typically QUARANTINED, once you looked at it): it is deleted in flintlock
    /// and its row removed, and the pool may replace it. A LEASED VM is refused: release its
    /// lease instead.
    Delete { id: String },
}

#[derive(Debug, Subcommand)]
pub enum HostCmd {
    /// Register a flintlock host.
    Add(HostArgs),
    /// Replace a host's address, TLS settings and credentials.
    Update(HostArgs),
    /// Unregister a host (refused while a pool names it or it has VMs).
    Remove { name: String },
    /// Show one host.
    Get { name: String },
    /// List hosts.
    List,
    /// Stop placing new VMs on a host.
    Cordon {
        name: String,
        /// Why, shown in `host get`.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Allow new placements on a host again.
    Uncordon { name: String },
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("transport").required(true).args(["insecure", "ca_file"])))]
pub struct HostArgs {
    /// Host name (a DNS label).
    pub name: String,
    /// flintlockd gRPC address, host:port.
    #[arg(long)]
    pub address: String,
    /// Plaintext gRPC (a flintlockd started with --insecure).
    #[arg(long)]
    pub insecure: bool,
    /// TLS: PEM file of the CA that signed flintlockd's certificate.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// Mutual TLS: client certificate PEM file (with --key-file).
    #[arg(long, value_name = "FILE", requires_all = ["ca_file", "key_file"])]
    pub cert_file: Option<PathBuf>,
    /// Mutual TLS: client key PEM file (with --cert-file).
    #[arg(long, value_name = "FILE", requires_all = ["ca_file", "cert_file"])]
    pub key_file: Option<PathBuf>,
    /// flintlockd basic-auth token.
    #[arg(long, value_name = "TOKEN")]
    pub basic_auth_token: Option<String>,
    /// Whether the host can run hooks: `auto` asks its ServerInfo (the server's default when
    /// absent; `host update` without it sets auto again), `enabled`/`disabled` declares it.
    #[arg(long, value_enum, value_name = "MODE")]
    pub exec: Option<ExecMode>,
}

/// A host's exec declaration (the Host object's `exec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExecMode {
    /// Ask the host's ServerInfo when a pool with hooks names it.
    Auto,
    /// The host can run hooks, whatever its ServerInfo says.
    Enabled,
    /// The host cannot run hooks.
    Disabled,
}

impl From<ExecMode> for poolmgr_client::HostExec {
    fn from(m: ExecMode) -> Self {
        match m {
            ExecMode::Auto => poolmgr_client::HostExec::Auto,
            ExecMode::Enabled => poolmgr_client::HostExec::Enabled,
            ExecMode::Disabled => poolmgr_client::HostExec::Disabled,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum EventsCmd {
    /// Print events and follow the feed (long-polls) until Ctrl-C.
    Tail {
        /// Only events of this pool: NAMESPACE/NAME, or NAME in namespace `default`.
        #[arg(long)]
        pool: Option<String>,
        /// Start after this event id (the feed's cursor); 0 is the beginning.
        #[arg(long, value_name = "ID", default_value_t = 0)]
        since: i64,
        /// Print what is there and exit instead of following.
        #[arg(long)]
        no_follow: bool,
        /// Events per request (1-1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1000))]
        limit: i64,
    },
}

/// `30s`, `2m`, `1h30m`, `1500ms`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<u64>().map(Duration::from_secs).map_err(|e| e.to_string());
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (use e.g. 30s, 2m, 1h30m, 1500ms)"))
}

/// The shortest poll interval: a shorter one (`--interval 0`) would poll the server in a loop
/// with no pause.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// A poll interval: a duration of at least [`MIN_INTERVAL`].
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < MIN_INTERVAL {
        return Err(format!(
            "{} is too short a poll interval; use at least {}",
            humantime::format_duration(d),
            humantime::format_duration(MIN_INTERVAL)
        ));
    }
    Ok(d)
}

fn parse_phase(s: &str) -> Result<Phase, String> {
    let up = s.to_ascii_uppercase();
    match Phase::parse(&up) {
        Some(p) => Ok(p),
        None => {
            let all: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
            Err(format!("unknown phase; use one of {}", all.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1500ms").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn poll_intervals_are_at_least_100ms() {
        assert_eq!(parse_interval("100ms").unwrap(), Duration::from_millis(100));
        assert_eq!(parse_interval("2").unwrap(), Duration::from_secs(2));
        for short in ["0", "0s", "99ms", "1ns"] {
            let e = parse_interval(short).unwrap_err();
            assert!(e.contains("at least 100ms"), "{short}: {e}");
        }
        assert!(parse_interval("soon").is_err());
    }

    #[test]
    fn phases_are_case_insensitive() {
        assert_eq!(parse_phase("available").unwrap(), Phase::Available);
        assert!(parse_phase("nope").is_err());
    }

    #[test]
    fn request_id_and_auto_request_id_conflict() {
        let r = Cli::try_parse_from([
            "poolmgrctl",
            "lease",
            "claim",
            "--pool",
            "ci",
            "--request-id",
            "x",
            "--auto-request-id",
        ]);
        assert_eq!(r.unwrap_err().kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn host_add_needs_a_transport() {
        let r = Cli::try_parse_from(["poolmgrctl", "host", "add", "a", "--address", "x:1"]);
        assert_eq!(r.unwrap_err().kind(), clap::error::ErrorKind::MissingRequiredArgument);
        let r =
            Cli::try_parse_from(["poolmgrctl", "host", "add", "a", "--address", "x:1", "--insecure", "--ca-file", "c"]);
        assert_eq!(r.unwrap_err().kind(), clap::error::ErrorKind::ArgumentConflict);
        let r = Cli::try_parse_from([
            "poolmgrctl",
            "host",
            "add",
            "a",
            "--address",
            "x:1",
            "--ca-file",
            "c",
            "--cert-file",
            "d",
        ]);
        assert_eq!(r.unwrap_err().kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }
}
