//! poolmgr's core: everything the HTTP functions, the reconcile function and `poolmgr-local`
//! share. Function binaries are thin: they read [`config::Config`], build an
//! [`app::AppState`] once, and serve a Router from [`http`].
//!
//! Correctness lives in PostgreSQL transactions and constraints, never in process memory:
//! any number of processes may run these functions at once.
//!
//! # Layout
//!
//! - [`domain`], [`template`]: parsed, validated types (PoolSpec, RequestId, phases, …).
//! - [`store`]: every SQL statement and the one row mapping of each table, one file per
//!   table (`store/mod.rs` says what lives where).
//! - [`db`]: connection pool, refinery migrations, schema version check.
//! - [`service`]: claim, lease, pool and host operations.
//! - [`http`]: the Routers of the HTTP contract, one file per function's routes, its
//!   extractors and its OpenAPI document; [`api`]: its JSON objects; [`error`]: its error shape.
//! - [`auth`]: bearer tokens and principals; [`config`]: environment configuration;
//!   [`secrets`]: secrets named by AWS Secrets Manager ARN, resolved into that configuration.
//! - [`reconcile`]: the reconcile pass, one file per step (strategy arithmetic, provisioning,
//!   create hooks, sweeps, orphans).
//! - [`teardown`]: the VM delete (flintlock, then rows) that `service` and `reconcile` share.
//! - [`flintlock`]: the gRPC client for flintlock hosts.
//! - [`metrics`]: Prometheus counters, and their CloudWatch EMF lines on Lambda;
//!   [`telemetry`]: JSON logs.

pub mod api;
pub mod app;
pub mod auth;
pub mod clock;
pub mod config;
pub mod db;
pub mod domain;
pub mod error;
pub mod flintlock;
pub mod http;
pub mod metrics;
pub mod reconcile;
pub mod secrets;
pub mod service;
pub mod store;
pub mod teardown;
pub mod telemetry;
pub mod template;

pub use app::AppState;
pub use config::Config;
