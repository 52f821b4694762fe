//! Secrets named by AWS Secrets Manager ARN, fetched through the AWS Parameters and Secrets
//! Lambda Extension (a local HTTP cache running beside the function; no AWS SDK). AWS answers
//! the extension only in the INVOKE phase: functions read their secrets on their first
//! invocation (`app::Instance`), never before the runtime asked for an event.
//!
//! - `POOLMGR_DATABASE_SECRET_ARN`: either a PostgreSQL URL, or the RDS JSON shape
//!   `{"username", "password", "host", "port", "dbname"}`; becomes `DATABASE_URL`.
//!   `POOLMGR_DATABASE_HOST`, `POOLMGR_DATABASE_PORT` and `POOLMGR_DATABASE_NAME` override the
//!   JSON's fields: the secret holds the credentials, the deployment says where to connect
//!   (the RDS Proxy endpoint, not the instance the secret was attached to).
//! - `POOLMGR_TOKENS_SECRET_ARN`: `{"admin_tokens": "…", "viewer_tokens": "…", "client_tokens": "…"}` in the
//!   comma-separated format of `POOLMGR_ADMIN_TOKENS` / `POOLMGR_CLIENT_TOKENS`.
//!
//! - `POOLMGR_CREDENTIALS_SECRET_ARN`: `{"credentials_key": "…", "credentials_old_keys": "…"}`;
//!   becomes `POOLMGR_CREDENTIALS_KEY` / `POOLMGR_CREDENTIALS_OLD_KEYS` (the keys hosts'
//!   secrets are encrypted with at rest, [`crate::credentials`]).
//! - `POOLMGR_RUNTIME_DATABASE_SECRET_ARN` (`migrate` only): the functions' own login,
//!   `{"username", "password"}`; becomes `POOLMGR_RUNTIME_DATABASE_USER` / `_PASSWORD`
//!   (`crate::db_role`).
//!
//! Without those variables nothing is fetched and the environment is used as it is. With
//! them the secret's values win over variables of the same name.
//!
//! This module must never log, or put in an error, a secret's value: errors name the
//! variable, the ARN and what was wrong, not what was there.

use std::time::{Duration, Instant};

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;
use serde_json::Value;

pub const DATABASE_SECRET_ARN: &str = "POOLMGR_DATABASE_SECRET_ARN";
pub const TOKENS_SECRET_ARN: &str = "POOLMGR_TOKENS_SECRET_ARN";
/// The credentials keys ([`crate::credentials`]): `{"credentials_key", "credentials_old_keys"}`.
pub const CREDENTIALS_SECRET_ARN: &str = "POOLMGR_CREDENTIALS_SECRET_ARN";
/// The runtime login `migrate` sets up (`crate::db_role`): `{"username", "password"}`.
pub const RUNTIME_DATABASE_SECRET_ARN: &str = "POOLMGR_RUNTIME_DATABASE_SECRET_ARN";
/// The extension's port (its own variable, default 2773).
pub const EXTENSION_PORT: &str = "PARAMETERS_SECRETS_EXTENSION_HTTP_PORT";
/// How long one invocation keeps trying the extension (milliseconds, default 5000).
pub const WAIT_MS: &str = "POOLMGR_SECRETS_WAIT_MS";

const DEFAULT_PORT: u16 = 2773;
const DEFAULT_WAIT: Duration = Duration::from_millis(5000);
const DEFAULT_PG_PORT: u16 = 5432;

