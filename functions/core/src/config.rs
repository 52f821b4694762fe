//! Configuration from the environment, read once at start by each binary.
//!
//! Every knob has a default that suits the local stack; Lambda deployments set the rest
//! (`infra/`). Parsing goes through a lookup closure so tests never touch the process
//! environment.

use std::time::Duration;

use crate::auth::{AuthConfig, Role, TokenEntry};
use crate::db_tls::DbTls;

#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

#[derive(Debug, Clone)]
pub struct Config {
    /// PostgreSQL URL (`DATABASE_URL`).
    pub database_url: String,
    /// TLS to PostgreSQL: the `sslmode` of a URL that names none (`POOLMGR_DATABASE_SSLMODE`;
    /// unset: `prefer` on loopback or a Unix socket, else `verify-full`) and the CA to trust (`POOLMGR_DATABASE_CA_PEM`, else the compiled-in roots).
    pub db_tls: DbTls,
    /// Connections per process (`POOLMGR_DB_POOL_SIZE`). A Lambda instance serves one request
    /// at a time and needs 1-2; the local server shares one pool across all routes.
    pub db_pool_size: usize,
    /// How long to wait for a connection (`POOLMGR_DB_CONNECT_TIMEOUT_SECONDS`).
    pub db_connect_timeout: Duration,
    /// A pooled connection unused for this long is checked with one round trip before it is
    /// handed out, and replaced if dead (`POOLMGR_DB_CHECK_IDLE_SECONDS`, 1): after a Lambda
    /// thaw, a database restart or a proxy's idle timeout the socket may be gone.
    pub db_check_idle: Duration,
    /// Client-side limit of every store statement; past it the request answers 503 and a
    /// cancel is sent (`POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS`, 10; 0 = none).
    pub db_statement_timeout: Option<Duration>,
    /// Whether a statement past the timeout gets a cancel request
    /// (`POOLMGR_DB_CANCEL_ON_TIMEOUT`, true; set false in front of PgBouncer < 1.19).
    pub db_cancel_on_timeout: bool,
    /// Whether the claim's call is prepared once per connection and reused
    /// (`POOLMGR_DB_PREPARE_CLAIM`; true, false on Lambda). The claim's expensive plans live
    /// in its server-side function and are kept per server connection either way (V10);
    /// preparing the call saves only its parse and plan. A named prepared statement lives on
    /// one server connection, which a transaction pooler (PgBouncer < 1.21, possibly RDS
    /// Proxy) does not keep: set false behind one.
    pub db_prepare_claim: bool,
    /// Running on AWS Lambda (`AWS_LAMBDA_FUNCTION_NAME` is set).
    pub on_lambda: bool,
    /// Counters and histograms are also written as CloudWatch Embedded Metric Format lines on
    /// stdout (`POOLMGR_METRICS_FORMAT=emf`; the default on Lambda, else `prometheus`).
    pub metrics_emf: bool,
    /// Their CloudWatch namespace (`POOLMGR_METRICS_NAMESPACE`, default `poolmgr`); the AWS
    /// template sets `poolmgr/<stack name>` so two stacks in one region keep apart.
    pub metrics_namespace: String,
    /// Timeout of every flintlock RPC (`POOLMGR_FLINTLOCK_TIMEOUT_SECONDS`).
    pub flintlock_timeout: Duration,
    /// How long an instance keeps the principals' scopes and quotas before it reads them
    /// again (`POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS`, 5): how soon an admin's change applies.
    pub principal_limits_cache: Duration,
    /// How long an instance answers `/readyz` and `/healthz` from its last check
    /// (`POOLMGR_HEALTH_CACHE_SECONDS`, 2; 0 checks on every probe): the unauthenticated
    /// probes cost the database at most one query per instance per period, however hard
    /// they are hit.
    pub health_cache: Duration,
    pub auth: AuthConfig,
    /// flintlock namespaces poolmgr owns start with this
    /// (`POOLMGR_FLINTLOCK_NAMESPACE_PREFIX`, `poolmgr-`); a deployment's are
    /// `<prefix><deployment id>-<pool namespace>`. VMs in other namespaces are never touched.
    pub flintlock_namespace_prefix: String,
    /// This deployment's id (`POOLMGR_DEPLOYMENT_ID`: 1-20 lowercase letters and digits).
    /// Unset (the default): the id the database generated once (migration V9), which every
    /// function of the deployment reads and no other deployment (another database) shares.
    /// Set it only to choose a readable id; every reconcile function of the deployment must
    /// then use the same one.
    pub deployment_id: Option<String>,
    /// What a pool's template may ask of a host (`POOLMGR_POLICY_*`, [`crate::policy`]).
    pub spec_policy: crate::policy::SpecPolicy,
    /// The keys hosts' secrets are encrypted with at rest (`POOLMGR_CREDENTIALS_KEY`,
    /// `POOLMGR_CREDENTIALS_OLD_KEYS`; [`crate::credentials`]). Empty: hosts with secrets
    /// are refused.
    pub credentials: std::sync::Arc<crate::credentials::Keyring>,
    pub reconcile: ReconcileConfig,
    pub hooks: HookConfig,
    pub wake: WakeConfig,
    pub autoscale: AutoscaleConfig,
}

