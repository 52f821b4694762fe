//! `poolmgr-local`: every HTTP function's Router on one address with `axum::serve`, for
//! development and single-machine installs. Migrates the database at start.
//!
//! [`fault`] can lose claim answers on purpose for chaos runs and tests; it is off unless
//! its variable is set, and exists in this binary only.

mod fault;
mod serve;

use anyhow::Context;
use std::sync::Arc;

use poolmgr_core::wake::Waker;
use poolmgr_core::{AppState, Config, cli, db, http, reconcile, telemetry};
use tokio::sync::Notify;

const ABOUT: &str = "poolmgr's HTTP API (every function's routes) and a reconcile ticker on one address, \
                     for development and single-machine installs. Migrates the database at start. With \
                     POOLMGR_WAKE_LAMBDA_FUNCTION set, each wake is signed with AWS_ACCESS_KEY_ID, \
                     AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, read from the environment only.";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything starts: `--help` and `--version` answer and exit here. Every variable
    // below is read through the one table `--help` prints (poolmgr_core::cli).
    let args = cli::Args::parse("poolmgr-local", ABOUT, cli::POOLMGR_LOCAL);
    let lookup = args.lookup();
    telemetry::init_with(lookup("RUST_LOG").as_deref());
    let cfg = Config::from_lookup(&lookup)?;
    let limits = serve::Limits::from_lookup(&lookup)?;
    let lose_claim_answer_every = fault::lose_claim_answer_every(&lookup)?;
    let addr = lookup("POOLMGR_HTTP_ADDR").filter(|a| !a.trim().is_empty()).unwrap_or_else(|| "127.0.0.1:8080".into());
    let applied = db::migrate_url(&cfg.database_url, &cfg.db_tls).await.context("migrating the database")?;
    tracing::info!(?applied, version = db::latest_version(), "schema ready");
    let pool = db::pool_from_config(&cfg)?;
    let mut state = AppState::new(&cfg, pool);
    // Claims, releases and hints wake the in-process ticker (unless a Lambda wake is
    // configured: the deployed shape, with the reconciler elsewhere).
    if state.waker.is_off() {
        state = state.with_waker(Waker::local(Arc::new(Notify::new())));
    }
    let mut router = http::router(state.clone());
    if let Some(every) = lose_claim_answer_every {
        tracing::warn!(
            every,
            "fault injection on: the answer of every {every}. fresh claim is lost after it committed"
        );
        router = fault::lose_claim_answers(router, every);
    }
    let (stop_ticker, stop) = reconcile::Stop::new();
    let ticker = if cfg.reconcile.ticker {
        Some(tokio::spawn(reconcile::run_ticker(state.clone(), stop)))
    } else {
        tracing::info!("POOLMGR_RECONCILE_TICKER=off: no reconciler in this process");
        None
    };
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}: set POOLMGR_HTTP_ADDR to a free address"))?;
    let local = listener.local_addr()?;
    tracing::info!(%local, max_connections = limits.max_connections, header_timeout = ?limits.header_timeout, "poolmgr-local listening");
    println!("poolmgr-local listening on http://{local}");
    // On SIGTERM or Ctrl-C the ticker stops with the HTTP server: it finishes the pass in
    // flight and gives the reconcile loop lease back, so another poolmgr-local on the same
    // database (or this one restarted) loops at once instead of after the lease runs out.
    let signalled = async {
        shutdown().await;
        let _ = stop_ticker.send(true);
    };
    serve::serve(listener, router, limits, signalled).await.context("serving HTTP")?;
    if let Some(ticker) = ticker {
        // Past the longest a pass may take the lease runs out by itself.
        if tokio::time::timeout(reconcile::pass_room(&cfg), ticker).await.is_err() {
            tracing::warn!("the reconcile pass in flight did not finish; its loop lease runs out by itself");
        }
    }
    tracing::info!("poolmgr-local stopped");
    Ok(())
}

async fn shutdown() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
