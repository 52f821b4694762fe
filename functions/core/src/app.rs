//! The state every HTTP function and the reconcile pass share: built once per process and lent
//! to each request. On Lambda it is built by the first invocation of each execution
//! environment ([`Instance`], [`LazyRouter`]), never before the runtime asks for an event.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Router;
use axum::body::{Bytes, HttpBody};
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use tower::ServiceExt;

use crate::auth::AuthConfig;
use crate::clock::Clock;
use crate::config::{Config, ConfigError};
use crate::db::{Conn, Db, DbError};
use crate::deployment::Deployment;
use crate::error::ApiError;
use crate::flintlock::Flintlock;
use crate::metrics::Metrics;
use crate::secrets::SecretsError;
use crate::store::StoreError;
use crate::wake::Waker;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub auth: Arc<AuthConfig>,
    pub flintlock: Flintlock,
    pub metrics: Arc<Metrics>,
    pub config: Arc<Config>,
    /// What "now" is for time comparisons: the database's clock, or a test's ([`Clock`]).
    pub clock: Clock,
    /// Wakes the reconciler after a claim, a release or a demand hint ([`crate::wake`]).
    pub waker: Waker,
    /// Client scopes and quotas ([`crate::limits`]).
    pub limits: Arc<crate::limits::LimitsCache>,
    /// The last `/readyz` answer ([`crate::service::ops::HealthCache`]).
    pub health: Arc<crate::service::ops::HealthCache>,
    /// This deployment's namespaces, once known ([`AppState::deployment`]).
    deployment: Arc<tokio::sync::OnceCell<Deployment>>,
}

impl AppState {
    pub fn new(cfg: &Config, db: Db) -> AppState {
        if cfg.auth.disabled {
            tracing::warn!(
                "POOLMGR_AUTH=disabled: every request is served as admin without a token; never do this outside local development"
            );
        }
        let metrics = Arc::new(Metrics::with_emf(cfg.metrics_emf).in_namespace(&cfg.metrics_namespace));
        let observer = metrics.clone();
        let flintlock = Flintlock::new(cfg.flintlock_timeout)
            .with_keyring(cfg.credentials.clone())
            .with_error_observer(Arc::new(move |host, method| observer.flintlock_error(host, method)));
        AppState {
            db,
            auth: Arc::new(cfg.auth.clone()),
            flintlock,
            metrics,
            config: Arc::new(cfg.clone()),
            clock: Clock::system(),
            waker: Waker::from_config(&cfg.wake),
            limits: Arc::new(crate::limits::LimitsCache::new(cfg.principal_limits_cache)),
            health: Arc::new(crate::service::ops::HealthCache::new(cfg.health_cache)),
            deployment: Arc::default(),
        }
    }

    /// The same state with another waker (poolmgr-local: its ticker's signal; tests).
    pub fn with_waker(self, waker: Waker) -> AppState {
        AppState { waker, ..self }
    }

    /// The same state with another clock (tests: [`Clock::adjustable`]).
    pub fn with_clock(self, clock: Clock) -> AppState {
        AppState { clock, ..self }
    }

    /// This deployment's flintlock namespaces: its id from `POOLMGR_DEPLOYMENT_ID`, else the
    /// one the database generated (read once per process; it never changes).
    pub async fn deployment(&self) -> Result<Deployment, StoreError> {
        let d = self
            .deployment
            .get_or_try_init(|| async {
                let id = match &self.config.deployment_id {
                    Some(id) => id.clone(),
                    None => crate::store::deployment_get_id(&self.db.get().await?).await?,
                };
                Deployment::new(&self.config.flintlock_namespace_prefix, &id).map_err(StoreError::Db)
            })
            .await?;
        Ok(d.clone())
    }

    /// The flintlock namespace that holds a pool namespace's VMs.
    pub async fn flintlock_namespace(&self, pool_namespace: &str) -> Result<String, StoreError> {
        Ok(self.deployment().await?.namespace(pool_namespace))
    }

