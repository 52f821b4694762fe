//! A typed client of the poolmgr HTTP API (`shared/http-api.md`), for programs that claim
//! warm microVMs (CI runners, sandbox services) and for `poolmgrctl`.
//!
//! Retries are safe by default: [`Client::claim`] picks one `request_id` per logical claim
//! and retries connection failures, time-outs, 503, 409 ABORTED and 429 (honouring
//! `Retry-After`) with that same id, so an answer lost on the way back can never cost a
//! second VM. [`Client::keep_alive`] heartbeats the lease in the background until the
//! returned guard is released or dropped.
//!
//! ```no_run
//! use std::time::Duration;
//! use poolmgr_client::{Client, PoolRef};
//!
//! # async fn run() -> Result<(), poolmgr_client::Error> {
//! let client = Client::builder("http://127.0.0.1:8080").token(std::env::var("POOLMGR_TOKEN").unwrap_or_default()).build()?;
//! let claim = client.claim(&PoolRef::new("default", "ci").unwrap()).await?;   // retried safely
//! println!("VM {} on {}", claim.vm.id, claim.vm.flintlock_host.address);
//! let lease = client.keep_alive(&claim.lease);                                // heartbeats until released
//! // ... run the job on the VM ...
//! lease.release(Duration::from_secs(30)).await?;                              // the VM is deleted
//! # Ok(()) }
//! ```
//!
//! Never depends on poolmgr's server crates: only HTTP, JSON and Tokio.
//!
//! # Layout
//!
//! - [`client`]: [`Client`] and its builder, [`Call`] (one constructor per route: method,
//!   path, query, body), one typed method per route, and [`Client::send`] for the raw answer.
//! - [`claim`]: [`Client::claim`] / [`Client::claim_with`], [`ClaimOptions`], [`Backoff`].
//! - [`keepalive`]: [`Client::keep_alive`] and [`LeaseGuard`].
//! - [`types`]: the contract's JSON objects, tolerant of fields a newer server adds.
//! - [`error`]: [`Error`], with the contract's [`Status`] values.

pub mod claim;
pub mod client;
pub mod error;
pub mod keepalive;
pub mod types;

pub use claim::{Backoff, ClaimOptions, Claimed, OnRetry, RetryNotice};
pub use client::{Call, Client, ClientBuilder, Reply};
pub use error::{ApiError, Error, Status, TransportKind};
pub use keepalive::{LeaseGuard, LeaseState};
pub use types::*;
