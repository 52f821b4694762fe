//! The HTTP server loop of `poolmgr-local`: `axum::serve` sets no header-read timeout and
//! takes any number of connections (issue 25 item 11), so a client that opens connections and
//! sends nothing, or a header a byte a minute, could hold every socket and task. Here:
//!
//! - at most `POOLMGR_HTTP_MAX_CONNECTIONS` (1024) connections are served at once; one more
//!   waits in the kernel's accept queue until another closes;
//! - a connection that has not sent a whole request head within
//!   `POOLMGR_HTTP_HEADER_TIMEOUT_SECONDS` (10) of opening (or of its previous answer, on a
//!   kept-alive connection) is closed, including one that sends nothing at all. HTTP/1.1
//!   only: hyper-util's auto builder reads the first bytes to choose HTTP/1 or HTTP/2 before
//!   any timer runs, so a silent connection would hold its slot for ever (poolmgr's clients
//!   speak HTTP/1.1; behind a proxy, the proxy speaks it);
//! - on SIGINT/SIGTERM no new connection is taken and the open ones finish their requests.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connection limits, from the environment (through `poolmgr_core::cli`).
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

impl Limits {
    pub fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> anyhow::Result<Limits> {
        let num = |key: &str, default: u64| -> anyhow::Result<u64> {
            match lookup(key) {
                None => Ok(default),
                Some(v) if v.trim().is_empty() => Ok(default),
                Some(v) => match v.trim().parse::<u64>() {
                    Ok(n) if n >= 1 => Ok(n),
                    _ => anyhow::bail!("{key} must be a whole number of at least 1, got {v:?}"),
                },
            }
        };
        Ok(Limits {
            max_connections: num("POOLMGR_HTTP_MAX_CONNECTIONS", 1024)? as usize,
            header_timeout: Duration::from_secs(num("POOLMGR_HTTP_HEADER_TIMEOUT_SECONDS", 10)?),
        })
    }
}

/// Serves `router` on `listener` until `shutdown` completes, then lets open connections
/// finish their requests (at most 30 s).
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut warned_full = false;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if !warned_full {
                    tracing::warn!(
                        max = limits.max_connections,
                        "POOLMGR_HTTP_MAX_CONNECTIONS connections are open: new ones wait until one closes"
                    );
                    warned_full = true;
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => slot.context("the connection slots closed")?,
                    () = &mut shutdown => break,
                }
            }
        };
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        warned_full = false;
        // An answer goes out the moment it is written, never held back for Nagle's algorithm.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY on an accepted connection");
        }
        let conn =
            graceful.watch(builder.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(router.clone())));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    tracing::info!("shutting down: finishing open requests");
    if tokio::time::timeout(Duration::from_secs(30), graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after 30 s; stopping anyway");
    }
    Ok(())
}