#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error(
        "{var} is set but AWS_SESSION_TOKEN is not: secrets are read through the AWS Parameters and Secrets \
         Lambda Extension, which runs only on Lambda; set DATABASE_URL / POOLMGR_*_TOKENS directly instead"
    )]
    NoSessionToken { var: &'static str },
    #[error("{var}: {msg}")]
    Config { var: &'static str, msg: String },
    #[error(
        "{var}: cannot read secret {arn} through the Parameters and Secrets extension at {endpoint} \
         (is the extension layer attached, and may the function's role read the secret?): {cause}"
    )]
    Fetch { var: &'static str, arn: String, endpoint: String, cause: String },
    #[error("{var}: secret {arn}: {msg}")]
    Parse { var: &'static str, arn: String, msg: String },
}

/// Every byte but RFC 3986 unreserved characters (`A-Z a-z 0-9 - . _ ~`).
const NOT_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Percent-encodes everything but RFC 3986 unreserved characters: safe in a URL's userinfo,
/// path and query alike.
pub fn percent_encode(s: &str) -> String {
    utf8_percent_encode(s, NOT_UNRESERVED).to_string()
}

fn non_empty(lookup: &impl Fn(&str) -> Option<String>, key: &str) -> Option<String> {
    lookup(key).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// Where a JSON database secret connects, when the deployment says so.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DbOverrides {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub dbname: Option<String>,
}

impl DbOverrides {
    fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<DbOverrides, SecretsError> {
        let port = match non_empty(lookup, "POOLMGR_DATABASE_PORT") {
            None => None,
            Some(p) => Some(p.parse().map_err(|_| SecretsError::Config {
                var: "POOLMGR_DATABASE_PORT",
                msg: format!("{p:?} is not a port number"),
            })?),
        };
        Ok(DbOverrides {
            host: non_empty(lookup, "POOLMGR_DATABASE_HOST"),
            port,
            dbname: non_empty(lookup, "POOLMGR_DATABASE_NAME"),
        })
    }
}

/// The fields of an RDS database secret we use (others, like `engine`, are ignored).
#[derive(Deserialize)]
struct RdsSecret {
    username: Option<String>,
    password: Option<String>,
    host: Option<String>,
    port: Option<Value>,
    dbname: Option<String>,
}

/// `DATABASE_URL` from a database secret's `SecretString`. The error is a description that
/// never repeats the secret.
pub fn database_url(secret: &str, overrides: &DbOverrides) -> Result<String, String> {
    let s = secret.trim();
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        return Ok(s.to_owned());
    }
    if !s.starts_with('{') {
        return Err("is neither a postgres:// URL nor a JSON object".into());
    }
    // serde_json's messages may quote the offending value: keep only the position.
    let rds: RdsSecret = serde_json::from_str(s)
        .map_err(|e| format!("is not a valid JSON object of strings (line {}, column {})", e.line(), e.column()))?;
    let username = rds.username.filter(|u| !u.is_empty()).ok_or("has no \"username\"")?;
    let password = rds.password.ok_or("has no \"password\"")?;
    let host = overrides
        .host
        .clone()
        .or(rds.host.filter(|h| !h.is_empty()))
        .ok_or("has no \"host\" (set POOLMGR_DATABASE_HOST)")?;
    let port = match (overrides.port, rds.port) {
        (Some(p), _) => p,
        (None, None) | (None, Some(Value::Null)) => DEFAULT_PG_PORT,
        (None, Some(Value::Number(n))) => {
            n.as_u64().and_then(|p| u16::try_from(p).ok()).ok_or("has a \"port\" that is not a port number")?
        }
        (None, Some(Value::String(p))) => p.trim().parse().map_err(|_| "has a \"port\" that is not a port number")?,
        (None, Some(_)) => return Err("has a \"port\" that is not a port number".into()),
    };
    let dbname = overrides.dbname.clone().or(rds.dbname.filter(|d| !d.is_empty())).unwrap_or_else(|| "postgres".into());
    // An IPv6 literal needs brackets; a name or IPv4 address goes in as it is.
    let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host };
    Ok(format!(
        "postgres://{}:{}@{host}:{port}/{}",
        percent_encode(&username),
        percent_encode(&password),
        percent_encode(&dbname)
    ))
}

/// The runtime login from its secret's `SecretString` (`{"username", "password"}`, the RDS
/// shape; other fields ignored). The error never repeats the secret.
pub fn runtime_login(secret: &str) -> Result<(String, String), String> {
    let rds: RdsSecret = serde_json::from_str(secret.trim())
        .map_err(|e| format!("is not a JSON object of strings (line {}, column {})", e.line(), e.column()))?;
    let username = rds.username.filter(|u| !u.is_empty()).ok_or("has no \"username\"")?;
    let password = rds.password.filter(|p| !p.is_empty()).ok_or("has no \"password\"")?;
    Ok((username, password))
}

/// `POOLMGR_ADMIN_TOKENS` / `POOLMGR_VIEWER_TOKENS` / `POOLMGR_CLIENT_TOKENS` from a tokens secret's `SecretString`.
/// Each field is the comma-separated string of the variables, or a JSON array of entries.
pub fn token_vars(secret: &str) -> Result<Vec<(String, String)>, String> {
    let v: Value = serde_json::from_str(secret.trim())
        .map_err(|e| format!("is not valid JSON (line {}, column {})", e.line(), e.column()))?;
    let obj = v.as_object().ok_or("is not a JSON object")?;
    let mut out = vec![];
    for (field, var) in [
        ("admin_tokens", "POOLMGR_ADMIN_TOKENS"),
        ("viewer_tokens", "POOLMGR_VIEWER_TOKENS"),
        ("client_tokens", "POOLMGR_CLIENT_TOKENS"),
    ] {
        let joined = match obj.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(items)) => {
                let entries: Option<Vec<&str>> = items.iter().map(Value::as_str).collect();
                entries.ok_or_else(|| format!("\"{field}\" must be a string or an array of strings"))?.join(",")
            }
            Some(_) => return Err(format!("\"{field}\" must be a string or an array of strings")),
        };
        out.push((var.to_owned(), joined));
    }
    if out.is_empty() {
        return Err("has none of \"admin_tokens\", \"viewer_tokens\" and \"client_tokens\"".into());
    }
    Ok(out)
}

