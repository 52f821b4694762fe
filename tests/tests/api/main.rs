//! The integration suite as one test binary, one module per area (zero-to-production's
//! `tests/api/main.rs` shape): the stack is linked once instead of once per file. The
//! harness (`TestApp`, typed helpers per endpoint, factories) is the `poolmgr_tests` library
//! in `tests/src/`, shared with the `poolmgrctl` and `poolmgr-check` tests.
//!
//! Every test here shares one process with all the others, run in parallel: a test must never
//! change process-wide state (environment variables, statics). Configuration belongs to each
//! test's own `AppState` (the statement timeout, for one, to its database handle `db::Db`),
//! so a test that sets a 1 s limit cannot reach its neighbours.
//!
//! Run one area with a filter: `scripts/test.sh -p poolmgr-tests --test api claims::`.
//!
//! | module | what it covers |
//! |---|---|
//! | `autoscaling` | the `autoscaling` block: demand, refusals, stabilization, the ceiling, `…/expect` (issue 22) |
//! | `bad_input` | malformed, oversized and unauthenticated requests on every route |
//! | `binaries` | the server binaries' `--help` and `--version`: every variable, nothing started (issue 26) |
//! | `claims` | `POST /v1/claims` and its races |
//! | `db_resilience` | dead connections, an unreachable database, schema mismatch, EMF |
//! | `db_role` | the runtime database role: DML only, granted by migrate (issue 25) |
//! | `db_tls` | TLS to PostgreSQL: each `sslmode`, the CA, the host name (a TLS-only server) |
//! | `debug_logs` | trace-level logs of real processes carry no bearer token and no host secret (issue 25) |
//! | `events_metrics` | `GET /v1/events`, `GET /metrics`, `/healthz` |
//! | `faults` | vanished microVMs, dead and hung hosts, network blips in hooks, cleanup under load (issue 23) |
//! | `flintlock_client` | the flintlock client against flintlock-sim over gRPC |
//! | `harness` | the typed reads of `TestResponse` are as strict as the wire |
//! | `hooks` | create and pre-lease hooks, the two-phase claim |
//! | `hosts` | `/v1/hosts…` and `/v1/vms…` |
//! | `lambda_lifecycle` | the claims and reconcile binaries under an emulated Lambda Runtime API and secrets extension |
//! | `local_server` | `poolmgr-local`'s header-read timeout and connection cap, on the real binary (issue 25) |
//! | `leases` | `/v1/leases…`: get, heartbeat, release, list, and their races |
//! | `migrations` | schema upgrades and version checks |
//! | `monitoring` | `infra/monitoring` against the real `/metrics`, the metrics it reads, `/livez`, `/readyz` |
//! | `openapi` | `/openapi.json` against the Routers, the SAM template and real answers |
//! | `pagination` | the paginated lists of pools, hosts and VMs (issue 25) |
//! | `pool_etags` | pool ETags and `If-Match` on `PUT /v1/pools/…`, and its race (issue 26) |
//! | `pools` | `/v1/pools…` and the delete races |
//! | `principals` | client scopes and live-lease quotas (`/v1/principals…`), on both claim paths, under races (issue 25) |
//! | `reconcile` | the reconcile pass |
//! | `refill` | refill in seconds: wakes, the reconcile loop and its lease, hand-offs (issue 22) |
//! | `rules` | every request rule of `/openapi.json` against the validators, at its boundaries |
//! | `selection` | which pools a pass steps (issue 15), overlapping passes over them, creates across hosts |
//! | `spec_policy` | the deployment's spec policy: host directories, bridges, image prefixes (issue 25) |
//! | `statement_timeout` | the client-side statement timeout and its server-side cancel |
//! | `template` | `infra/template.yaml`: what cfn-lint cannot judge (TLS, concurrency, alarms, …) |

mod autoscaling;
mod bad_input;
mod binaries;
mod claims;
mod credentials;
mod db_resilience;
mod db_role;
mod db_tls;
mod debug_logs;
mod events_metrics;
mod faults;
mod flintlock_client;
mod harness;
mod hooks;
mod hosts;
mod lambda_lifecycle;
mod leases;
mod local_server;
mod migrations;
mod monitoring;
mod openapi;
mod pagination;
mod pool_etags;
mod pools;
mod principals;
mod reconcile;
mod refill;
mod rollouts;
mod rules;
mod selection;
mod spec_policy;
mod statement_timeout;
mod template;
