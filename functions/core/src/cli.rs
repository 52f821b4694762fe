//! The command line of the server binaries (`poolmgr-local`, `migrate` and the Lambda
//! functions): `--help` lists every environment variable the binary reads with its default,
//! `--version` prints the version and the schema it needs, and neither starts anything (no
//! database, no listener, no Lambda runtime).
//!
//! One table per group of variables ([`Var`]: name, default, meaning). The clap command is
//! built from the tables, with clap's `env` support reading each variable, and `poolmgr-local`
//! reads its whole configuration through it ([`Args::lookup`]): a variable the readers ask for
//! that no table lists fails in debug builds, so the tests keep the tables and the readers in
//! step. The tests also check that [`config::Config::from_lookup`](crate::config::Config)
//! reads exactly [`DATABASE`] and [`CONFIG`], and that the README's configuration table names
//! every variable here.
//!
//! Never: prints a variable's value (`hide_env_values`: tokens and keys are among them).

use clap::{Arg, ArgAction, ArgMatches, Command};

/// One environment variable a binary reads.
#[derive(Debug, Clone, Copy)]
pub struct Var {
    pub name: &'static str,
    /// What applies when it is unset or empty, as `--help` shows it.
    pub default: &'static str,
    pub help: &'static str,
}

const fn v(name: &'static str, default: &'static str, help: &'static str) -> Var {
    Var { name, default, help }
}

/// Where the database is and how to reach it (every binary).
pub const DATABASE: &[Var] = &[
    v("DATABASE_URL", "none (required)", "PostgreSQL URL; its sslmode says whether to use TLS and what to check"),
    v(
        "POOLMGR_DATABASE_SSLMODE",
        "prefer on loopback or a Unix socket, else verify-full",
        "sslmode of a URL that names none (disable, prefer, require, verify-ca, verify-full)",
    ),
    v(
        "POOLMGR_DATABASE_CA_PEM",
        "the compiled-in public roots",
        "CA of the server's certificate (PEM text or a file path)",
    ),
];