/// `POOLMGR_CREDENTIALS_KEY` / `POOLMGR_CREDENTIALS_OLD_KEYS` from a credentials secret's
/// `SecretString`: `credentials_key` (required) and `credentials_old_keys` (a comma-separated
/// string or an array; may be empty). The error never repeats the secret.
pub fn credentials_vars(secret: &str) -> Result<Vec<(String, String)>, String> {
    let v: Value = serde_json::from_str(secret.trim())
        .map_err(|e| format!("is not valid JSON (line {}, column {})", e.line(), e.column()))?;
    let obj = v.as_object().ok_or("is not a JSON object")?;
    let key = match obj.get("credentials_key") {
        Some(Value::String(k)) if !k.trim().is_empty() => k.trim().to_owned(),
        _ => return Err("has no \"credentials_key\" string".into()),
    };
    let old = match obj.get("credentials_old_keys") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let keys: Option<Vec<&str>> = items.iter().map(Value::as_str).collect();
            keys.ok_or("\"credentials_old_keys\" must be a string or an array of strings")?.join(",")
        }
        Some(_) => return Err("\"credentials_old_keys\" must be a string or an array of strings".into()),
    };
    Ok(vec![(crate::credentials::KEY_VAR.to_owned(), key), (crate::credentials::OLD_KEYS_VAR.to_owned(), old)])
}

/// The subset of the extension's answer (Secrets Manager's GetSecretValue) we read.
#[derive(Deserialize)]
struct GetSecretValue {
    #[serde(rename = "SecretString")]
    secret_string: Option<String>,
}

struct Extension {
    client: reqwest::Client,
    base: String,
    token: String,
    wait: Duration,
}

impl Extension {
    fn new(lookup: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Extension, SecretsError> {
        let token = non_empty(lookup, "AWS_SESSION_TOKEN").ok_or(SecretsError::NoSessionToken { var })?;
        let port = match non_empty(lookup, EXTENSION_PORT) {
            None => DEFAULT_PORT,
            Some(p) => p.parse().map_err(|_| SecretsError::Config {
                var: EXTENSION_PORT,
                msg: format!("{p:?} is not a port number"),
            })?,
        };
        let wait = match non_empty(lookup, WAIT_MS) {
            None => DEFAULT_WAIT,
            Some(ms) => Duration::from_millis(
                ms.parse()
                    .map_err(|_| SecretsError::Config { var: WAIT_MS, msg: format!("{ms:?} is not a number") })?,
            ),
        };
        let client = reqwest::Client::builder()
            // The extension is on loopback: a proxy from the environment must not get in the way.
            .no_proxy()
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| SecretsError::Config { var, msg: format!("cannot build an HTTP client: {e}") })?;
        Ok(Extension { client, base: format!("http://localhost:{port}"), token, wait })
    }