/// Where a claim, a release or a demand hint wakes the reconciler (`crate::wake`).
#[derive(Debug, Clone)]
pub struct WakeConfig {
    /// The reconcile function to invoke asynchronously (`POOLMGR_WAKE_LAMBDA_FUNCTION`: a
    /// name or ARN; the AWS template sets it on every HTTP function and on the reconcile
    /// function itself, which hands a loop on to a fresh invocation). Unset: no Lambda wake
    /// (poolmgr-local wakes its own ticker).
    pub lambda_function: Option<String>,
    /// The Lambda Invoke API's endpoint (`POOLMGR_LAMBDA_ENDPOINT`; default
    /// `https://lambda.{AWS_REGION}.amazonaws.com`).
    pub lambda_endpoint: Option<String>,
    /// `AWS_REGION` (Lambda sets it), for the endpoint and the signature.
    pub region: String,
    /// One process wakes at most once per this (`POOLMGR_WAKE_DEBOUNCE_MS`, 1000). Must stay
    /// below the reconcile loop's linger, so a debounced wake is covered by the one before.
    pub debounce: Duration,
}

/// Knobs of demand-based sizing (`reconcile::sizing`).
#[derive(Debug, Clone)]
pub struct AutoscaleConfig {
    /// The window claim and refusal rates are measured over (`POOLMGR_AUTOSCALE_WINDOW_SECONDS`,
    /// 60).
    pub window: Duration,
    /// The provisioning time assumed for a pool none of whose VMs became AVAILABLE recently
    /// (`POOLMGR_AUTOSCALE_DEFAULT_PROVISIONING_SECONDS`, 30).
    pub default_provisioning: Duration,
}

/// Knobs of create and pre-lease hooks.
#[derive(Debug, Clone)]
pub struct HookConfig {
    /// Limit of each hook command, enforced by the guest agent and by our client deadline
    /// (`POOLMGR_HOOK_TIMEOUT_SECONDS`, 30).
    pub command_timeout: Duration,
    /// How long a created VM may take until its guest agent answers
    /// (`POOLMGR_GUEST_AGENT_TIMEOUT_SECONDS`, 60).
    pub guest_agent_timeout: Duration,
    /// How long all the pre-lease commands of one claim may take together
    /// (`POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS`, 15). Each command gets at most what is left of
    /// it; past it the hook has failed (the pool's hook-failure policy). Keep it well below
    /// the claims function's timeout (30 s in `infra/template.yaml`): the lease is written
    /// after the hooks, and a function killed at its timeout leaves the VM to the abandon
    /// sweep.
    pub claim_hook_deadline: Duration,
    /// A VM in PRE_LEASE_HOOK_RUNNING for longer was abandoned by a claim that died
    /// mid-hook; the reconciler deletes it (`POOLMGR_CLAIM_ABANDON_SECONDS`). Must exceed
    /// [`HookConfig::longest_claim_hold`], or the sweep would delete VMs under live claims:
    /// such a value is refused at start. Unset, it is that bound plus a minute.
    pub claim_abandon_after: Duration,
    /// A claim asks the VM's host for the microVM before it answers (`POOLMGR_CLAIM_VERIFY`,
    /// on; issue 23 finding 1): a microVM lost with a host reboot or deleted behind poolmgr's
    /// back is never handed out. Such claims take the two-phase path of a pre-lease hook.
    /// Off: the one-statement claim, which never calls flintlock.
    pub claim_verify: bool,
    /// The longest that check may take (`POOLMGR_CLAIM_VERIFY_TIMEOUT_MS`, 2000); past it the
    /// host counts as unreachable: the VM goes back and the claim answers 503.
    pub claim_verify_timeout: Duration,
}

/// Slack added to [`HookConfig::longest_claim_hold`] for the default abandon period.
pub const CLAIM_ABANDON_SLACK: Duration = Duration::from_secs(60);

impl HookConfig {
    /// The longest a live claim keeps a VM in PRE_LEASE_HOOK_RUNNING: its hooks' deadline,
    /// the check of its host when a command outlived it (`claim_verify_timeout`), then a
    /// connection and one statement for the lease (`statement_timeout`; `None`, no
    /// client-side limit, counts as 30 s).
    pub fn longest_claim_hold(&self, connect_timeout: Duration, statement_timeout: Option<Duration>) -> Duration {
        self.claim_hook_deadline
            + self.claim_verify_timeout
            + connect_timeout
            + statement_timeout.unwrap_or(Duration::from_secs(30))
    }
}

