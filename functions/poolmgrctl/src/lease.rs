//! `poolmgrctl lease …`. The retrying claim is `poolmgr-client`'s; this file picks its
//! options from the flags and reports its progress on standard error.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use poolmgr_client::{Call, ClaimOptions, ClaimRequest, Claimed, LeaseQuery, PoolRef, RetryNotice};
use serde_json::Value;

use crate::cli::{Format, LeaseCmd};
use crate::error::CliError;
use crate::output::{Table, cell, emit_document, pool_cell, printable};
use crate::{Ctx, parse_pool_ref};

/// Transient failures of an idempotent claim are retried this long when --wait is not given.
pub const DEFAULT_TRANSIENT_RETRY: Duration = Duration::from_secs(30);

pub async fn run(ctx: &Ctx, cmd: LeaseCmd) -> Result<(), CliError> {
    match cmd {
        LeaseCmd::Claim { pool, request_id, auto_request_id, wait } => {
            let pool = parse_pool_ref(&pool)?;
            let request_id = request_id.filter(|r| !r.is_empty());
            claim(ctx, &pool, request_id, auto_request_id, wait).await
        }
        LeaseCmd::Run { pool, request_id, wait, kill_after, command } => {
            let pool = parse_pool_ref(&pool)?;
            crate::run::run(ctx, &pool, request_id.filter(|r| !r.is_empty()), wait, kill_after, command).await
        }
        LeaseCmd::Heartbeat { lease_id } => {
            let r = ctx.send(Call::heartbeat(&lease_id)).await?;
            let v: Value = r.json()?;
            show(ctx, &r.body, std::slice::from_ref(&v["lease"]))
        }
        LeaseCmd::Release { lease_id } => {
            // NOT_FOUND after an attempt whose answer was lost is that attempt's release: the
            // client's send counts it as released.
            ctx.send(Call::release(&lease_id)).await?;
            ctx.done(&lease_id, &format!("lease {} released", printable(&lease_id)))
        }
        LeaseCmd::Get { lease_id } => {
            let r = ctx.send(Call::get_lease(&lease_id)).await?;
            show(ctx, &r.body, &[r.json()?])
        }
        LeaseCmd::List { pool, page_size } => {
            let pool = pool.as_deref().map(parse_pool_ref).transpose()?;
            list(ctx, pool, page_size).await
        }
    }
}

/// `POST /v1/claims`. With a request id — given, `--auto-request-id`, or generated for
/// `--wait` — the claim is `poolmgr-client`'s: retried with that same id until the deadline
/// (`--wait`, else 30 s for transient failures only), so at most one VM is claimed. Without
/// any, one attempt: a retry could claim a second VM.
async fn claim(
    ctx: &Ctx,
    pool: &PoolRef,
    request_id: Option<String>,
    auto: bool,
    wait: Option<Duration>,
) -> Result<(), CliError> {
    if request_id.is_none() && !auto && wait.is_none() {
        let r = ctx.send(Call::claim(&ClaimRequest::new(pool.clone(), None))).await?;
        return print_claim(ctx, &r.body, &r.json()?);
    }
    let id = match request_id {
        Some(r) => r,
        None => {
            let r = uuid::Uuid::new_v4().to_string();
            eprintln!("claim: request_id {r}");
            r
        }
    };
    let c = claim_reporting(ctx, pool, id, wait).await?;
    print_claim(ctx, &c.reply.body, &c.reply.json()?)
}

/// The retrying claim with request id `id`, its progress on standard error: until `wait`
/// (waiting for an empty pool to refill), or 30 s of transient failures without it.
pub async fn claim_reporting(
    ctx: &Ctx,
    pool: &PoolRef,
    id: String,
    wait: Option<Duration>,
) -> Result<Claimed, CliError> {
    let failed = Arc::new(AtomicU32::new(0));
    let seen = failed.clone();
    let opts = ClaimOptions::default()
        .with_request_id(id)
        .with_deadline(wait.unwrap_or(DEFAULT_TRANSIENT_RETRY))
        .with_wait_for_vm(wait.is_some())
        .with_on_retry(move |n: &RetryNotice<'_>| {
            seen.store(n.attempt, Ordering::Relaxed);
            eprintln!(
                "claim: attempt {}: {}; retrying in {:.1}s ({:.0}s left)",
                n.attempt,
                CliError::from(n.error.clone()),
                n.delay.as_secs_f64(),
                n.remaining.as_secs_f64()
            );
        });
    let start = Instant::now();
    match ctx.client.claim_with(pool, &opts).await {
        Ok(c) => {
            if c.attempts > 1 {
                eprintln!(
                    "claim: attempt {} succeeded after {:.1}s{}",
                    c.attempts,
                    start.elapsed().as_secs_f64(),
                    if c.response.replayed { " (replayed)" } else { "" }
                );
            }
            Ok(c)
        }
        Err(e) => {
            let attempts = failed.load(Ordering::Relaxed) + 1;
            if attempts > 1 {
                eprintln!("claim: giving up after {attempts} attempts in {:.1}s", start.elapsed().as_secs_f64());
            }
            Err(ctx.explain(e))
        }
    }
}

fn print_claim(ctx: &Ctx, raw: &[u8], v: &Value) -> Result<(), CliError> {
    match &ctx.format {
        Format::Table => ctx.table(&claim_table(v)),
        f => emit_document(f, raw, || vec![cell(&v["lease"]["lease_id"])]),
    }
}

/// One name for one thing: `VM` is the VM's id (what `vm get` takes), `UID` its flintlock uid
/// (the lease tables show it under the same heading: a lease record carries only the uid).
fn claim_table(r: &Value) -> Table {
    let (lease, vm) = (&r["lease"], &r["vm"]);
    let mut t = Table::new(&["LEASE_ID", "POOL", "VM", "UID", "HOST", "EXPIRES", "REQUEST_ID", "REPLAYED"]);
    t.row(vec![
        cell(&lease["lease_id"]),
        pool_cell(&lease["pool"]),
        cell(&vm["id"]),
        cell(&vm["uid"]),
        cell(&vm["flintlock_host"]["name"]),
        cell(&lease["expires_at"]),
        cell(&lease["request_id"]),
        cell(&r["replayed"]),
    ]);
    t
}

fn show(ctx: &Ctx, raw: &[u8], leases: &[Value]) -> Result<(), CliError> {
    match &ctx.format {
        Format::Table => {
            // A LeaseRecord names its VM by flintlock uid only: `UID`, as in `lease claim`.
            let mut t = Table::new(&["LEASE_ID", "POOL", "UID", "EXPIRES", "REQUEST_ID"]);
            for l in leases {
                t.row(vec![
                    cell(&l["lease_id"]),
                    pool_cell(&l["pool"]),
                    cell(&l["vm_uid"]),
                    cell(&l["expires_at"]),
                    cell(&l["request_id"]),
                ]);
            }
            ctx.table(&t)
        }
        f => emit_document(f, raw, || leases.iter().map(|l| cell(&l["lease_id"])).collect()),
    }
}

/// Every page of `GET /v1/leases` (the library's paginator), printed as one answer
/// (`next_page_token` empty).
async fn list(ctx: &Ctx, pool: Option<PoolRef>, page_size: Option<i64>) -> Result<(), CliError> {
    let mut q = LeaseQuery::pool(pool);
    q.page_size = page_size;
    let (raw, leases) = ctx.list_all(Call::list_leases(&q), "leases").await?;
    show(ctx, &raw, &leases)
}
