//! poolmgr's core: everything the HTTP functions, the reconcile function and `poolmgr-local`
//! share. Function binaries are thin: they read [`config::Config`], build an
//! [`app::AppState`] once, and serve a Router from [`http`].
//!
//! Correctness lives in PostgreSQL transactions and constraints, never in process memory:
//! any number of processes may run these functions at once.
//!
//! # Layout
//!
//! Layers, each importing only those below it (no import circle):
//! `http` → `service` → (`teardown`, `store`, `flintlock`); `reconcile` → (`teardown`,
//! `store`, `flintlock`); everything → `domain`. Each folder's `mod.rs` says what lives where.
//!
//! - [`domain`], [`template`]: parsed, validated types (PoolSpec, RequestId, phases, the name
//!   pattern, VM counts, …). No I/O. [`rules`]: the limits and patterns their validators
//!   check, and the schema-only types that state them in the OpenAPI document.
//!   [`deployment`]: which flintlock namespaces are this deployment's (the orphan scan's
//!   attribution). No I/O.
//! - [`store`]: every SQL statement and the one row mapping of each table, one file per table
//!   (`pool.rs`, `host.rs`, `vm.rs`, `lease.rs`, `event.rs`, and `claim.rs` for the claim
//!   statements); runs on any [`store::Executor`].
//! - [`db`]: the database handle [`db::Db`] (the pool and the statement limits its
//!   connections carry), refinery migrations, schema version check; [`db_tls`]: the TLS of
//!   every connection (`sslmode`, trust anchors, rustls verifiers).
//! - [`clock`]: what "now" is for time comparisons (the database's, or a test's).
//! - [`service`]: the operations behind the routes (claim, lease, pool, host, vm, event, ops);
//!   answers in [`error::ApiError`].
//! - [`http`]: the Routers of the HTTP contract, one file per function's routes, its
//!   extractors and its OpenAPI document; [`api`]: its JSON objects; [`error`]: its error shape.
//! - [`auth`]: bearer tokens and principals; [`config`]: environment configuration;
//!   [`cli`]: the binaries' `--help`/`--version` and the table of every variable they read;
//!   [`secrets`]: secrets named by AWS Secrets Manager ARN, resolved into that configuration;
//!   [`credentials`]: hosts' secrets encrypted at rest (the keyring).
//! - [`reconcile`]: the reconcile pass, one file per step (strategy arithmetic, provisioning,
//!   create hooks, sweeps, orphans), with its own error type that says whether a retry helps.
//! - [`teardown`]: the VM delete (flintlock, then rows) that `service` and `reconcile` share.
//! - [`flintlock`]: the gRPC client for flintlock hosts, given a [`flintlock::Endpoint`].
//! - [`wake`]: waking the reconciler after a claim, a release or a hint (a Lambda invoke
//!   signed with SigV4, or poolmgr-local's ticker signal).
//! - [`metrics`]: Prometheus counters and the one list of pool gauges, and their CloudWatch
//!   EMF lines on Lambda; [`telemetry`]: JSON logs.

pub mod api;
pub mod app;
pub mod auth;
pub mod cli;
pub mod clock;
pub mod config;
pub mod credentials;
pub mod db;
pub mod db_role;
pub mod db_tls;
pub mod deployment;
pub mod domain;
pub mod error;
pub mod flintlock;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod policy;
pub mod reconcile;
pub mod rules;
pub mod secrets;
pub mod service;
pub mod store;
pub mod teardown;
pub mod telemetry;
pub mod template;
pub mod wake;

pub use app::AppState;
pub use config::Config;