/// Knobs of the reconcile pass.
#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    /// A pass stops starting work after this (`POOLMGR_RECONCILE_DEADLINE_SECONDS`, 50).
    pub deadline: Duration,
    /// Pools worked on at once by one pass (`POOLMGR_RECONCILE_CONCURRENCY`, 8).
    pub concurrency: usize,
    /// A VM still PENDING in flintlock this long after its row was created has failed
    /// (`POOLMGR_PROVISION_TIMEOUT_SECONDS`, 300).
    pub provision_timeout: Duration,
    /// VM_EXPIRING_SOON is written this long before a lease expires
    /// (`POOLMGR_EXPIRY_WARNING_SECONDS`, 30).
    pub warning_window: Duration,
    /// First retry delay of a failing VM step, doubled per attempt up to `backoff_cap`
    /// (`POOLMGR_RECONCILE_BACKOFF_MS`, 1000; `POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS`, 60).
    /// A host a pass found unreachable also gets no new VMs for `backoff_cap`.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Failed attempts after which a uid-less intent row on an unreachable host is dropped
    /// (and replaced elsewhere) (`POOLMGR_PROVISION_MAX_ATTEMPTS`, 5).
    pub max_create_attempts: i32,
    /// New VMs one pass creates per pool at most (`POOLMGR_RECONCILE_MAX_CREATES`, 50).
    pub max_creates_per_pool: usize,
    /// Interval between orphan scans of a host (`POOLMGR_ORPHAN_SCAN_SECONDS`, 10).
    pub orphan_scan_interval: Duration,
    /// A host that every call has found unreachable for this long is judged dead
    /// (`POOLMGR_HOST_DEAD_SECONDS`, 30, at least 1): the pass retires its rows (DELETING,
    /// or dropped when they have no uid) so they stop counting as their pools' VMs, and
    /// replacements go to the other hosts (issue 23 finding 2).
    pub host_dead_after: Duration,
    /// flintlock MicroVM calls (create, get, list, delete) one pass has in flight per host at
    /// most, across its pool workers (`POOLMGR_RECONCILE_HOST_CONCURRENCY`, 4). A host that
    /// stops answering holds at most this many calls until the flintlock timeout; the first
    /// to fail marks it sick for the rest of the pass and the calls queued behind are skipped.
    pub host_concurrency: usize,
    /// `poolmgr-local`'s ticker interval (`POOLMGR_RECONCILE_INTERVAL_SECONDS`, 2; or
    /// `POOLMGR_RECONCILE_INTERVAL_MS`, which wins): the local stand-in for the schedule.
    pub interval: Duration,
    /// Whether poolmgr-local runs its reconciler at all (`POOLMGR_RECONCILE_TICKER`, `on`;
    /// `off` for the deployed shape, where a separate reconcile function does).
    pub ticker: bool,
    /// Pause between the passes of a reconcile loop while there is work
    /// (`POOLMGR_RECONCILE_LOOP_INTERVAL_MS`, 500): what a booting VM waits at most, past its
    /// boot, to be found CREATED (`reconcile::driver`).
    pub loop_interval: Duration,
    /// How long a loop keeps passing after its last pass with work or its last wake
    /// (`POOLMGR_RECONCILE_LINGER_MS`, 5000). Above the wake debounce.
    pub linger: Duration,
    /// The longest one loop runs (`POOLMGR_RECONCILE_LOOP_SECONDS`, 600); on Lambda it also
    /// ends a pass deadline and a margin before the invocation's own deadline, and hands on.
    pub loop_budget: Duration,
    /// Events older than this are deleted by the reconcile pass, in batches
    /// (`POOLMGR_EVENTS_RETENTION`: `7d` by default; a humantime duration such as `90s`, `36h`,
    /// `7d` or `1h30m`, a bare number is seconds; `off` keeps events forever, `None`).
    pub events_retention: Option<Duration>,
    /// Pools every pass checks in full (counts their VMs) whatever the selection's signals
    /// say, in key order from where the last pass stopped (`POOLMGR_RECONCILE_FULL_CHECKS`,
    /// 200): a transition no signal covers is found within ceil(pools / this) passes. 0 turns
    /// the full checks off (tests of the signals alone).
    pub full_checks: i64,
    /// How far before the watermark the selection looks for VM writes and pool steps
    /// (`POOLMGR_RECONCILE_SELECTION_MARGIN_MS`, 1000): for a transaction the watermark's
    /// horizon cannot see (another role's; one starting in the instant the horizon is read).
    pub selection_margin: Duration,
}

fn parse_switch(lookup: &impl Fn(&str) -> Option<String>, key: &str, default: bool) -> Result<bool, ConfigError> {
    match lookup(key).as_deref().map(str::trim) {
        None | Some("") => Ok(default),
        Some("on" | "true" | "1" | "yes") => Ok(true),
        Some("off" | "false" | "0" | "no") => Ok(false),
        Some(other) => Err(ConfigError(format!("{key} must be on or off, got {other:?}"))),
    }
}

fn parse_num<T: std::str::FromStr>(
    lookup: &impl Fn(&str) -> Option<String>,
    key: &str,
    default: T,
) -> Result<T, ConfigError> {
    match lookup(key) {
        None => Ok(default),
        Some(v) if v.trim().is_empty() => Ok(default),
        Some(v) => v.trim().parse().map_err(|_| ConfigError(format!("{key}={v:?} is not a valid number"))),
    }
}

/// A duration in humantime's form (`90s`, `15m`, `36h`, `7d`, `1h30m`, `2days`; a bare number is
/// seconds, as before humantime), or `off` (`None`). Zero is refused: it would mean "delete at
/// once", never what anyone wants.
fn parse_retention(
    lookup: &impl Fn(&str) -> Option<String>,
    key: &str,
    default: Duration,
) -> Result<Option<Duration>, ConfigError> {
    let raw = match lookup(key) {
        None => return Ok(Some(default)),
        Some(v) if v.trim().is_empty() => return Ok(Some(default)),
        Some(v) => v,
    };
    let v = raw.trim();
    if v.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let parsed = if v.bytes().all(|b| b.is_ascii_digit()) {
        v.parse::<u64>().ok().map(Duration::from_secs)
    } else {
        humantime::parse_duration(v).ok()
    };
    match parsed {
        // At least a second: a retention of milliseconds would prune events as they are written.
        Some(d) if d >= Duration::from_secs(1) => Ok(Some(d)),
        _ => Err(ConfigError(format!(
            "{key}={raw:?}: use a duration of at least a second such as 90s, 15m, 36h, 7d or 1h30m (a bare number is seconds), or off"
        ))),
    }
}

/// The entries of a comma-separated token list (`var`), each with where it was configured
/// (`POOLMGR_CLIENT_TOKENS entry 2`, counting non-empty entries from 1) for the errors,
/// which never echo a token.
fn parse_tokens(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &str,
    role: Role,
) -> Result<Vec<(String, TokenEntry)>, ConfigError> {
    lookup(var)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, entry)| {
            let at = format!("{var} entry {}", i + 1);
            TokenEntry::parse(entry, role).map(|t| (at.clone(), t)).map_err(|e| ConfigError(format!("{at} {e}")))
        })
        .collect()
}

