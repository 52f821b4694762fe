//! A typed client of the poolmgr HTTP API (`shared/http-api.md`), for programs that claim
//! warm microVMs (CI runners, sandbox services) and for `poolmgrctl`.
//!
//! Retries are safe by default: [`Client::claim`] picks one `request_id` per logical claim
//! and retries connection failures, time-outs, 503, 409 ABORTED and 429 (honouring
//! `Retry-After`) with that same id, so an answer lost on the way back can never cost a
//! second VM. Calls that are safe to repeat (GETs, heartbeats, releases) are retried a few
//! times on transient failures ([`RetryPolicy`]); other writes never are.
//! [`Client::run_leased`] runs a job under a lease: claim, heartbeats, release whatever
//! happens.
//!
//! ```no_run
//! use poolmgr_client::{ClaimOptions, Client, PoolRef};
//!
//! # async fn run() -> Result<(), poolmgr_client::Error> {
//! let client = Client::builder("https://poolmgr.example.com")
//!     .token(std::env::var("POOLMGR_TOKEN").unwrap_or_default())
//!     .ca_file("/etc/poolmgr/ca.pem")      // a private CA, on top of the platform's roots
//!     .build()?;
//! let pool = PoolRef::parse("default/ci")?;
//! let run = client
//!     .run_leased(&pool, &ClaimOptions::default(), |lease| async move {
//!         // ... run the job on lease.vm() ...
//!         lease.vm().id.clone()
//!     })
//!     .await?;                                // the lease is released by now
//! println!("ran on {}", run.output);
//! # Ok(()) }
//! ```
//!
//! Never depends on poolmgr's server crates: only HTTP, JSON and Tokio.
//!
//! # TLS
//!
//! Cargo features pick the TLS backend: `rustls-native-roots` (default: rustls trusting the
//! platform's trust store, e.g. `/etc/ssl/certs`, or `SSL_CERT_FILE`), `rustls-webpki-roots`
//! (Mozilla's roots compiled in; with the first, both sets), `native-tls` (the platform's TLS
//! library). [`ClientBuilder::ca_file`] and [`ClientBuilder::add_root_certificate`] add a
//! private CA on top of any of them. Without any of these features the client speaks plain
//! `http://` only, and [`ClientBuilder::build`] refuses an `https://` endpoint.
//!
//! # Layout
//!
//! - [`client`]: [`Client`] and its builder, [`Call`] (one constructor per route: method,
//!   path, query, body), one typed method per route, [`Client::send`] for the raw answer,
//!   [`Pages`] for the paginated lists.
//! - [`claim`]: [`Client::claim`] / [`Client::claim_with`], [`ClaimOptions`].
//! - [`retry`]: [`Backoff`] and [`RetryPolicy`].
//! - [`keepalive`]: [`Client::keep_alive`], [`LeaseGuard`] and [`LeaseWatch`].
//! - [`run`]: a job under a lease, [`Client::run_leased`].
//! - [`events`]: [`Client::event_feed`], [`EventFeed`].
//! - [`types`]: the contract's JSON objects, tolerant of fields a newer server adds.
//! - [`error`]: [`Error`], with the contract's [`Status`] values, and [`ValidationError`].

#![warn(missing_docs)]

pub mod claim;
pub mod client;
pub mod error;
pub mod events;
pub mod keepalive;
pub mod retry;
pub mod run;
pub mod types;

pub use claim::{ClaimOptions, Claimed, OnRetry, RetryNotice};
pub use client::{Call, Client, ClientBuilder, DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT, Page, Pages, Reply};
pub use error::{ApiError, Error, REASON_HOOK_FAILED, Status, TransportKind, TransportSource, ValidationError};
pub use events::EventFeed;
pub use keepalive::{LeaseGuard, LeaseState, LeaseWatch, RELEASE_DEADLINE};
pub use retry::{Backoff, MIN_BACKOFF, RetryPolicy};
pub use run::{ActiveLease, LeasedRun};
pub use types::*;

/// The HTTP method of a [`Call`] (the `http` crate's, through `reqwest`), for [`Call::new`].
pub use reqwest::Method;
