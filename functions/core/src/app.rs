//! The state every HTTP function and the reconcile pass share: built once per process
//! (per Lambda execution environment), before serving, and lent to each request.

use std::sync::Arc;

use crate::auth::AuthConfig;
use crate::clock::Clock;
use crate::config::Config;
use crate::db::{Conn, Db};
use crate::deployment::Deployment;
use crate::error::ApiError;
use crate::flintlock::Flintlock;
use crate::metrics::Metrics;
use crate::store::StoreError;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub auth: Arc<AuthConfig>,
    pub flintlock: Flintlock,
    pub metrics: Arc<Metrics>,
    pub config: Arc<Config>,
    /// What "now" is for time comparisons: the database's clock, or a test's ([`Clock`]).
    pub clock: Clock,
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
            .with_error_observer(Arc::new(move |host, method| observer.flintlock_error(host, method)));
        AppState {
            db,
            auth: Arc::new(cfg.auth.clone()),
            flintlock,
            metrics,
            config: Arc::new(cfg.clone()),
            clock: Clock::system(),
            deployment: Arc::default(),
        }
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

    /// A pooled connection; an unreachable database is UNAVAILABLE (503, retry). A connection
    /// that died while idle (a Lambda thaw, a database restart) is replaced here, transparently:
    /// see [`crate::db::connect_pool`].
    pub async fn conn(&self) -> Result<Conn, ApiError> {
        Ok(self.db.get().await?)
    }
}

/// Start-up shared by every function binary: logs, configuration (with the secrets that
/// `POOLMGR_*_SECRET_ARN` name, see [`crate::secrets`]), and the connection pool, whose first
/// connection checks the schema version (a function never migrates; the migrate step does).
pub async fn boot_function() -> Result<AppState, Box<dyn std::error::Error + Send + Sync>> {
    crate::telemetry::init();
    let cfg = Config::from_lookup(crate::secrets::env_lookup().await?)?;
    // No connection here: the pool connects on the first request and checks the schema
    // version then (`db::connect_pool`), so an unreachable database means 503 answers, never
    // a failed start, and a cold start opens one connection, not two.
    let pool = crate::db::pool_from_config(&cfg)?;
    Ok(AppState::new(&cfg, pool))
}