/// The hook knobs; refuses an abandon period a live claim could outlive.
fn hook_config(
    lookup: &impl Fn(&str) -> Option<String>,
    connect_timeout: Duration,
    statement_timeout: Option<Duration>,
) -> Result<HookConfig, ConfigError> {
    let mut hooks = HookConfig {
        command_timeout: Duration::from_secs(parse_num(lookup, "POOLMGR_HOOK_TIMEOUT_SECONDS", 30u64)?.max(1)),
        guest_agent_timeout: Duration::from_secs(parse_num(lookup, "POOLMGR_GUEST_AGENT_TIMEOUT_SECONDS", 60u64)?),
        claim_hook_deadline: Duration::from_secs(parse_num(lookup, "POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS", 15u64)?),
        claim_abandon_after: Duration::ZERO,
        claim_verify: parse_switch(lookup, "POOLMGR_CLAIM_VERIFY", true)?,
        claim_verify_timeout: Duration::from_millis(
            parse_num(lookup, "POOLMGR_CLAIM_VERIFY_TIMEOUT_MS", 2000u64)?.max(1),
        ),
    };
    if hooks.claim_hook_deadline.is_zero() {
        return Err(ConfigError("POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS must be at least 1".into()));
    }
    let hold = hooks.longest_claim_hold(connect_timeout, statement_timeout);
    hooks.claim_abandon_after = match lookup("POOLMGR_CLAIM_ABANDON_SECONDS").filter(|v| !v.trim().is_empty()) {
        None => hold + CLAIM_ABANDON_SLACK,
        Some(_) => {
            let set = Duration::from_secs(parse_num(lookup, "POOLMGR_CLAIM_ABANDON_SECONDS", 0u64)?);
            if set <= hold {
                return Err(ConfigError(format!(
                    "POOLMGR_CLAIM_ABANDON_SECONDS={} is not above the longest a live claim holds a VM in \
                     PRE_LEASE_HOOK_RUNNING ({} s: POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS {} + the connect and \
                     statement timeouts of its lease write): the reconciler would delete VMs whose claim \
                     is still running; raise it or lower the hook deadline",
                    set.as_secs(),
                    hold.as_secs(),
                    hooks.claim_hook_deadline.as_secs(),
                )));
            }
            set
        }
    };
    Ok(hooks)
}

/// A CloudWatch namespace: 1-255 of letters, digits and `. - _ / # :` (and spaces), not
/// starting with `AWS/` (reserved for AWS's own).
fn check_metrics_namespace(ns: String) -> Result<String, ConfigError> {
    let ok_chars = ns.chars().all(|c| c.is_ascii_alphanumeric() || ".-_/#: ".contains(c));
    if ns.len() > 255 || !ok_chars || ns.starts_with("AWS/") {
        return Err(ConfigError(format!(
            "POOLMGR_METRICS_NAMESPACE={ns:?} is not a CloudWatch namespace: at most 255 letters, digits and \
             . - _ / # : (not starting with AWS/), e.g. poolmgr/my-stack"
        )));
    }
    Ok(ns)
}

