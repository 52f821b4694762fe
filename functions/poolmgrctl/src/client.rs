//! The HTTP client: one request per call, the contract's error body turned into a
//! [`CliError`], transport failures into `unavailable`.

use std::time::Duration;

use reqwest::{Method, Url};
use serde_json::Value;

use crate::error::{CliError, snake, status_for_http};

pub struct Client {
    http: reqwest::Client,
    base: Url,
    token: Option<String>,
    timeout: Duration,
}

/// A successful answer: the body exactly as received, and parsed (`Null` for an empty body).
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub raw: Vec<u8>,
    pub json: Value,
}

/// A request: path segments under the endpoint (each one escaped), query pairs, optional body.
pub struct Req<'a> {
    pub method: Method,
    pub path: Vec<&'a str>,
    pub query: Vec<(&'a str, String)>,
    pub body: Option<&'a Value>,
    /// Extra time on top of the global time-out (long-polls).
    pub extra_timeout: Duration,
}

impl<'a> Req<'a> {
    pub fn new(method: Method, path: &[&'a str]) -> Req<'a> {
        Req { method, path: path.to_vec(), query: Vec::new(), body: None, extra_timeout: Duration::ZERO }
    }

    pub fn get(path: &[&'a str]) -> Req<'a> {
        Req::new(Method::GET, path)
    }

    pub fn query(mut self, key: &'a str, value: impl ToString) -> Req<'a> {
        self.query.push((key, value.to_string()));
        self
    }

    pub fn body(mut self, body: &'a Value) -> Req<'a> {
        self.body = Some(body);
        self
    }
}

/// The innermost cause: for a connection failure, the part that says what went wrong.
fn root_cause(e: &dyn std::error::Error) -> String {
    let mut cur = e;
    while let Some(s) = cur.source() {
        cur = s;
    }
    cur.to_string()
}

/// A message from an error and its causes, without repeating what the outer one already says.
fn chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = s.source();
    }
    parts.join(": ")
}

impl Client {
    pub fn new(endpoint: &str, token: Option<String>, timeout: Duration) -> Result<Client, CliError> {
        let base = Url::parse(endpoint.trim())
            .map_err(|e| CliError::usage(format!("--endpoint {endpoint:?} is not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() || base.host().is_none() {
            return Err(CliError::usage(format!(
                "--endpoint {endpoint:?} must be an http:// or https:// URL, e.g. http://127.0.0.1:8080"
            )));
        }
        if timeout.is_zero() {
            return Err(CliError::usage("--timeout must be more than 0"));
        }
        let http = reqwest::Client::builder()
            .user_agent(concat!("poolmgrctl/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(timeout)
            .build()
            .map_err(|e| CliError::new("internal", format!("cannot build the HTTP client: {}", chain(&e))))?;
        Ok(Client { http, base, token: token.filter(|t| !t.is_empty()), timeout })
    }

    pub fn endpoint(&self) -> &str {
        self.base.as_str()
    }

    pub fn url(&self, path: &[&str], query: &[(&str, String)]) -> Url {
        let mut url = self.base.clone();
        {
            let mut segs = url.path_segments_mut().expect("checked in new: the endpoint can be a base");
            segs.pop_if_empty();
            segs.extend(path);
        }
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        url
    }

    pub async fn send(&self, req: Req<'_>) -> Result<Reply, CliError> {
        let url = self.url(&req.path, &req.query);
        let timeout = self.timeout + req.extra_timeout;
        let mut b = self.http.request(req.method.clone(), url.clone()).timeout(timeout);
        if let Some(t) = &self.token {
            b = b.bearer_auth(t);
        }
        if let Some(body) = req.body {
            b = b.json(body);
        }
        let transport = |e: reqwest::Error| -> CliError {
            if e.is_timeout() {
                CliError::unavailable(format!(
                    "no answer from {} within {} ({} {})",
                    self.base,
                    humantime::format_duration(timeout),
                    req.method,
                    url.path()
                ))
            } else if e.is_connect() {
                CliError::unavailable(format!("cannot connect to {}: {}", self.base, root_cause(&e)))
            } else {
                CliError::unavailable(format!("{} {} failed: {}", req.method, url.path(), chain(&e)))
            }
        };
        let resp = b.send().await.map_err(transport)?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let raw = resp.bytes().await.map_err(transport)?.to_vec();
        if (200..300).contains(&status) {
            let json = if raw.iter().all(u8::is_ascii_whitespace) {
                Value::Null
            } else {
                serde_json::from_slice(&raw).map_err(|e| {
                    CliError::new(
                        "unknown",
                        format!("{} {} answered {status} with a body that is not JSON: {e}", req.method, url.path()),
                    )
                })?
            };
            return Ok(Reply { status, headers, raw, json });
        }
        let retry_after = headers
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let mut err = match serde_json::from_slice::<Value>(&raw) {
            Ok(v) if v["error"]["status"].is_string() => CliError::new(
                &snake(v["error"]["status"].as_str().unwrap_or_default()),
                v["error"]["message"].as_str().unwrap_or_default(),
            ),
            _ => {
                let text = String::from_utf8_lossy(&raw);
                let text: String = text.trim().chars().take(200).collect();
                CliError::new(
                    status_for_http(status),
                    format!(
                        "{} {} answered HTTP {status}{}",
                        req.method,
                        url.path(),
                        if text.is_empty() { String::new() } else { format!(": {text}") }
                    ),
                )
            }
        };
        err.retry_after = retry_after;
        if err.status == "unauthenticated" && self.token.is_none() {
            err.message.push_str(" (no token given: set --token or POOLMGR_TOKEN)");
        }
        Err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_escape_segments_and_keep_a_base_path() {
        let c = Client::new("http://h:1/prefix/", None, Duration::from_secs(1)).unwrap();
        assert_eq!(c.url(&["v1", "vms", "a/b c"], &[]).as_str(), "http://h:1/prefix/v1/vms/a%2Fb%20c");
        let c = Client::new("http://h:1", None, Duration::from_secs(1)).unwrap();
        assert_eq!(
            c.url(&["v1", "leases"], &[("namespace", "default".into()), ("pool", "ci".into())]).as_str(),
            "http://h:1/v1/leases?namespace=default&pool=ci"
        );
    }

    #[test]
    fn endpoints_must_be_http_urls() {
        for bad in ["127.0.0.1:8080", "ftp://x", "nonsense", ""] {
            let e = Client::new(bad, None, Duration::from_secs(1)).err().unwrap_or_else(|| panic!("{bad} accepted"));
            assert_eq!(e.exit_code(), 2, "{bad}");
        }
    }
}
