//! `poolmgrctl lease …`, including the idempotent, retrying claim.

use std::time::Duration;

use poolmgr_core::domain::{MAX_REQUEST_ID_BYTES, PoolRef};
use reqwest::Method;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::cli::{Format, LeaseCmd};
use crate::client::Req;
use crate::error::CliError;
use crate::output::{Table, cell, emit, emit_document, pool_cell};
use crate::{Ctx, parse_pool_ref};

/// Transient failures of an idempotent claim are retried this long when --wait is not given.
const DEFAULT_TRANSIENT_RETRY: Duration = Duration::from_secs(30);
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub async fn run(ctx: &Ctx, cmd: LeaseCmd) -> Result<(), CliError> {
    match cmd {
        LeaseCmd::Claim { pool, request_id, auto_request_id, wait } => {
            let pool = parse_pool_ref(&pool)?;
            let request_id = match (request_id, auto_request_id) {
                (_, true) => Some(uuid::Uuid::new_v4().to_string()),
                (Some(r), false) if r.is_empty() => None,
                (r, false) => r,
            };
            if let Some(r) = &request_id
                && r.len() > MAX_REQUEST_ID_BYTES
            {
                return Err(CliError::usage(format!(
                    "--request-id is {} bytes long; at most {MAX_REQUEST_ID_BYTES} bytes are allowed",
                    r.len()
                )));
            }
            claim(ctx, &pool, request_id.as_deref(), auto_request_id, wait).await
        }
        LeaseCmd::Heartbeat { lease_id } => {
            let r = ctx.client.send(Req::new(Method::POST, &["v1", "leases", &lease_id, "heartbeat"])).await?;
            show(ctx, &r.raw, std::slice::from_ref(&r.json["lease"]))
        }
        LeaseCmd::Release { lease_id } => {
            ctx.client.send(Req::new(Method::DELETE, &["v1", "leases", &lease_id])).await?;
            if ctx.format == Format::Table {
                emit(&format!("lease {lease_id} released\n"))?;
            }
            Ok(())
        }
        LeaseCmd::Get { lease_id } => {
            let r = ctx.client.send(Req::get(&["v1", "leases", &lease_id])).await?;
            show(ctx, &r.raw, std::slice::from_ref(&r.json))
        }
        LeaseCmd::List { pool, page_size } => {
            let pool = pool.as_deref().map(parse_pool_ref).transpose()?;
            list(ctx, pool.as_ref(), page_size).await
        }
    }
}

/// `POST /v1/claims`. With a request id, transient failures are retried with the same id: a
/// replay returns the lease an earlier, unanswered attempt created, so at most one VM is ever
/// claimed: until `wait` elapses, 30s without it. RESOURCE_EXHAUSTED is retried while `wait`
/// lasts, with or without an id (nothing was claimed).
async fn claim(
    ctx: &Ctx,
    pool: &PoolRef,
    request_id: Option<&str>,
    auto: bool,
    wait: Option<Duration>,
) -> Result<(), CliError> {
    let mut body = json!({"pool": {"namespace": pool.namespace, "name": pool.name}});
    if let Some(r) = request_id {
        body["request_id"] = json!(r);
        if auto {
            eprintln!("claim: request_id {r}");
        }
    }
    let start = Instant::now();
    let exhausted_until = start + wait.unwrap_or(Duration::ZERO);
    let transient_until = start + wait.unwrap_or(DEFAULT_TRANSIENT_RETRY);
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 1u32;
    loop {
        let err = match ctx.client.send(Req::new(Method::POST, &["v1", "claims"]).body(&body)).await {
            Ok(r) => {
                if attempt > 1 {
                    eprintln!(
                        "claim: attempt {attempt} succeeded after {:.1}s{}",
                        start.elapsed().as_secs_f64(),
                        if r.json["replayed"] == json!(true) { " (replayed)" } else { "" }
                    );
                }
                return match ctx.format {
                    Format::Table => emit(&claim_table(&r.json).render()),
                    f => emit_document(f, &r.raw),
                };
            }
            Err(e) => e,
        };
        let until = match err.status.as_str() {
            "resource_exhausted" => exhausted_until,
            _ if request_id.is_some() && err.is_transient() => transient_until,
            _ => return Err(err),
        };
        let now = Instant::now();
        if now >= until {
            if attempt > 1 {
                eprintln!("claim: giving up after {attempt} attempts in {:.1}s", start.elapsed().as_secs_f64());
            }
            return Err(err);
        }
        let delay = backoff.max(err.retry_after.unwrap_or_default()).min(until - now);
        eprintln!(
            "claim: attempt {attempt}: {err}; retrying in {:.1}s ({:.0}s left)",
            delay.as_secs_f64(),
            (until - now).as_secs_f64()
        );
        tokio::time::sleep(delay).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        attempt += 1;
    }
}

fn claim_table(r: &Value) -> Table {
    let (lease, vm) = (&r["lease"], &r["vm"]);
    let mut t = Table::new(&["LEASE_ID", "POOL", "VM", "HOST", "EXPIRES", "REQUEST_ID", "REPLAYED"]);
    t.row(vec![
        cell(&lease["lease_id"]),
        pool_cell(&lease["pool"]),
        cell(&vm["id"]),
        cell(&vm["flintlock_host"]["name"]),
        cell(&lease["expires_at"]),
        cell(&lease["request_id"]),
        cell(&r["replayed"]),
    ]);
    t
}

fn show(ctx: &Ctx, raw: &[u8], leases: &[Value]) -> Result<(), CliError> {
    match ctx.format {
        Format::Table => {
            let mut t = Table::new(&["LEASE_ID", "POOL", "VM", "EXPIRES", "REQUEST_ID"]);
            for l in leases {
                t.row(vec![
                    cell(&l["lease_id"]),
                    pool_cell(&l["pool"]),
                    cell(&l["vm_uid"]),
                    cell(&l["expires_at"]),
                    cell(&l["request_id"]),
                ]);
            }
            emit(&t.render())
        }
        f => emit_document(f, raw),
    }
}

#[derive(Deserialize, Serialize)]
struct Page {
    leases: Vec<Box<RawValue>>,
    #[serde(default)]
    next_page_token: String,
}

/// Every page of `GET /v1/leases`, printed as one answer (`next_page_token` empty).
async fn list(ctx: &Ctx, pool: Option<&PoolRef>, page_size: Option<i64>) -> Result<(), CliError> {
    let mut all = Page { leases: Vec::new(), next_page_token: String::new() };
    let mut token = String::new();
    loop {
        let mut req = Req::get(&["v1", "leases"]);
        if let Some(p) = pool {
            req = req.query("namespace", &p.namespace).query("pool", &p.name);
        }
        if let Some(n) = page_size {
            req = req.query("page_size", n);
        }
        if !token.is_empty() {
            req = req.query("page_token", &token);
        }
        let r = ctx.client.send(req).await?;
        let page: Page = serde_json::from_slice(&r.raw)
            .map_err(|e| CliError::new("unknown", format!("unexpected answer to GET /v1/leases: {e}")))?;
        all.leases.extend(page.leases);
        if page.next_page_token.is_empty() || page.next_page_token == token {
            break;
        }
        token = page.next_page_token;
    }
    let raw = serde_json::to_vec(&all).map_err(|e| CliError::new("internal", e.to_string()))?;
    let leases: Vec<Value> = all.leases.iter().map(|l| serde_json::from_str(l.get()).unwrap_or(Value::Null)).collect();
    show(ctx, &raw, &leases)
}
