//! Configuration from the environment, read once at start by each binary.
//!
//! Every knob has a default that suits the local stack; Lambda deployments set the rest
//! (`infra/`). Parsing goes through a lookup closure so tests never touch the process
//! environment.

use std::time::Duration;

use crate::auth::{AuthConfig, Role, TokenEntry};

#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

#[derive(Debug, Clone)]
pub struct Config {
    /// PostgreSQL URL (`DATABASE_URL`).
    pub database_url: String,
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
    /// Whether the claim statement is prepared once per connection and reused
    /// (`POOLMGR_DB_PREPARE_CLAIM`; true, false on Lambda). Planning the claim costs as much
    /// as running it (docs/benchmarks.md); a named prepared statement skips that, but it
    /// lives on one server connection, which a transaction pooler (PgBouncer < 1.21,
    /// possibly RDS Proxy) does not keep: set false behind one.
    pub db_prepare_claim: bool,
    /// Running on AWS Lambda (`AWS_LAMBDA_FUNCTION_NAME` is set).
    pub on_lambda: bool,
    /// Counters and histograms are also written as CloudWatch Embedded Metric Format lines on
    /// stdout (`POOLMGR_METRICS_FORMAT=emf`; the default on Lambda, else `prometheus`).
    pub metrics_emf: bool,
    /// Timeout of every flintlock RPC (`POOLMGR_FLINTLOCK_TIMEOUT_SECONDS`).
    pub flintlock_timeout: Duration,
    pub auth: AuthConfig,
    /// flintlock namespaces poolmgr owns are `<prefix><pool namespace>`
    /// (`POOLMGR_FLINTLOCK_NAMESPACE_PREFIX`). VMs in other namespaces are never touched.
    pub flintlock_namespace_prefix: String,
    pub reconcile: ReconcileConfig,
    pub hooks: HookConfig,
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
    /// A VM in PRE_LEASE_HOOK_RUNNING for longer was abandoned by a claim that died
    /// mid-hook; the reconciler deletes it (`POOLMGR_CLAIM_ABANDON_SECONDS`, 600).
    pub claim_abandon_after: Duration,
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
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Failed attempts after which a uid-less intent row on an unreachable host is dropped
    /// (and replaced elsewhere) (`POOLMGR_PROVISION_MAX_ATTEMPTS`, 5).
    pub max_create_attempts: i32,
    /// New VMs one pass creates per pool at most (`POOLMGR_RECONCILE_MAX_CREATES`, 50).
    pub max_creates_per_pool: usize,
    /// Interval between orphan scans of a host (`POOLMGR_ORPHAN_SCAN_SECONDS`, 10).
    pub orphan_scan_interval: Duration,
    /// `poolmgr-local`'s ticker interval (`POOLMGR_RECONCILE_INTERVAL_SECONDS`, 2).
    pub interval: Duration,
    /// Events older than this are deleted by the reconcile pass, in batches
    /// (`POOLMGR_EVENTS_RETENTION`: `7d` by default; a number with a unit `s`, `m`, `h` or
    /// `d`, a bare number is seconds; `off` keeps events forever, `None`).
    pub events_retention: Option<Duration>,
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

/// A duration with a unit (`90s`, `15m`, `36h`, `7d`; a bare number is seconds), or `off`
/// (`None`). Zero is refused: it would mean "delete at once", never what anyone wants.
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
    let bad =
        || ConfigError(format!("{key}={raw:?}: use a positive number with a unit s, m, h or d (e.g. 7d), or off"));
    let (number, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        "d" => n.checked_mul(86_400),
        _ => None,
    };
    match secs {
        Some(s) if s > 0 => Ok(Some(Duration::from_secs(s))),
        _ => Err(bad()),
    }
}

fn parse_tokens(raw: Option<String>, role: Role) -> Vec<TokenEntry> {
    raw.unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| TokenEntry::parse(entry, role))
        .collect()
}

impl Config {
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
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
        let mut tokens = parse_tokens(lookup("POOLMGR_ADMIN_TOKENS"), Role::Admin);
        tokens.extend(parse_tokens(lookup("POOLMGR_CLIENT_TOKENS"), Role::Client));
        if !disabled && tokens.is_empty() {
            return Err(ConfigError(
                "no API tokens: set POOLMGR_ADMIN_TOKENS and/or POOLMGR_CLIENT_TOKENS (comma-separated, each `token` or `name:token`), or POOLMGR_AUTH=disabled for local development".into(),
            ));
        }
        let on_lambda = lookup("AWS_LAMBDA_FUNCTION_NAME").is_some_and(|s| !s.trim().is_empty());
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
        let statement_timeout = parse_num(&lookup, "POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS", 10u64)?;
        Ok(Config {
            database_url,
            db_pool_size,
            db_connect_timeout: Duration::from_secs(parse_num(&lookup, "POOLMGR_DB_CONNECT_TIMEOUT_SECONDS", 5u64)?),
            db_check_idle: Duration::from_secs(parse_num(&lookup, "POOLMGR_DB_CHECK_IDLE_SECONDS", 1u64)?),
            db_statement_timeout: (statement_timeout > 0).then(|| Duration::from_secs(statement_timeout)),
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
            flintlock_timeout: Duration::from_secs(parse_num(&lookup, "POOLMGR_FLINTLOCK_TIMEOUT_SECONDS", 10u64)?),
            auth: AuthConfig { disabled, tokens },
            flintlock_namespace_prefix: lookup("POOLMGR_FLINTLOCK_NAMESPACE_PREFIX")
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "poolmgr-".into()),
            hooks: HookConfig {
                command_timeout: Duration::from_secs(parse_num(&lookup, "POOLMGR_HOOK_TIMEOUT_SECONDS", 30u64)?.max(1)),
                guest_agent_timeout: Duration::from_secs(parse_num(
                    &lookup,
                    "POOLMGR_GUEST_AGENT_TIMEOUT_SECONDS",
                    60u64,
                )?),
                claim_abandon_after: Duration::from_secs(parse_num(&lookup, "POOLMGR_CLAIM_ABANDON_SECONDS", 600u64)?),
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
                interval: Duration::from_secs(parse_num(&lookup, "POOLMGR_RECONCILE_INTERVAL_SECONDS", 2u64)?.max(1)),
                events_retention: parse_retention(
                    &lookup,
                    "POOLMGR_EVENTS_RETENTION",
                    Duration::from_secs(7 * 86_400),
                )?,
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
        let c = cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_CLIENT_TOKENS", "a, ci:b ,")]).unwrap();
        assert_eq!(c.auth.tokens.len(), 2);
        assert!(cfg(&[("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "off")]).is_err());
        assert!(cfg(&[("POOLMGR_AUTH", "disabled")]).is_err());
    }

    #[test]
    fn lambda_defaults_to_one_connection_and_emf_metrics() {
        let base = [("DATABASE_URL", "postgres://x"), ("POOLMGR_AUTH", "disabled")];
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

    #[test]
    fn events_retention_defaults_to_seven_days_and_takes_a_unit_or_off() {
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
        for bad in ["0", "0d", "7 d", "7w", "d", "-1d", "1.5d", "99999999999999999999d"] {
            let e = retention(bad).unwrap_err().to_string();
            assert!(e.contains("POOLMGR_EVENTS_RETENTION"), "{bad:?}: {e}");
        }
    }
}