/// The rest of what [`crate::config::Config::from_lookup`] reads.
pub const CONFIG: &[Var] = &[
    v("POOLMGR_ADMIN_TOKENS", "none", "admin bearer tokens, comma-separated `token` or `name:token`"),
    v("POOLMGR_VIEWER_TOKENS", "none", "viewer (read-only, /metrics) bearer tokens"),
    v("POOLMGR_CLIENT_TOKENS", "none", "client (claims, leases, hints) bearer tokens"),
    v("POOLMGR_AUTH", "enabled", "`disabled` serves everyone as admin without a token (local development only)"),
    v("POOLMGR_DB_POOL_SIZE", "16; 1 on Lambda", "database connections per process"),
    v("POOLMGR_DB_CONNECT_TIMEOUT_SECONDS", "5", "waiting for a connection; past it requests answer 503"),
    v("POOLMGR_DB_CHECK_IDLE_SECONDS", "1", "a connection idle this long is pinged before use (0: every use)"),
    v("POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS", "10", "client-side limit of each statement (0: none)"),
    v("POOLMGR_DB_CANCEL_ON_TIMEOUT", "true", "send a cancel for a statement past its timeout"),
    v("POOLMGR_DB_PREPARE_CLAIM", "true; false on Lambda", "prepare the claim's call once per connection"),
    v("POOLMGR_METRICS_FORMAT", "emf on Lambda, else prometheus", "`emf` also writes CloudWatch EMF lines on stdout"),
    v("POOLMGR_METRICS_NAMESPACE", "poolmgr", "CloudWatch namespace of the EMF lines"),
    v("POOLMGR_FLINTLOCK_TIMEOUT_SECONDS", "10", "every flintlock call"),
    v("POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS", "5", "how long client scopes and quotas are kept (at most 300)"),
    v("POOLMGR_HEALTH_CACHE_SECONDS", "2", "how long /readyz answers from its last check (0: every probe; at most 60)"),
    v("POOLMGR_POLICY_VIRTIOFS_PATHS", "none", "host directories a pool's virtiofs volumes may share (`*`: any)"),
    v("POOLMGR_POLICY_BRIDGES", "none", "host bridges an interface may name (`*`: any)"),
    v("POOLMGR_POLICY_IMAGE_PREFIXES", "any", "prefixes every kernel, initrd and volume image must start with"),
    v("POOLMGR_CREDENTIALS_KEY", "none", "key hosts' secrets are encrypted with at rest (32+ random characters)"),
    v("POOLMGR_CREDENTIALS_OLD_KEYS", "none", "older keys that only decrypt, comma-separated (rotation)"),
    v("POOLMGR_FLINTLOCK_NAMESPACE_PREFIX", "poolmgr-", "prefix of the flintlock namespaces this deployment owns"),
    v("POOLMGR_DEPLOYMENT_ID", "the database's", "1-20 lowercase letters and digits naming this deployment"),
    v("POOLMGR_WAKE_LAMBDA_FUNCTION", "none", "reconcile function that claims, releases and hints wake (Lambda)"),
    v("POOLMGR_LAMBDA_ENDPOINT", "https://lambda.$AWS_REGION.amazonaws.com", "Lambda Invoke API endpoint"),
    v("POOLMGR_WAKE_DEBOUNCE_MS", "1000", "one process wakes the reconciler at most this often"),
    v("POOLMGR_AUTOSCALE_WINDOW_SECONDS", "60", "window autoscaling measures claims and refusals over"),
    v("POOLMGR_AUTOSCALE_DEFAULT_PROVISIONING_SECONDS", "30", "provisioning time assumed until measured"),
    v("POOLMGR_RECONCILE_DEADLINE_SECONDS", "50", "a pass stops starting work after this"),
    v("POOLMGR_RECONCILE_CONCURRENCY", "8", "pools one pass works on at once"),
    v("POOLMGR_RECONCILE_HOST_CONCURRENCY", "4", "flintlock MicroVM calls in flight per host per pass"),
    v("POOLMGR_RECONCILE_MAX_CREATES", "50", "new VMs one pass creates per pool at most"),
    v("POOLMGR_RECONCILE_FULL_CHECKS", "200", "pools each pass checks in full whatever the signals say"),
    v("POOLMGR_RECONCILE_SELECTION_MARGIN_MS", "1000", "how far before its watermark the selection looks"),
    v("POOLMGR_PROVISION_TIMEOUT_SECONDS", "300", "a VM still PENDING in flintlock after this has failed"),
    v("POOLMGR_PROVISION_MAX_ATTEMPTS", "5", "failed creates before a placement is given up"),
    v("POOLMGR_EXPIRY_WARNING_SECONDS", "30", "VM_EXPIRING_SOON this long before a lease expires"),
    v("POOLMGR_RECONCILE_BACKOFF_MS", "1000", "first retry delay of a failing VM step"),
    v(
        "POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS",
        "60",
        "longest retry delay; a host a pass could not reach gets no VMs this long",
    ),
    v("POOLMGR_ORPHAN_SCAN_SECONDS", "10", "interval between orphan scans of a host"),
    v("POOLMGR_HOST_DEAD_SECONDS", "30", "a host unreachable this long is judged dead"),
    v("POOLMGR_RECONCILE_INTERVAL_SECONDS", "2", "poolmgr-local: a reconcile loop at least this often"),
    v("POOLMGR_RECONCILE_INTERVAL_MS", "unset (the seconds apply)", "the same in milliseconds; wins when set"),
    v("POOLMGR_RECONCILE_TICKER", "on", "`off`: no reconciler inside poolmgr-local"),
    v("POOLMGR_RECONCILE_LOOP_INTERVAL_MS", "500", "pause between the passes of a loop while there is work"),
    v("POOLMGR_RECONCILE_LINGER_MS", "5000", "a loop keeps passing this long after its last work or wake"),
    v("POOLMGR_RECONCILE_LOOP_SECONDS", "600", "the longest one loop runs"),
    v(
        "POOLMGR_EVENTS_RETENTION",
        "7d",
        "events older than this are deleted (90s, 15m, 36h, 7d, 1h30m, a bare number of seconds; off)",
    ),
    v("POOLMGR_HOOK_TIMEOUT_SECONDS", "30", "limit of each hook command"),
    v("POOLMGR_GUEST_AGENT_TIMEOUT_SECONDS", "60", "how long a booted VM's guest agent may take to answer"),
    v("POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS", "15", "all the pre-lease commands of one claim together"),
    v("POOLMGR_CLAIM_VERIFY", "on", "a claim checks its VM with one GetMicroVM before writing the lease"),
    v("POOLMGR_CLAIM_VERIFY_TIMEOUT_MS", "2000", "the longest that check waits for the host"),
    v(
        "POOLMGR_CLAIM_ABANDON_SECONDS",
        "hook deadline + check + timeouts + 60 (92)",
        "a VM left claiming this long is deleted",
    ),
    v(
        "AWS_LAMBDA_FUNCTION_NAME",
        "set by AWS Lambda",
        "set: Lambda defaults (one connection, EMF metrics, no prepared claim)",
    ),
    v("AWS_REGION", "us-east-1 (set by AWS Lambda)", "region of the Lambda wake's endpoint and signature"),
];