impl Config {
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        // Every variable read here is listed, with its default, in `cli::DATABASE` or
        // `cli::CONFIG` (what `--help` shows and poolmgr-local's reader serves).
        let lookup = move |k: &str| {
            debug_assert!(crate::cli::config_reads(k), "{k} is read but not listed in functions/core/src/cli.rs");
            lookup(k)
        };
        let database_url = lookup("DATABASE_URL").filter(|s| !s.is_empty()).ok_or_else(|| {
            ConfigError("DATABASE_URL is not set: point it at PostgreSQL (scripts/dev.sh starts one)".into())
        })?;
        let disabled = match lookup("POOLMGR_AUTH").as_deref().map(str::trim) {
            None | Some("") | Some("enabled") => false,
            Some("disabled") => true,
            Some(other) => {
                return Err(ConfigError(format!("POOLMGR_AUTH={other:?}: use \"enabled\" or \"disabled\"")));
            }
        };
        let on_lambda = lookup("AWS_LAMBDA_FUNCTION_NAME").is_some_and(|s| !s.trim().is_empty());
        if disabled && on_lambda {
            // Served as admin without a token is for a developer's machine, never a deployed API.
            return Err(ConfigError(
                "POOLMGR_AUTH=disabled is refused on AWS Lambda (AWS_LAMBDA_FUNCTION_NAME is set): it would serve \
                 everyone as admin without a token. Remove POOLMGR_AUTH and configure tokens: POOLMGR_ADMIN_TOKENS \
                 and/or POOLMGR_CLIENT_TOKENS, or POOLMGR_TOKENS_SECRET_ARN"
                    .into(),
            ));
        }
        let mut tokens = parse_tokens(&lookup, "POOLMGR_ADMIN_TOKENS", Role::Admin)?;
        tokens.extend(parse_tokens(&lookup, "POOLMGR_VIEWER_TOKENS", Role::Viewer)?);
        tokens.extend(parse_tokens(&lookup, "POOLMGR_CLIENT_TOKENS", Role::Client)?);
        crate::auth::check_distinct(&tokens).map_err(ConfigError)?;
        let tokens: Vec<TokenEntry> = tokens.into_iter().map(|(_, t)| t).collect();
        if !disabled && tokens.is_empty() {
            return Err(ConfigError(
                "no API tokens: set POOLMGR_ADMIN_TOKENS, POOLMGR_VIEWER_TOKENS and/or POOLMGR_CLIENT_TOKENS (comma-separated, each `token` or `name:token`), or POOLMGR_AUTH=disabled for local development".into(),
            ));
        }
        // A Lambda execution environment serves one request at a time: one connection each.
        let db_pool_size = parse_num(&lookup, "POOLMGR_DB_POOL_SIZE", if on_lambda { 1usize } else { 16 })?;
        if db_pool_size == 0 {
            return Err(ConfigError("POOLMGR_DB_POOL_SIZE must be at least 1".into()));
        }
        let metrics_emf = match lookup("POOLMGR_METRICS_FORMAT").as_deref().map(str::trim) {
            None | Some("") => on_lambda,
            Some("emf") => true,
            Some("prometheus") => false,
            Some(other) => {
                return Err(ConfigError(format!("POOLMGR_METRICS_FORMAT={other:?}: use \"emf\" or \"prometheus\"")));
            }
        };
        let metrics_namespace =
            match lookup("POOLMGR_METRICS_NAMESPACE").map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()) {
                None => crate::metrics::EMF_NAMESPACE.to_owned(),
                Some(ns) => check_metrics_namespace(ns)?,
            };
        let statement_timeout = parse_num(&lookup, "POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS", 10u64)?;
        let db_statement_timeout = (statement_timeout > 0).then(|| Duration::from_secs(statement_timeout));
        let db_connect_timeout = Duration::from_secs(parse_num(&lookup, "POOLMGR_DB_CONNECT_TIMEOUT_SECONDS", 5u64)?);
        let hooks = hook_config(&lookup, db_connect_timeout, db_statement_timeout)?;
        let db_tls = DbTls::from_lookup(&lookup).map_err(ConfigError)?;
        Ok(Config {
            database_url,
            db_tls,
            db_pool_size,
            db_connect_timeout,
            db_check_idle: Duration::from_secs(parse_num(&lookup, "POOLMGR_DB_CHECK_IDLE_SECONDS", 1u64)?),
            db_statement_timeout,
            db_cancel_on_timeout: !matches!(
                lookup("POOLMGR_DB_CANCEL_ON_TIMEOUT").as_deref().map(str::trim),
                Some("false" | "0" | "no")
            ),
            db_prepare_claim: match lookup("POOLMGR_DB_PREPARE_CLAIM").as_deref().map(str::trim) {
                None | Some("") => !on_lambda,
                Some("true" | "1" | "yes") => true,
                Some("false" | "0" | "no") => false,
                Some(other) => {
                    return Err(ConfigError(format!("POOLMGR_DB_PREPARE_CLAIM must be true or false, got {other:?}")));
                }
            },
            on_lambda,
            metrics_emf,
            metrics_namespace,
            flintlock_timeout: Duration::from_secs(parse_num(&lookup, "POOLMGR_FLINTLOCK_TIMEOUT_SECONDS", 10u64)?),
            principal_limits_cache: Duration::from_secs(
                parse_num(&lookup, "POOLMGR_PRINCIPAL_LIMITS_CACHE_SECONDS", 5u64)?.min(300),
            ),
            health_cache: Duration::from_secs(parse_num(&lookup, "POOLMGR_HEALTH_CACHE_SECONDS", 2u64)?.min(60)),
            auth: AuthConfig { disabled, tokens },
            flintlock_namespace_prefix: lookup("POOLMGR_FLINTLOCK_NAMESPACE_PREFIX")
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "poolmgr-".into()),
            deployment_id: match lookup("POOLMGR_DEPLOYMENT_ID").map(|s| s.trim().to_owned()) {
                None => None,
                Some(id) if id.is_empty() => None,
                Some(id) => {
                    crate::deployment::validate_deployment_id(&id)
                        .map_err(|e| ConfigError(format!("POOLMGR_DEPLOYMENT_ID: {e}")))?;
                    Some(id)
                }
            },
            hooks,
            spec_policy: crate::policy::SpecPolicy::from_lookup(&lookup)?,
            credentials: std::sync::Arc::new(crate::credentials::Keyring::from_lookup(&lookup).map_err(ConfigError)?),
            wake: WakeConfig {
                lambda_function: lookup("POOLMGR_WAKE_LAMBDA_FUNCTION")
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty()),
                lambda_endpoint: lookup("POOLMGR_LAMBDA_ENDPOINT")
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty()),
                region: lookup("AWS_REGION").filter(|s| !s.is_empty()).unwrap_or_else(|| "us-east-1".into()),
                debounce: Duration::from_millis(parse_num(&lookup, "POOLMGR_WAKE_DEBOUNCE_MS", 1000u64)?),
            },
            autoscale: AutoscaleConfig {
                window: Duration::from_secs_f64(
                    parse_num(&lookup, "POOLMGR_AUTOSCALE_WINDOW_SECONDS", 60f64)?.clamp(0.1, 3600.0),
                ),
                default_provisioning: Duration::from_secs_f64(
                    parse_num(&lookup, "POOLMGR_AUTOSCALE_DEFAULT_PROVISIONING_SECONDS", 30f64)?.clamp(0.01, 3600.0),
                ),
            },
            reconcile: ReconcileConfig {
                deadline: Duration::from_secs(parse_num(&lookup, "POOLMGR_RECONCILE_DEADLINE_SECONDS", 50u64)?),
                concurrency: parse_num(&lookup, "POOLMGR_RECONCILE_CONCURRENCY", 8usize)?.max(1),
                provision_timeout: Duration::from_secs(parse_num(
                    &lookup,
                    "POOLMGR_PROVISION_TIMEOUT_SECONDS",
                    300u64,
                )?),
                warning_window: Duration::from_secs(parse_num(&lookup, "POOLMGR_EXPIRY_WARNING_SECONDS", 30u64)?),
                backoff_base: Duration::from_millis(parse_num(&lookup, "POOLMGR_RECONCILE_BACKOFF_MS", 1000u64)?),
                backoff_cap: Duration::from_secs(parse_num(&lookup, "POOLMGR_RECONCILE_BACKOFF_CAP_SECONDS", 60u64)?),
                max_create_attempts: parse_num(&lookup, "POOLMGR_PROVISION_MAX_ATTEMPTS", 5i32)?,
                max_creates_per_pool: parse_num(&lookup, "POOLMGR_RECONCILE_MAX_CREATES", 50usize)?,
                orphan_scan_interval: Duration::from_secs(parse_num(&lookup, "POOLMGR_ORPHAN_SCAN_SECONDS", 10u64)?),
                host_dead_after: Duration::from_secs(parse_num(&lookup, "POOLMGR_HOST_DEAD_SECONDS", 30u64)?.max(1)),
                host_concurrency: parse_num(&lookup, "POOLMGR_RECONCILE_HOST_CONCURRENCY", 4usize)?.max(1),
                interval: match parse_num(&lookup, "POOLMGR_RECONCILE_INTERVAL_MS", 0u64)? {
                    0 => Duration::from_secs(parse_num(&lookup, "POOLMGR_RECONCILE_INTERVAL_SECONDS", 2u64)?.max(1)),
                    ms => Duration::from_millis(ms.max(10)),
                },
                ticker: parse_switch(&lookup, "POOLMGR_RECONCILE_TICKER", true)?,
                loop_interval: Duration::from_millis(
                    parse_num(&lookup, "POOLMGR_RECONCILE_LOOP_INTERVAL_MS", 500u64)?.max(10),
                ),
                linger: Duration::from_millis(parse_num(&lookup, "POOLMGR_RECONCILE_LINGER_MS", 5000u64)?),
                loop_budget: Duration::from_secs(parse_num(&lookup, "POOLMGR_RECONCILE_LOOP_SECONDS", 600u64)?),
                events_retention: parse_retention(
                    &lookup,
                    "POOLMGR_EVENTS_RETENTION",
                    Duration::from_secs(7 * 86_400),
                )?,
                full_checks: parse_num(&lookup, "POOLMGR_RECONCILE_FULL_CHECKS", 200i64)?.max(0),
                selection_margin: Duration::from_millis(parse_num(
                    &lookup,
                    "POOLMGR_RECONCILE_SELECTION_MARGIN_MS",
                    1000u64,
                )?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(move |k| m.get(k).cloned())
    }

    #[test]
    fn tokens_are_required_unless_auth_is_disabled() {
        let err = cfg(&[("DATABASE_URL", "postgres://x")]).unwrap_err();
        assert!(err.to_string().contains("POOLMGR_ADMIN_TOKENS"));
        let c = cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")]).unwrap();
        assert!(c.auth.disabled);
        let c = cfg(&[
            ("DATABASE_URL", "postgres://x"),
            ("POOLMGR_CLIENT_TOKENS", " 0123456789abcdef, ci:fedcba9876543210 ,"),
        ])
        .unwrap();
        assert_eq!(c.auth.tokens.len(), 2);
        let c = cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_VIEWER_TOKENS", "prom:0123456789abcdef")]).unwrap();
        assert_eq!(c.auth.tokens.len(), 1);
        assert!(cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "off")]).is_err());
        assert!(cfg(&[("POOLMGR_AUTH", "disabled")]).is_err());
    }

    /// Issue 14 item 4: the abandon sweep must never take a VM from a claim that is still
    /// running. Unset, the abandon period is derived from the claim's hook deadline and the
    /// lease write's timeouts; a value a live claim could outlive is refused at start.
    #[test]
    fn the_abandon_period_outlives_the_longest_live_claim() {
        let base = [("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")];
        let c = cfg(&base).unwrap();
        assert_eq!(c.hooks.claim_hook_deadline, Duration::from_secs(15));
        // 15 s of hooks + 2 s to check a host that stopped answering mid-command + 5 s to
        // connect + 10 s for the lease statement, plus a minute.
        assert_eq!(c.hooks.longest_claim_hold(c.db_connect_timeout, c.db_statement_timeout), Duration::from_secs(32));
        assert_eq!(c.hooks.claim_abandon_after, Duration::from_secs(92));

        let err = cfg(&[base[0], base[1], ("POOLMGR_CLAIM_ABANDON_SECONDS", "32")]).unwrap_err().to_string();
        assert!(err.contains("POOLMGR_CLAIM_ABANDON_SECONDS=32") && err.contains("32 s"), "{err}");
        let ok = cfg(&[base[0], base[1], ("POOLMGR_CLAIM_ABANDON_SECONDS", "33")]).unwrap();
        assert_eq!(ok.hooks.claim_abandon_after, Duration::from_secs(33));
        // A longer hook deadline moves both the bound and the derived default.
        let long = [base[0], base[1], ("POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS", "20")];
        assert!(cfg(&[long[0], long[1], long[2], ("POOLMGR_CLAIM_ABANDON_SECONDS", "33")]).is_err());
        assert_eq!(cfg(&long).unwrap().hooks.claim_abandon_after, Duration::from_secs(97));
        // Without a client-side statement limit the lease write counts as 30 s.
        let unbounded = cfg(&[base[0], base[1], ("POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS", "0")]).unwrap();
        assert_eq!(unbounded.hooks.claim_abandon_after, Duration::from_secs(15 + 2 + 5 + 30 + 60));
        assert!(cfg(&[base[0], base[1], ("POOLMGR_CLAIM_HOOK_DEADLINE_SECONDS", "0")]).is_err());
    }

    #[test]
    fn lambda_defaults_to_one_connection_and_emf_metrics() {
        let base = [("DATABASE_URL", "postgres://x"), ("POOLMGR_ADMIN_TOKENS", "0123456789abcdef")];
        let local = cfg(&base).unwrap();
        assert_eq!(local.db_pool_size, 16);
        assert!(!local.on_lambda && !local.metrics_emf);
        assert_eq!(local.db_statement_timeout, Some(Duration::from_secs(10)));
        assert!(local.db_prepare_claim);
        let lambda = cfg(&[base[0], base[1], ("AWS_LAMBDA_FUNCTION_NAME", "claims")]).unwrap();
        assert_eq!(lambda.db_pool_size, 1);
        assert!(!lambda.db_prepare_claim);
        assert!(!cfg(&[base[0], base[1], ("POOLMGR_DB_PREPARE_CLAIM", "false")]).unwrap().db_prepare_claim);
        assert!(cfg(&[base[0], base[1], ("POOLMGR_DB_PREPARE_CLAIM", "maybe")]).is_err());
        assert!(lambda.on_lambda && lambda.metrics_emf);
        let tuned = cfg(&[
            base[0],
            base[1],
            ("AWS_LAMBDA_FUNCTION_NAME", "reconcile"),
            ("POOLMGR_DB_POOL_SIZE", "4"),
            ("POOLMGR_METRICS_FORMAT", "prometheus"),
            ("POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS", "0"),
        ])
        .unwrap();
        assert_eq!(tuned.db_pool_size, 4);
        assert!(!tuned.metrics_emf);
        assert_eq!(tuned.db_statement_timeout, None);
        assert!(cfg(&[base[0], base[1], ("POOLMGR_METRICS_FORMAT", "statsd")]).is_err());
    }

    /// 16 characters, the shortest token accepted; `T2`, `T3` others of that length.
    const T1: &str = "0123456789abcdef";
    const T2: &str = "fedcba9876543210";
    const T3: &str = "aaaabbbbccccdddd";

    fn with_tokens(admin: &str, client: &str) -> Result<Config, ConfigError> {
        cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_ADMIN_TOKENS", admin), ("POOLMGR_CLIENT_TOKENS", client)])
    }

    /// The error of a refused configuration, checked not to echo any token.
    #[track_caller]
    fn refused(admin: &str, client: &str) -> String {
        let err = with_tokens(admin, client).expect_err("refused").to_string();
        for t in [T1, T2, T3, "0123456789abcde"] {
            assert!(!err.contains(t), "the error echoes a token: {err}");
        }
        err
    }

    /// Issue 14 item 11: two entries with one principal name would share its `request_id`s
    /// and its leases; one token configured twice would be one principal under two names (or
    /// roles). Both are refused at start, naming the entries, never the tokens.
    #[test]
    fn duplicate_principal_names_and_tokens_are_refused_at_start() {
        let err = refused(&format!("ops:{T1}"), &format!("ops:{T2}"));
        assert!(err.contains("\"ops\"") && err.contains("POOLMGR_ADMIN_TOKENS entry 1"), "{err}");
        assert!(err.contains("POOLMGR_CLIENT_TOKENS entry 1") && err.contains("own name"), "{err}");
        let err = refused("", &format!("ci:{T1}, ci:{T2}"));
        assert!(err.contains("\"ci\"") && err.contains("entry 2"), "{err}");
        // One unnamed token twice: the same derived name.
        let err = refused(&format!("{T1},{T2}"), &format!("{T3},{T1}"));
        assert!(err.contains("POOLMGR_CLIENT_TOKENS entry 2"), "{err}");
        // One token under two names, or in both roles.
        let err = refused(&format!("ops:{T1}"), &format!("ci:{T1}"));
        assert!(err.contains("same token") && err.contains("POOLMGR_CLIENT_TOKENS entry 1"), "{err}");
        refused("", &format!("a:{T1},b:{T1}"));
        // Distinct names and tokens start.
        let c = with_tokens(&format!("ops:{T1}"), &format!("ci:{T2},{T3}")).unwrap();
        assert_eq!(c.auth.tokens.len(), 3);
    }

    /// Issue 14 item 11: a token shorter than 16 characters is refused at start, named or not,
    /// with how to make a good one; 16 is accepted.
    #[test]
    fn tokens_shorter_than_16_characters_are_refused_at_start() {
        for (admin, client) in [("0123456789abcde", ""), ("", "ci:0123456789abcde"), ("", "x"), (T1, "ci:s3cret")] {
            let err = refused(admin, client);
            assert!(err.contains("at least 16 characters") && err.contains("openssl rand -hex 32"), "{err}");
            assert!(err.contains("entry 1"), "names the entry: {err}");
        }
        assert!(with_tokens(T1, &format!("ci:{T2}")).is_ok());
    }

    /// Issue 14 item 11: `POOLMGR_AUTH=disabled` serves everyone as admin; on Lambda (where
    /// `AWS_LAMBDA_FUNCTION_NAME` is set) that would open a deployed API, so it is refused.
    #[test]
    fn auth_disabled_is_refused_on_lambda() {
        for extra in [vec![], vec![("POOLMGR_ADMIN_TOKENS", T1)]] {
            let mut env = vec![
                ("DATABASE_URL", "postgres://x"),
                ("POOLMGR_AUTH", "disabled"),
                ("AWS_LAMBDA_FUNCTION_NAME", "claims"),
            ];
            env.extend(extra);
            let err = cfg(&env).unwrap_err().to_string();
            assert!(err.contains("POOLMGR_AUTH=disabled") && err.contains("Lambda"), "{err}");
            assert!(err.contains("POOLMGR_ADMIN_TOKENS"), "says what to set instead: {err}");
        }
        // Locally it is still allowed, and on Lambda with tokens auth is on.
        assert!(cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")]).unwrap().auth.disabled);
        let on = cfg(&[
            ("DATABASE_URL", "postgres://x"),
            ("POOLMGR_ADMIN_TOKENS", T1),
            ("AWS_LAMBDA_FUNCTION_NAME", "claims"),
        ])
        .unwrap();
        assert!(on.on_lambda && !on.auth.disabled);
    }

    /// Issue 14 item 11: an entry is `token` or `name:token`; one whose split is not obvious
    /// (an empty side, a second `:`, a name that is not a plain identifier, a token with
    /// whitespace or characters no `Authorization` header can carry) is refused, saying how
    /// to write it.
    #[test]
    fn ambiguous_name_token_entries_are_refused_at_start() {
        let cases = [
            format!(":{T1}"),
            "ci:".to_owned(),
            format!("ci:{T1}:x"),
            format!("a:b:{T1}"),
            format!("{T1}:{T2}:"),
            format!("c i:{T1}"),
            format!("ci/x:{T1}"),
            format!("-ci:{T1}"),
            format!("{}:{T1}", "n".repeat(65)),
            format!("ci:{T1} {T2}"),
            format!("ci:{T1}\t{T2}"),
            format!("ci:{T1}\u{e9}"),
            format!("{T1}\u{7f}"),
        ];
        for entry in &cases {
            let err = refused("", entry);
            assert!(err.contains("POOLMGR_CLIENT_TOKENS entry 1"), "{entry:?}: {err}");
            assert!(err.contains("`name:token`"), "{entry:?}: says how to write it: {err}");
        }
        // Plain names and tokens of any visible ASCII but `:` and `,` are fine.
        let c =
            with_tokens(&format!("ops.team_1:{T1}"), &format!("CI-2:{T2}!#$%&'()*+-./;<=>?@[]^_`{{|}}~,{T3}")).unwrap();
        assert_eq!(c.auth.tokens.len(), 3);
    }

    #[test]
    fn the_metrics_namespace_defaults_to_poolmgr_and_must_be_a_cloudwatch_namespace() {
        let base = [("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")];
        assert_eq!(cfg(&base).unwrap().metrics_namespace, "poolmgr");
        let c = cfg(&[base[0], base[1], ("POOLMGR_METRICS_NAMESPACE", "poolmgr/stack-a")]).unwrap();
        assert_eq!(c.metrics_namespace, "poolmgr/stack-a");
        for bad in ["AWS/Lambda", "pool{mgr}", &"x".repeat(256)] {
            let err = cfg(&[base[0], base[1], ("POOLMGR_METRICS_NAMESPACE", bad)]).unwrap_err();
            assert!(err.to_string().contains("not a CloudWatch namespace"), "{bad}: {err}");
        }
    }

    #[test]
    fn events_retention_defaults_to_seven_days_and_takes_a_humantime_duration_a_bare_number_or_off() {
        let base = [("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")];
        let retention =
            |v: &str| cfg(&[base[0], base[1], ("POOLMGR_EVENTS_RETENTION", v)]).map(|c| c.reconcile.events_retention);
        assert_eq!(cfg(&base).unwrap().reconcile.events_retention, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(retention("").unwrap(), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(retention("30d").unwrap(), Some(Duration::from_secs(30 * 86_400)));
        assert_eq!(retention(" 36h ").unwrap(), Some(Duration::from_secs(36 * 3600)));
        assert_eq!(retention("15m").unwrap(), Some(Duration::from_secs(900)));
        assert_eq!(retention("90s").unwrap(), Some(Duration::from_secs(90)));
        assert_eq!(retention("3600").unwrap(), Some(Duration::from_secs(3600)));
        assert_eq!(retention("off").unwrap(), None);
        assert_eq!(retention("OFF").unwrap(), None);
        // humantime's forms (issue 26 item 8: one parser for durations), beside the old ones.
        assert_eq!(retention("1h30m").unwrap(), Some(Duration::from_secs(5400)));
        assert_eq!(retention("1h 30m").unwrap(), Some(Duration::from_secs(5400)));
        assert_eq!(retention("2days").unwrap(), Some(Duration::from_secs(2 * 86_400)));
        assert_eq!(retention("1w").unwrap(), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(retention("90sec").unwrap(), Some(Duration::from_secs(90)));
        assert_eq!(retention("1.5d").unwrap(), Some(Duration::from_secs(36 * 3600)));
        // Under a second would prune events as they are written.
        for bad in [
            "0",
            "0d",
            "0s",
            "500ms",
            "1us",
            "d",
            "-1d",
            "99999999999999999999d",
            "99999999999999999999",
            "7x",
            "seven",
        ] {
            let e = retention(bad).unwrap_err().to_string();
            assert!(e.contains("POOLMGR_EVENTS_RETENTION"), "{bad:?}: {e}");
        }
    }

    /// Issue 14 item 9: the deployment id is optional (the database has one) and must be
    /// letters and digits, since a `-` would make the flintlock namespace ambiguous.
    #[test]
    fn the_deployment_id_is_optional_and_refused_when_ambiguous() {
        let base = [("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")];
        assert_eq!(cfg(&base).unwrap().deployment_id, None);
        assert_eq!(cfg(&[base[0], base[1], ("POOLMGR_DEPLOYMENT_ID", " ")]).unwrap().deployment_id, None);
        assert_eq!(
            cfg(&[base[0], base[1], ("POOLMGR_DEPLOYMENT_ID", "prod1")]).unwrap().deployment_id.as_deref(),
            Some("prod1")
        );
        for bad in ["prod-1", "Prod", "a_b"] {
            let err = cfg(&[base[0], base[1], ("POOLMGR_DEPLOYMENT_ID", bad)]).unwrap_err();
            assert!(err.to_string().contains("POOLMGR_DEPLOYMENT_ID"), "{err}");
        }
        assert_eq!(cfg(&base).unwrap().reconcile.host_concurrency, 4);
    }
}