    /// Wakes the reconciler ([`Waker::wake`]): on Lambda a running loop is asked to go on
    /// (one statement) instead of invoking another; a failed ask invokes.
    pub async fn wake(&self, why: &'static str) -> bool {
        let linger = self.config.reconcile.linger.as_secs_f64();
        // Never wait for a connection: on Lambda the pool has one, and the caller may still
        // hold it (a pool write); then invoke, as before the ask existed.
        let ask = async {
            match tokio::time::timeout(std::time::Duration::from_millis(50), self.db.get())
                .await
                .unwrap_or_else(|_| Err(crate::store::StoreError::Unavailable("no idle connection for the ask".into())))
            {
                Ok(c) => crate::store::loop_ask(&c, linger).await.unwrap_or_else(|e| {
                    tracing::debug!(error = %e, "could not ask a running reconcile loop; invoking");
                    false
                }),
                Err(_) => false,
            }
        };
        self.waker.wake(why, ask).await
    }

    /// A pooled connection; an unreachable database is UNAVAILABLE (503, retry). A connection
    /// that died while idle (a Lambda thaw, a database restart) is replaced here, transparently:
    /// see [`crate::db::connect_pool`].
    pub async fn conn(&self) -> Result<Conn, ApiError> {
        Ok(self.db.get().await?)
    }
}

/// Why a function instance could not build its state ([`Instance::get`]). Never fatal: the
/// instance answers this invocation with it and tries again on the next one.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Secrets(#[from] SecretsError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl BootError {
    /// Whether the next invocation can succeed without anyone changing anything: the
    /// extension could not fetch a secret (not there yet, AWS slow or unreachable). A secret
    /// or variable that does not make a valid configuration needs an operator first.
    pub fn is_retryable(&self) -> bool {
        matches!(self, BootError::Secrets(SecretsError::Fetch { .. }))
    }
}

/// An HTTP function's answer while its state cannot be built: 503 UNAVAILABLE with
/// `Retry-After`, in the contract's shape; the cause (which never holds a secret) is logged.
impl IntoResponse for BootError {
    fn into_response(self) -> Response {
        ApiError::unavailable(
            "this function instance could not load its configuration yet; retry after the Retry-After delay",
            format!("building the function's state failed (retryable: {}): {self}", self.is_retryable()),
        )
        .into_response()
    }
}

/// What one function instance (a Lambda execution environment) builds once and keeps: its
/// configuration with the secrets that `POOLMGR_*_SECRET_ARN` name (see [`crate::secrets`]),
/// the connection pool, and `make`'s product of them (a Router, or the [`AppState`] itself).
///
/// Built on the first invocation, not at start: AWS's Parameters and Secrets extension answers
/// only in the INVOKE phase, so a function that read its secrets before asking the Runtime API
/// for its first event would fail to start on AWS. A build that fails is not kept: the next
/// invocation tries again, so a secret created or fixed after the deploy is picked up without
/// one. No connection is opened here either: the pool connects on first use and checks the
/// schema version then (`db::connect_pool`), so an unreachable database means 503 answers.
pub struct Instance<T> {
    cell: tokio::sync::OnceCell<T>,
    make: fn(AppState) -> T,
}

impl<T> Instance<T> {
    pub fn new(make: fn(AppState) -> T) -> Instance<T> {
        Instance { cell: tokio::sync::OnceCell::new(), make }
    }

    /// The instance's state, built now if no invocation built it yet. Concurrent callers
    /// wait for one build.
    pub async fn get(&self) -> Result<&T, BootError> {
        self.cell
            .get_or_try_init(|| async {
                let started = Instant::now();
                let cfg = Config::from_lookup(crate::secrets::env_lookup().await?)?;
                let read = started.elapsed();
                let pool = crate::db::pool_from_config(&cfg)?;
                let built = (self.make)(AppState::new(&cfg, pool));
                tracing::info!(
                    config_us = read.as_micros() as u64,
                    total_us = started.elapsed().as_micros() as u64,
                    "function state built (configuration and secrets, then the pool and the handler)"
                );
                Ok(built)
            })
            .await
    }
}

/// An HTTP function on Lambda: the Router `make` returns, built by the first request
/// ([`Instance`]); until it can be built every request answers [`BootError`]'s 503.
#[derive(Clone)]
pub struct LazyRouter(Arc<Instance<Router>>);

impl LazyRouter {
    pub fn new(make: fn(AppState) -> Router) -> LazyRouter {
        LazyRouter(Arc::new(Instance::new(make)))
    }
}

impl<B> tower::Service<Request<B>> for LazyRouter
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let instance = self.0.clone();
        Box::pin(async move {
            match instance.get().await {
                Ok(router) => router.clone().oneshot(req).await,
                Err(e) => Ok(e.into_response()),
            }
        })
    }
}