/// `poolmgr-local`'s own.
pub const LOCAL: &[Var] = &[
    v("POOLMGR_HTTP_ADDR", "127.0.0.1:8080", "listen address"),
    v("POOLMGR_HTTP_MAX_CONNECTIONS", "1024", "connections served at once; more wait in the accept queue"),
    v("POOLMGR_HTTP_HEADER_TIMEOUT_SECONDS", "10", "a connection that sends no whole request head this long is closed"),
    v(
        "POOLMGR_LOCAL_FAULT_LOSE_CLAIM_ANSWER_EVERY",
        "unset (off)",
        "chaos runs and tests only: lose the answer of every N-th fresh claim after it committed",
    ),
];

/// Secrets Manager through the Parameters and Secrets extension (the Lambda functions and
/// `migrate` on AWS).
pub const SECRETS: &[Var] = &[
    v("POOLMGR_DATABASE_SECRET_ARN", "none", "read DATABASE_URL (a URL or RDS's JSON) from this secret"),
    v("POOLMGR_DATABASE_HOST", "the secret's", "override the database secret's host (the RDS Proxy endpoint)"),
    v("POOLMGR_DATABASE_PORT", "the secret's, else 5432", "override the database secret's port"),
    v("POOLMGR_DATABASE_NAME", "the secret's", "override the database secret's database name"),
    v("POOLMGR_TOKENS_SECRET_ARN", "none", "read the token lists from this secret"),
    v("POOLMGR_CREDENTIALS_SECRET_ARN", "none", "read the credentials keys from this secret"),
    v("POOLMGR_SECRETS_WAIT_MS", "5000", "how long one invocation keeps trying the secrets extension"),
];

/// `migrate`'s own.
pub const MIGRATE: &[Var] = &[
    v("POOLMGR_MIGRATE_CONNECT_WAIT_SECONDS", "0", "keep retrying the first connection this long"),
    v("POOLMGR_RUNTIME_DATABASE_USER", "none", "the functions' login to create or update, with DML grants only"),
    v("POOLMGR_RUNTIME_DATABASE_PASSWORD", "none", "its password"),
    v("POOLMGR_RUNTIME_DATABASE_SECRET_ARN", "none", "read that login from this secret (`{username, password}`)"),
];

/// Set by AWS Lambda, read by the functions on it.
pub const LAMBDA_RUNTIME: &[Var] = &[
    v("AWS_LAMBDA_RUNTIME_API", "set by AWS Lambda", "migrate: set, serve invocations instead of migrating once"),
    v("AWS_ACCESS_KEY_ID", "set by AWS Lambda", "the role's credentials, signing the reconcile wake"),
    v("AWS_SECRET_ACCESS_KEY", "set by AWS Lambda", "the role's credentials, signing the reconcile wake"),
    v("AWS_SESSION_TOKEN", "set by AWS Lambda", "the role's session, also for the secrets extension"),
    v("PARAMETERS_SECRETS_EXTENSION_HTTP_PORT", "2773", "the secrets extension's port"),
];

/// Logging (every binary).
pub const LOGGING: &[Var] = &[v(
    "RUST_LOG",
    "info",
    "log filter; JSON lines on stderr (the database and Lambda libraries stay at info at most)",
)];

/// The groups of `poolmgr-local`.
pub const POOLMGR_LOCAL: &[(&str, &[Var])] =
    &[("Database", DATABASE), ("Service", CONFIG), ("HTTP server", LOCAL), ("Logging", LOGGING)];

/// The groups of a Lambda function (`claims`, `leases`, `pools`, `hosts`, `events`, `reconcile`).
pub const FUNCTION: &[(&str, &[Var])] = &[
    ("Database", DATABASE),
    ("Service", CONFIG),
    ("Secrets (AWS)", SECRETS),
    ("Set by AWS Lambda", LAMBDA_RUNTIME),
    ("Logging", LOGGING),
];

/// The groups of `migrate`.
pub const MIGRATE_BIN: &[(&str, &[Var])] = &[
    ("Database", DATABASE),
    ("Migration", MIGRATE),
    ("Secrets (AWS)", SECRETS),
    ("Set by AWS Lambda", LAMBDA_RUNTIME),
    ("Logging", LOGGING),
];

