//! A job under a lease: [`Client::run_leased`] claims, heartbeats while the job runs, and
//! releases whatever happens — the job returns, fails, panics, or the future running it is
//! dropped.
//!
//! Must never leave a lease behind that it could have released: the release is retried
//! (transient failures, for up to [`RELEASE_DEADLINE`]), and a dropped run hands the release
//! to the runtime (see [`LeaseGuard::release_on_drop`] for what that cannot guarantee).

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

use crate::claim::ClaimOptions;
use crate::client::Client;
use crate::error::{Error, Status};
use crate::keepalive::{LeaseGuard, LeaseState, LeaseWatch, RELEASE_DEADLINE};
use crate::types::{ClaimResponse, ClaimedVm, Lease, PoolRef};

/// What a job run by [`Client::run_leased`] is given: the claim (lease and VM) and a
/// [`LeaseWatch`] to notice that the lease was lost while it runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ActiveLease {
    /// The claim's answer: the lease and the VM.
    pub claim: ClaimResponse,
    /// The heartbeats: [`LeaseWatch::lost`] completes if the lease is lost.
    pub watch: LeaseWatch,
}

impl ActiveLease {
    /// An active lease made of its parts, for tests of code that takes one (a job given to
    /// [`Client::run_leased`]): a claim answer (e.g. read from JSON) and a watch, such as
    /// [`LeaseWatch::alive`] or [`LeaseWatch::lost_with`]. [`Client::run_leased`] builds its own.
    pub fn new(claim: ClaimResponse, watch: LeaseWatch) -> ActiveLease {
        ActiveLease { claim, watch }
    }

    /// The lease as claimed.
    pub fn lease(&self) -> &Lease {
        &self.claim.lease
    }

    /// The VM leased.
    pub fn vm(&self) -> &ClaimedVm {
        &self.claim.vm
    }
}

/// How a leased run went: the job's output, and what happened to the lease.
#[derive(Debug)]
#[non_exhaustive]
pub struct LeasedRun<T> {
    /// What the job returned.
    pub output: T,
    /// The claim the job ran under.
    pub claim: ClaimResponse,
    /// Why the lease was lost while the job ran (NOT_FOUND: it expired or was released
    /// elsewhere, and its VM is being deleted; [`Error::LeaseExpired`]: its `expires_at`
    /// passed without a successful heartbeat), if it was. The job was not interrupted: it
    /// can watch [`ActiveLease::watch`] to stop early.
    pub lost: Option<Error>,
    /// The release after the job: `Ok` once the lease is gone (also when it had been lost
    /// and the server had ended it already, so there was nothing left to release).
    pub release: Result<(), Error>,
}

impl Client {
    /// Runs `job` under a lease of `pool`: claims as [`Client::claim_with`] does (same
    /// retries, same cancel-safety rule for the claim itself), heartbeats in the background
    /// while the job runs, then releases the lease — whether the job returned normally, with
    /// an error value, or panicked (the panic is resumed after the release). If the future
    /// returned here is dropped while the job runs, the release is spawned on the runtime
    /// ([`LeaseGuard::release_on_drop`]).
    ///
    /// Returns `Err` only when the claim failed (no job ran). Otherwise the job's output with
    /// the lease's fate: check [`LeasedRun::lost`] (the job ran, at least partly, without a
    /// lease) and [`LeasedRun::release`].
    ///
    /// ```no_run
    /// # async fn run(client: poolmgr_client::Client) -> Result<(), poolmgr_client::Error> {
    /// use poolmgr_client::{ClaimOptions, PoolRef};
    /// let pool = PoolRef::parse("default/ci")?;
    /// let run = client
    ///     .run_leased(&pool, &ClaimOptions::default(), |lease| async move {
    ///         println!("running on {}", lease.vm().id);
    ///         42
    ///     })
    ///     .await?;
    /// assert_eq!(run.output, 42);
    /// run.release?;
    /// # Ok(()) }
    /// ```
    pub async fn run_leased<F, Fut, T>(
        &self,
        pool: &PoolRef,
        opts: &ClaimOptions,
        job: F,
    ) -> Result<LeasedRun<T>, Error>
    where
        F: FnOnce(ActiveLease) -> Fut,
        Fut: Future<Output = T>,
    {
        let claim = self.claim_with(pool, opts).await?.response;
        // From here on a drop of this future releases the lease.
        let guard = self.keep_alive(&claim.lease).release_on_drop();
        let active = ActiveLease { claim: claim.clone(), watch: guard.watch() };
        let output = AssertUnwindSafe(job(active)).catch_unwind().await;
        let (lost, release) = finish(guard).await;
        match output {
            Ok(output) => Ok(LeasedRun { output, claim, lost, release }),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// Stops the heartbeats and releases, unless the lease is already gone.
async fn finish(guard: LeaseGuard) -> (Option<Error>, Result<(), Error>) {
    match guard.state() {
        LeaseState::Lost(e) if e.status() == Some(&Status::NotFound) => {
            // Nothing to release; dropping the guard must not try either.
            drop(guard.keep_lease_on_drop());
            (Some(e), Ok(()))
        }
        LeaseState::Lost(e) => (Some(e), guard.release(RELEASE_DEADLINE).await),
        _ => (None, guard.release(RELEASE_DEADLINE).await),
    }
}