    /// One secret's `SecretString`. Connection failures and error answers (Secrets Manager
    /// slow or throttling behind the extension) are retried, with backoff, for up to
    /// `POOLMGR_SECRETS_WAIT_MS` within the invocation; past it the invocation fails and the
    /// next one tries again.
    async fn get(&self, var: &'static str, arn: &str) -> Result<String, SecretsError> {
        let url = format!("{}/secretsmanager/get?secretId={}", self.base, percent_encode(arn));
        let fetch_err =
            |cause: String| SecretsError::Fetch { var, arn: arn.to_owned(), endpoint: self.base.clone(), cause };
        let deadline = Instant::now() + self.wait;
        let mut backoff = Duration::from_millis(50);
        let mut attempts = 0u32;
        let body = loop {
            attempts += 1;
            let outcome = match self.client.get(&url).header("X-Aws-Parameters-Secrets-Token", &self.token).send().await
            {
                Err(e) => Err(format!("{e}")),
                Ok(resp) if resp.status().is_success() => match resp.text().await {
                    Ok(body) => Ok(body),
                    Err(e) => Err(format!("reading the answer: {e}")),
                },
                Ok(resp) => {
                    let status = resp.status();
                    // An error answer carries the extension's or Secrets Manager's message,
                    // never a secret value.
                    let text = resp.text().await.unwrap_or_default();
                    let text: String = text.trim().chars().take(300).collect();
                    Err(format!("HTTP {status}: {text}"))
                }
            };
            match outcome {
                Ok(body) => break body,
                Err(cause) if Instant::now() + backoff >= deadline => {
                    return Err(fetch_err(format!("{cause} (after {attempts} attempts)")));
                }
                Err(cause) => {
                    tracing::debug!(var, arn, %cause, attempts, "secret not available yet, retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        };
        let parsed: GetSecretValue = serde_json::from_str(&body).map_err(|_| SecretsError::Parse {
            var,
            arn: arn.to_owned(),
            msg: "the extension's answer is not GetSecretValue JSON".into(),
        })?;
        parsed.secret_string.ok_or_else(|| SecretsError::Parse {
            var,
            arn: arn.to_owned(),
            msg: "has no SecretString (binary secrets are not supported)".into(),
        })
    }
}

/// The variables that secrets named in `lookup` provide (`DATABASE_URL`, `POOLMGR_ADMIN_TOKENS`,
/// `POOLMGR_CLIENT_TOKENS`), fetched through the extension. Empty, without any request, when no
/// `*_SECRET_ARN` is set.
pub async fn resolve_env(lookup: impl Fn(&str) -> Option<String>) -> Result<Vec<(String, String)>, SecretsError> {
    let db_arn = non_empty(&lookup, DATABASE_SECRET_ARN);
    let tokens_arn = non_empty(&lookup, TOKENS_SECRET_ARN);
    let runtime_arn = non_empty(&lookup, RUNTIME_DATABASE_SECRET_ARN);
    let credentials_arn = non_empty(&lookup, CREDENTIALS_SECRET_ARN);
    let mut out = vec![];
    let first = match (&db_arn, &tokens_arn, &runtime_arn, &credentials_arn) {
        (None, None, None, None) => return Ok(out),
        (Some(_), _, _, _) => DATABASE_SECRET_ARN,
        (None, Some(_), _, _) => TOKENS_SECRET_ARN,
        (None, None, Some(_), _) => RUNTIME_DATABASE_SECRET_ARN,
        (None, None, None, Some(_)) => CREDENTIALS_SECRET_ARN,
    };
    let ext = Extension::new(&lookup, first)?;
    let overrides = db_arn.as_ref().map(|_| DbOverrides::from_lookup(&lookup)).transpose()?;
    let db = async {
        let (Some(arn), Some(overrides)) = (&db_arn, &overrides) else { return Ok(None) };
        let secret = ext.get(DATABASE_SECRET_ARN, arn).await?;
        let url = database_url(&secret, overrides).map_err(|msg| SecretsError::Parse {
            var: DATABASE_SECRET_ARN,
            arn: arn.clone(),
            msg,
        })?;
        tracing::info!(arn = %arn, "DATABASE_URL read from Secrets Manager");
        Ok::<_, SecretsError>(Some(url))
    };
    let tokens = async {
        let Some(arn) = &tokens_arn else { return Ok(None) };
        let secret = ext.get(TOKENS_SECRET_ARN, arn).await?;
        let vars =
            token_vars(&secret).map_err(|msg| SecretsError::Parse { var: TOKENS_SECRET_ARN, arn: arn.clone(), msg })?;
        tracing::info!(arn = %arn, "API tokens read from Secrets Manager");
        Ok::<_, SecretsError>(Some(vars))
    };
    let runtime = async {
        let Some(arn) = &runtime_arn else { return Ok(None) };
        let secret = ext.get(RUNTIME_DATABASE_SECRET_ARN, arn).await?;
        let login = runtime_login(&secret).map_err(|msg| SecretsError::Parse {
            var: RUNTIME_DATABASE_SECRET_ARN,
            arn: arn.clone(),
            msg,
        })?;
        tracing::info!(arn = %arn, "runtime database login read from Secrets Manager");
        Ok::<_, SecretsError>(Some(login))
    };
    let credentials = async {
        let Some(arn) = &credentials_arn else { return Ok(None) };
        let secret = ext.get(CREDENTIALS_SECRET_ARN, arn).await?;
        let vars = credentials_vars(&secret).map_err(|msg| SecretsError::Parse {
            var: CREDENTIALS_SECRET_ARN,
            arn: arn.clone(),
            msg,
        })?;
        tracing::info!(arn = %arn, "host credentials keys read from Secrets Manager");
        Ok::<_, SecretsError>(Some(vars))
    };
    // All at once: on a new instance the extension's cache is empty, so each read is a
    // Secrets Manager call, and the first invocation waits for them.
    let (db, tokens, runtime, credentials) = tokio::join!(db, tokens, runtime, credentials);
    if let Some(url) = db? {
        out.push(("DATABASE_URL".to_owned(), url));
    }
    if let Some(vars) = tokens? {
        out.extend(vars);
    }
    if let Some(vars) = credentials? {
        out.extend(vars);
    }
    if let Some((user, password)) = runtime? {
        out.push((crate::db_role::USER.to_owned(), user));
        out.push((crate::db_role::PASSWORD.to_owned(), password));
    }
    Ok(out)
}

/// `base` with `overrides` laid over it: a variable a secret provided wins.
pub fn overlay(
    overrides: Vec<(String, String)>,
    base: impl Fn(&str) -> Option<String>,
) -> impl Fn(&str) -> Option<String> {
    move |key: &str| overrides.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone()).or_else(|| base(key))
}

/// The process environment with the secrets it names resolved: what every function binary
/// reads its configuration from.
pub async fn env_lookup() -> Result<impl Fn(&str) -> Option<String>, SecretsError> {
    let env = |k: &str| std::env::var(k).ok();
    let overrides = resolve_env(env).await?;
    Ok(overlay(overrides, env))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    const DB_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/db-AbCdEf";
    const TOKENS_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/tokens-XyZ123";
    const KEY_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/credentials-AbC987";

    fn lookup(pairs: &[(&str, String)]) -> impl Fn(&str) -> Option<String> + use<> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        move |k| m.get(k).cloned()
    }

    fn pg(url: &str) -> tokio_postgres::Config {
        url.parse().unwrap_or_else(|e| panic!("{url} does not parse: {e}"))
    }

    #[test]
    fn percent_encoding_keeps_only_unreserved_characters() {
        assert_eq!(percent_encode("aZ09-._~"), "aZ09-._~");
        assert_eq!(percent_encode("p@ss:w/rd%?#[] é"), "p%40ss%3Aw%2Frd%25%3F%23%5B%5D%20%C3%A9");
        assert_eq!(
            percent_encode(DB_ARN),
            "arn%3Aaws%3Asecretsmanager%3Aeu-west-1%3A123456789012%3Asecret%3Apoolmgr%2Fdb-AbCdEf"
        );
    }

    #[test]
    fn database_secret_url_is_used_as_it_is() {
        let url = "postgres://app:pw@db.internal:5432/poolmgr";
        assert_eq!(database_url(&format!("  {url}\n"), &DbOverrides::default()).unwrap(), url);
        let url = "postgresql://app@db/x";
        assert_eq!(database_url(url, &DbOverrides::default()).unwrap(), url);
    }

    #[test]
    fn rds_json_secret_becomes_a_url_with_the_password_encoded() {
        let password = "p@ss:w/rd%?#[] é+&=";
        let secret = serde_json::json!({
            "username": "poolmgr", "password": password, "engine": "postgres",
            "host": "db.abc.eu-west-1.rds.amazonaws.com", "port": 5433, "dbname": "pm",
            "dbInstanceIdentifier": "x"
        })
        .to_string();
        let url = database_url(&secret, &DbOverrides::default()).unwrap();
        assert!(!url.contains(password), "{url}");
        let cfg = pg(&url);
        assert_eq!(cfg.get_user(), Some("poolmgr"));
        assert_eq!(cfg.get_password(), Some(password.as_bytes()));
        assert_eq!(cfg.get_dbname(), Some("pm"));
        assert_eq!(cfg.get_ports(), &[5433]);
        assert!(
            matches!(&cfg.get_hosts()[0], tokio_postgres::config::Host::Tcp(h) if h == "db.abc.eu-west-1.rds.amazonaws.com")
        );
    }

    #[test]
    fn deployment_overrides_win_over_the_secrets_host_port_and_name() {
        // RDS-managed and attached secrets name the instance; functions connect to the proxy.
        let secret = r#"{"username": "u", "password": "p", "host": "instance.rds", "port": "5432"}"#;
        let o = DbOverrides { host: Some("proxy.rds".into()), port: Some(6432), dbname: Some("poolmgr".into()) };
        assert_eq!(database_url(secret, &o).unwrap(), "postgres://u:p@proxy.rds:6432/poolmgr");
        // Only username and password in the secret: the rest from overrides or defaults.
        let secret = r#"{"username": "u", "password": "p"}"#;
        let o = DbOverrides { host: Some("proxy.rds".into()), ..Default::default() };
        assert_eq!(database_url(secret, &o).unwrap(), "postgres://u:p@proxy.rds:5432/postgres");
        let o = DbOverrides { host: Some("fd00::5".into()), ..Default::default() };
        let cfg = pg(&database_url(secret, &o).unwrap());
        assert!(matches!(&cfg.get_hosts()[0], tokio_postgres::config::Host::Tcp(h) if h == "fd00::5"));
    }

    #[test]
    fn bad_database_secrets_are_described_without_their_values() {
        let none = DbOverrides::default();
        for (secret, want) in [
            (r#"{"password": "hunter2", "host": "h"}"#, "username"),
            (r#"{"username": "u", "host": "h"}"#, "password"),
            (r#"{"username": "u", "password": "hunter2"}"#, "POOLMGR_DATABASE_HOST"),
            (r#"{"username": "u", "password": "hunter2", "host": "h", "port": "hunter2"}"#, "port"),
            (r#"{"username": "u", "password": "hunter2", "host": "h", "port": 70000}"#, "port"),
            (r#"{"username": "u", "password": 12345678, "host": "h"}"#, "JSON object of strings"),
            ("hunter2", "neither"),
        ] {
            let err = database_url(secret, &none).unwrap_err();
            assert!(err.contains(want), "{secret}: {err}");
            assert!(!err.contains("hunter2") && !err.contains("12345678"), "{err}");
        }
    }

    #[test]
    fn credentials_secret_gives_the_key_variables_and_never_repeats_a_key() {
        let vars =
            credentials_vars(r#"{"credentials_key": " k-current ", "credentials_old_keys": ["o1", "o2"]}"#).unwrap();
        assert_eq!(
            vars,
            vec![
                ("POOLMGR_CREDENTIALS_KEY".to_owned(), "k-current".to_owned()),
                ("POOLMGR_CREDENTIALS_OLD_KEYS".to_owned(), "o1,o2".to_owned()),
            ]
        );
        assert_eq!(credentials_vars(r#"{"credentials_key": "k", "credentials_old_keys": ""}"#).unwrap()[1].1, "");
        assert!(credentials_vars(r#"{"credentials_old_keys": "o1"}"#).unwrap_err().contains("credentials_key"));
        let err = credentials_vars(r#"{"credentials_key": "s3cret", "credentials_old_keys": 5}"#).unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
        assert!(credentials_vars("s3cret").unwrap_err().contains("JSON"));
    }

    #[test]
    fn tokens_secret_gives_the_token_variables() {
        let vars = token_vars(
            r#"{"admin_tokens": "ops:a1,a2", "viewer_tokens": "prom:v1", "client_tokens": ["ci:c1", "c2"]}"#,
        )
        .unwrap();
        assert_eq!(
            vars,
            vec![
                ("POOLMGR_ADMIN_TOKENS".to_owned(), "ops:a1,a2".to_owned()),
                ("POOLMGR_VIEWER_TOKENS".to_owned(), "prom:v1".to_owned()),
                ("POOLMGR_CLIENT_TOKENS".to_owned(), "ci:c1,c2".to_owned())
            ]
        );
        // Only one kind is fine; none is not.
        assert_eq!(token_vars(r#"{"client_tokens": "c"}"#).unwrap().len(), 1);
        assert_eq!(token_vars(r#"{"viewer_tokens": "v"}"#).unwrap().len(), 1);
        assert!(token_vars(r#"{"other": "x"}"#).unwrap_err().contains("admin_tokens"));
        assert!(token_vars(r#"{"admin_tokens": 5}"#).is_err());
        assert!(token_vars("admin:secret").is_err());
    }

    #[tokio::test]
    async fn without_arns_nothing_is_fetched_and_the_environment_stands() {
        let env = lookup(&[("DATABASE_URL", "postgres://x".into())]);
        assert!(resolve_env(&env).await.unwrap().is_empty());
        let l = overlay(vec![], env);
        assert_eq!(l("DATABASE_URL").as_deref(), Some("postgres://x"));
    }

    #[tokio::test]
    async fn an_arn_outside_lambda_is_a_clear_error() {
        let err = resolve_env(lookup(&[(DATABASE_SECRET_ARN, DB_ARN.into())])).await.unwrap_err();
        assert!(err.to_string().contains("AWS_SESSION_TOKEN"), "{err}");
    }

    /// A request head read from `sock`.
    async fn read_head(sock: &mut tokio::net::TcpStream) -> String {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&head).into_owned()
    }

    async fn answer(sock: &mut tokio::net::TcpStream, status: u16, body: &str) {
        let resp = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = sock.write_all(resp.as_bytes()).await;
        let _ = sock.shutdown().await;
    }

    /// A stand-in for the extension on port 0: answers each request with the next canned
    /// `(status, body)` meant for it (a GetSecretValue body names its secret's ARN and goes to
    /// a request for that secret; any other body to whichever request comes first), or a 404
    /// once none is left, and records each request head.
    async fn fake_extension(answers: Vec<(u16, String)>) -> (u16, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(vec![]));
        let log = seen.clone();
        let answers = Arc::new(Mutex::new(answers));
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else { return };
                let (log, answers) = (log.clone(), answers.clone());
                tokio::spawn(async move {
                    let head = read_head(&mut sock).await;
                    log.lock().unwrap().push(head.clone());
                    let (status, body) = {
                        let mut answers = answers.lock().unwrap();
                        let meant = |body: &String| {
                            let arn = serde_json::from_str::<Value>(body)
                                .ok()
                                .and_then(|v| v["ARN"].as_str().map(str::to_owned));
                            arn.is_none_or(|arn| head.contains(&percent_encode(&arn)))
                        };
                        match answers.iter().position(|(_, body)| meant(body)) {
                            Some(i) => answers.remove(i),
                            None => (404, "no more answers".into()),
                        }
                    };
                    answer(&mut sock, status, &body).await;
                });
            }
        });
        (port, seen)
    }

    fn get_secret_value(arn: &str, secret: &str) -> String {
        serde_json::json!({"ARN": arn, "Name": "n", "SecretString": secret, "VersionId": "v"}).to_string()
    }

    #[tokio::test]
    async fn secrets_are_fetched_through_the_extension_and_win_over_the_environment() {
        let db_secret = r#"{"username": "poolmgr", "password": "s3cr:t/", "host": "instance.rds", "port": 5432}"#;
        let tokens_secret = r#"{"admin_tokens": "ops:adm1", "client_tokens": "ci:cli1"}"#;
        let key_secret =
            r#"{"credentials_key": "generated-key-0123456789abcdefghijklmnop", "credentials_old_keys": ""}"#;
        let (port, seen) = fake_extension(vec![
            // An error answer first (Secrets Manager throttling behind the extension): retried.
            (400, r#"{"__type": "ThrottlingException", "message": "Rate exceeded"}"#.into()),
            (200, get_secret_value(DB_ARN, db_secret)),
            (200, get_secret_value(TOKENS_ARN, tokens_secret)),
            (200, get_secret_value(KEY_ARN, key_secret)),
        ])
        .await;
        let env = lookup(&[
            (DATABASE_SECRET_ARN, DB_ARN.into()),
            (TOKENS_SECRET_ARN, TOKENS_ARN.into()),
            (CREDENTIALS_SECRET_ARN, KEY_ARN.into()),
            ("POOLMGR_DATABASE_HOST", "proxy.rds".into()),
            ("POOLMGR_DATABASE_NAME", "poolmgr".into()),
            ("AWS_SESSION_TOKEN", "session-tok".into()),
            (EXTENSION_PORT, port.to_string()),
            ("DATABASE_URL", "postgres://ignored".into()),
            ("POOLMGR_ADMIN_TOKENS", "ignored".into()),
            ("POOLMGR_DB_POOL_SIZE", "1".into()),
        ]);
        let overrides = resolve_env(&env).await.unwrap();
        let l = overlay(overrides, env);
        let url = l("DATABASE_URL").unwrap();
        let cfg = pg(&url);
        assert_eq!(cfg.get_password(), Some(&b"s3cr:t/"[..]));
        assert!(url.starts_with("postgres://poolmgr:s3cr%3At%2F@proxy.rds:5432/poolmgr"), "{url}");
        assert_eq!(l("POOLMGR_ADMIN_TOKENS").as_deref(), Some("ops:adm1"));
        assert_eq!(l("POOLMGR_CLIENT_TOKENS").as_deref(), Some("ci:cli1"));
        assert_eq!(l("POOLMGR_DB_POOL_SIZE").as_deref(), Some("1"));
        assert_eq!(l("POOLMGR_CREDENTIALS_KEY").as_deref(), Some("generated-key-0123456789abcdefghijklmnop"));
        assert!(crate::credentials::Keyring::from_lookup(&l).unwrap().current_id().is_some());

        let seen: Vec<String> = seen.lock().unwrap().iter().map(|h| h.to_ascii_lowercase()).collect();
        assert_eq!(seen.len(), 4, "one request per secret, and one retry: {seen:?}");
        for arn in [DB_ARN, TOKENS_ARN, KEY_ARN] {
            let line =
                format!("get /secretsmanager/get?secretid={} http/1.1", percent_encode(arn).to_ascii_lowercase());
            assert!(seen.iter().any(|h| h.starts_with(&line)), "{line} in {seen:?}");
        }
        assert!(seen.iter().all(|h| h.contains("x-aws-parameters-secrets-token: session-tok")), "{seen:?}");
    }

    /// migrate's runtime-login secret becomes the two variables `db_role` reads; a secret
    /// without a password is refused without repeating it.
    #[tokio::test]
    async fn the_runtime_login_secret_gives_user_and_password() {
        const RUNTIME_ARN: &str = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:poolmgr/app-QwErTy";
        let (port, _) = fake_extension(vec![(
            200,
            get_secret_value(RUNTIME_ARN, r#"{"username": "poolmgr_app", "password": "Gen3rated-Passw0rd-xyz"}"#),
        )])
        .await;
        let env = lookup(&[
            (RUNTIME_DATABASE_SECRET_ARN, RUNTIME_ARN.into()),
            ("AWS_SESSION_TOKEN", "t".into()),
            (EXTENSION_PORT, port.to_string()),
        ]);
        let vars = resolve_env(env).await.unwrap();
        assert!(vars.contains(&(crate::db_role::USER.to_owned(), "poolmgr_app".to_owned())), "{vars:?}");
        assert!(vars.contains(&(crate::db_role::PASSWORD.to_owned(), "Gen3rated-Passw0rd-xyz".to_owned())), "{vars:?}");
        let err = runtime_login(r#"{"username": "poolmgr_app", "password": ""}"#).unwrap_err();
        assert!(err.contains("password"), "{err}");
        let err = runtime_login(r#"{"username": "poolmgr_app", "password": 12345678912345}"#).unwrap_err();
        assert!(!err.contains("12345678912345"), "{err}");
    }

    /// On a new instance each read is a Secrets Manager call behind the extension: the two
    /// secrets are read at once, not one after the other. This extension answers neither
    /// until both requests are in.
    #[tokio::test]
    async fn both_secrets_are_read_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut waiting = vec![];
            loop {
                // A second request within 2 s, or the first is refused.
                let accepted = tokio::time::timeout(Duration::from_secs(2), listener.accept()).await;
                let Ok(Ok((mut sock, _))) = accepted else {
                    for (mut sock, _) in waiting.drain(..) {
                        answer(&mut sock, 500, "the other secret was not asked for meanwhile").await;
                    }
                    continue;
                };
                let head = read_head(&mut sock).await;
                waiting.push((sock, head));
                if waiting.len() == 2 {
                    for (mut sock, head) in waiting.drain(..) {
                        let (arn, secret) = if head.contains(&percent_encode(DB_ARN)) {
                            (DB_ARN, r#"{"username": "u", "password": "p", "host": "h"}"#)
                        } else {
                            (TOKENS_ARN, r#"{"admin_tokens": "ops:adm1"}"#)
                        };
                        answer(&mut sock, 200, &get_secret_value(arn, secret)).await;
                    }
                }
            }
        });
        let env = lookup(&[
            (DATABASE_SECRET_ARN, DB_ARN.into()),
            (TOKENS_SECRET_ARN, TOKENS_ARN.into()),
            ("AWS_SESSION_TOKEN", "t".into()),
            (EXTENSION_PORT, port.to_string()),
            (WAIT_MS, "0".into()),
        ]);
        let vars = resolve_env(env).await.expect("both read at once");
        assert!(vars.iter().any(|(k, v)| k == "DATABASE_URL" && v.starts_with("postgres://u:p@h:5432/")), "{vars:?}");
        assert!(vars.contains(&("POOLMGR_ADMIN_TOKENS".to_owned(), "ops:adm1".to_owned())), "{vars:?}");
    }

    #[tokio::test]
    async fn an_extension_that_keeps_failing_is_reported_after_the_wait() {
        let (port, seen) = fake_extension(vec![]).await;
        let env = lookup(&[
            (TOKENS_SECRET_ARN, TOKENS_ARN.into()),
            ("AWS_SESSION_TOKEN", "t".into()),
            (EXTENSION_PORT, port.to_string()),
            (WAIT_MS, "300".into()),
        ]);
        let err = resolve_env(env).await.unwrap_err().to_string();
        assert!(
            err.contains(TOKENS_SECRET_ARN) && err.contains("HTTP 404") && err.contains("no more answers"),
            "{err}"
        );
        assert!(seen.lock().unwrap().len() >= 2, "retried within the wait");
    }

    #[tokio::test]
    async fn a_secret_that_does_not_parse_names_the_arn_not_the_value() {
        let (port, _) = fake_extension(vec![(200, get_secret_value(DB_ARN, "hunter2"))]).await;
        let env = lookup(&[
            (DATABASE_SECRET_ARN, DB_ARN.into()),
            ("AWS_SESSION_TOKEN", "t".into()),
            (EXTENSION_PORT, port.to_string()),
        ]);
        let err = resolve_env(env).await.unwrap_err().to_string();
        assert!(err.contains(DB_ARN) && err.contains("neither"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}