/// Every variable of every table, once.
pub fn all_vars() -> Vec<Var> {
    let mut out: Vec<Var> = Vec::new();
    for table in [DATABASE, CONFIG, LOCAL, SECRETS, MIGRATE, LAMBDA_RUNTIME, LOGGING] {
        for var in table {
            if !out.iter().any(|o| o.name == var.name) {
                out.push(*var);
            }
        }
    }
    out
}

/// The flag of a variable: its name in lower case with `-`, without `POOLMGR_`
/// (`POOLMGR_DB_POOL_SIZE` → `--db-pool-size`).
pub fn flag(name: &str) -> String {
    name.trim_start_matches("POOLMGR_").to_ascii_lowercase().replace('_', "-")
}

/// The command of binary `bin`: `--help`, `--version`, and one option per variable of
/// `groups` (under the group's heading), read from the environment when not given.
pub fn command(bin: &'static str, about: &'static str, groups: &[(&'static str, &[Var])]) -> Command {
    let mut cmd = Command::new(bin)
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .long_version(format!("{} (schema version {})", env!("CARGO_PKG_VERSION"), crate::db::latest_version()))
        .after_help(
            "Every option is also read from the environment variable shown beside it (the usual way to \
             configure the service); an option given on the command line wins. Values are never shown.",
        );
    for (heading, vars) in groups {
        cmd = cmd.next_help_heading(*heading);
        for var in *vars {
            cmd = cmd.arg(
                Arg::new(var.name)
                    .long(flag(var.name))
                    .env(var.name)
                    .hide_env_values(true)
                    .value_name("VALUE")
                    .action(ArgAction::Set)
                    .help(format!("{} [default: {}]", var.help, var.default)),
            );
        }
    }
    cmd
}

/// The parsed command line and environment of a binary.
pub struct Args {
    matches: ArgMatches,
}

impl Args {
    /// Parses `args` (the first is the program); `--help`, `--version` and a bad argument come
    /// back as clap's error, to print and exit with.
    pub fn try_parse_from<I, T>(cmd: Command, args: I) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        cmd.try_get_matches_from(args).map(|matches| Args { matches })
    }

    /// The process's command line and environment: prints the help or the version and exits 0,
    /// or prints a bad argument's error and exits 2, before anything starts.
    pub fn parse(bin: &'static str, about: &'static str, groups: &[(&'static str, &[Var])]) -> Args {
        Args { matches: command(bin, about, groups).get_matches() }
    }

    /// As [`Args::parse`], for a binary that reads its configuration from the environment
    /// itself (through the secrets on Lambda): an option on the command line would be ignored
    /// there, so it is refused, naming the variable to set instead.
    pub fn parse_env_only(bin: &'static str, about: &'static str, groups: &[(&'static str, &[Var])]) {
        let args = Args::parse(bin, about, groups);
        if let Some(name) = args.given_on_command_line().first() {
            eprintln!(
                "error: {bin} reads its configuration from the environment only: set {name} instead of --{}",
                flag(name)
            );
            std::process::exit(2);
        }
    }

    /// The variables given as options on the command line.
    pub fn given_on_command_line(&self) -> Vec<&str> {
        self.matches
            .ids()
            .map(|id| id.as_str())
            .filter(|id| self.matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .collect()
    }

    /// The value of variable `name`: the option if given, else the environment's. Every
    /// reader of the binary's configuration reads through this; a name no table of the
    /// binary lists fails in debug builds (the tests), and reads the environment in release.
    pub fn get(&self, name: &str) -> Option<String> {
        match self.matches.try_get_one::<String>(name) {
            Ok(v) => v.cloned(),
            Err(_) => {
                debug_assert!(false, "{name} is read but no table of this binary lists it (functions/core/src/cli.rs)");
                std::env::var(name).ok()
            }
        }
    }

    /// [`Args::get`] as the lookup closure the configuration readers take.
    pub fn lookup(&self) -> impl Fn(&str) -> Option<String> + '_ {
        move |name| self.get(name)
    }
}

/// Whether `name` is a variable [`crate::config::Config::from_lookup`] may read.
pub fn config_reads(name: &str) -> bool {
    DATABASE.iter().chain(CONFIG).any(|v| v.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::BTreeSet;

    /// Every variable `Config::from_lookup` asks for is in [`DATABASE`] or [`CONFIG`], and every
    /// one of those is asked for: the tables are the reader's list, not a copy beside it.
    #[test]
    fn the_config_reads_exactly_the_database_and_config_tables() {
        let asked = RefCell::new(BTreeSet::new());
        let c = crate::config::Config::from_lookup(|k| {
            asked.borrow_mut().insert(k.to_owned());
            match k {
                "DATABASE_URL" => Some("postgres://x".to_owned()),
                "POOLMGR_AUTH" => Some("disabled".to_owned()),
                _ => None,
            }
        });
        assert!(c.is_ok(), "{c:?}");
        let tables: BTreeSet<String> = DATABASE.iter().chain(CONFIG).map(|v| v.name.to_owned()).collect();
        assert_eq!(asked.into_inner(), tables);
    }

    /// The secrets step asks only for variables of [`SECRETS`], [`MIGRATE`] and
    /// [`LAMBDA_RUNTIME`] (with no secret configured it fetches nothing).
    #[tokio::test]
    async fn the_secrets_step_reads_only_variables_of_its_tables() {
        let asked = RefCell::new(BTreeSet::new());
        let out = crate::secrets::resolve_env(|k| {
            asked.borrow_mut().insert(k.to_owned());
            None
        })
        .await
        .unwrap();
        assert!(out.is_empty());
        let asked = asked.into_inner();
        assert!(asked.len() >= 4, "{asked:?}");
        for k in &asked {
            assert!(SECRETS.iter().chain(MIGRATE).chain(LAMBDA_RUNTIME).any(|v| v.name == k), "{k} is in no table");
        }
    }

    /// `--help` lists every variable of the binary with its default and never a value;
    /// `--version` answers too; both are clap's "exit now" answers, not a parse.
    #[test]
    fn help_lists_every_variable_with_its_default_and_hides_values() {
        let cmd = command("poolmgr-local", "test", POOLMGR_LOCAL);
        let err = Args::try_parse_from(cmd.clone(), ["poolmgr-local", "--help"]).err().expect("--help stops");
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayHelp);
        let help = err.render().to_string();
        for (_, vars) in POOLMGR_LOCAL {
            for var in *vars {
                assert!(help.contains(&format!("[env: {}", var.name)), "{} missing:\n{help}", var.name);
                assert!(help.contains(&format!("[default: {}]", var.default)), "{}'s default missing", var.name);
            }
        }
        assert!(help.contains("POOLMGR_RECONCILE_MAX_CREATES") && help.contains("--db-pool-size"));
        let err = Args::try_parse_from(cmd.clone(), ["poolmgr-local", "--version"]).err().expect("--version stops");
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayVersion);
        // Options win over the environment; unknown ones are refused.
        let args = Args::try_parse_from(cmd.clone(), ["poolmgr-local", "--db-pool-size", "3"]).unwrap();
        assert_eq!(args.get("POOLMGR_DB_POOL_SIZE").as_deref(), Some("3"));
        assert_eq!(args.given_on_command_line(), ["POOLMGR_DB_POOL_SIZE"]);
        assert!(Args::try_parse_from(cmd, ["poolmgr-local", "--no-such-thing"]).is_err());
    }

    /// No two variables share a flag, and no table lists a variable twice.
    #[test]
    fn every_variable_has_its_own_flag() {
        for groups in [POOLMGR_LOCAL, FUNCTION, MIGRATE_BIN] {
            let mut flags = BTreeSet::new();
            for (_, vars) in groups {
                for var in *vars {
                    assert!(flags.insert(flag(var.name)), "{} twice", var.name);
                }
            }
        }
        command("x", "x", POOLMGR_LOCAL).debug_assert();
        command("x", "x", FUNCTION).debug_assert();
        command("x", "x", MIGRATE_BIN).debug_assert();
    }

    /// The README's configuration table names every variable an operator sets (those AWS
    /// Lambda sets itself aside), and nothing the binaries do not read.
    #[test]
    fn the_readme_configuration_table_names_every_variable() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
        let section = readme.split("\n## Configuration\n").nth(1).expect("a Configuration section");
        let section = section.split("\n## ").next().unwrap();
        let mut documented = BTreeSet::new();
        for row in section.lines().filter(|l| l.starts_with("| `")) {
            let first = row.split('|').nth(1).unwrap();
            for name in first.split('`').skip(1).step_by(2) {
                documented.insert(name.to_owned());
            }
        }
        let read: BTreeSet<String> = all_vars()
            .iter()
            .filter(|v| !v.name.starts_with("AWS_") && !LAMBDA_RUNTIME.iter().any(|l| l.name == v.name))
            .map(|v| v.name.to_owned())
            .collect();
        let missing: Vec<_> = read.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&read).collect();
        assert!(missing.is_empty(), "README's configuration table lacks {missing:?}");
        assert!(extra.is_empty(), "README's configuration table names what no binary reads: {extra:?}");
    }
}
