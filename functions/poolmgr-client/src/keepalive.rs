//! Heartbeats in the background: [`Client::keep_alive`] returns a [`LeaseGuard`] whose task
//! heartbeats the lease until the guard is released or dropped.
//!
//! A transient failure (no answer, 503) is retried before the next regular beat, with a
//! short backoff, so one lost heartbeat does not cost the lease. Any other error — above all
//! NOT_FOUND, the lease expired or was released elsewhere — ends the task: the lease is lost
//! and [`LeaseGuard::lost`] (or a [`LeaseWatch`]) says why.
//!
//! Must never release a lease the caller did not hand over: a guard releases only through
//! [`LeaseGuard::release`], or on drop once [`LeaseGuard::release_on_drop`] asked for it.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::Client;
use crate::error::Error;
use crate::types::Lease;

/// How long a release is retried when the guard is dropped or a leased run ends.
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(30);

/// What the background task last saw.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LeaseState {
    /// Alive: the lease as the last successful heartbeat (or the claim) returned it.
    Alive {
        /// The lease as last seen.
        lease: Lease,
        /// Successful heartbeats so far.
        heartbeats: u64,
    },
    /// The task stopped: the lease is gone or the server refused the heartbeat.
    Lost(Error),
}

/// Keeps a lease alive while it exists. By default dropping it only stops the heartbeats
/// (the lease then expires after the pool's `heartbeat_expiry_seconds`);
/// [`LeaseGuard::release`] ends the lease at once, and [`LeaseGuard::release_on_drop`] makes
/// dropping it release the lease too.
#[derive(Debug)]
pub struct LeaseGuard {
    client: Client,
    lease_id: String,
    state: watch::Receiver<LeaseState>,
    task: JoinHandle<()>,
    /// Release on drop, retrying for this long.
    release_on_drop: Option<Duration>,
}

/// What dropping a guard can and cannot do: `Drop` is synchronous, so it cannot wait for an
/// answer. With [`LeaseGuard::release_on_drop`] it *spawns* the release (retried for up to
/// [`RELEASE_DEADLINE`]) on the Tokio runtime it is dropped in and returns at once. That
/// release is sent only if the runtime keeps running long enough: a guard dropped at the end
/// of `main`, while a runtime shuts down, or outside any runtime may never send it (nothing
/// is spawned outside a runtime), and a failure is only logged nowhere. The lease then ends
/// by expiry, `heartbeat_expiry_seconds` after its last heartbeat. Call
/// [`LeaseGuard::release`] and await it when you need to know.
impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(deadline) = self.release_on_drop.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let (client, id) = (self.client.clone(), self.lease_id.clone());
            let until = tokio::time::Instant::now() + deadline;
            rt.spawn(async move { client.release_until(&id, Some(until)).await });
        }
    }
}

impl Client {
    /// Heartbeats `lease` in the background every third of its expiry window (the pool's
    /// `heartbeat_expiry_seconds`, at least 1 s apart). Must be called inside a Tokio runtime.
    pub fn keep_alive(&self, lease: &Lease) -> LeaseGuard {
        let every = (lease.expiry_window() / 3).max(Duration::from_secs(1));
        self.keep_alive_every(lease, every)
    }

    /// Heartbeats `lease` in the background every `every`.
    pub fn keep_alive_every(&self, lease: &Lease, every: Duration) -> LeaseGuard {
        let (tx, rx) = watch::channel(LeaseState::Alive { lease: lease.clone(), heartbeats: 0 });
        let task = tokio::spawn(beat(self.clone(), lease.lease_id.clone(), every, tx));
        LeaseGuard { client: self.clone(), lease_id: lease.lease_id.clone(), state: rx, task, release_on_drop: None }
    }
}

async fn beat(client: Client, lease_id: String, every: Duration, tx: watch::Sender<LeaseState>) {
    let mut heartbeats = 0u64;
    let retry = (every / 8).clamp(Duration::from_millis(100), Duration::from_secs(2));
    let mut next = tokio::time::Instant::now() + every;
    loop {
        tokio::time::sleep_until(next).await;
        match client.heartbeat(&lease_id).await {
            Ok(lease) => {
                heartbeats += 1;
                tx.send_replace(LeaseState::Alive { lease, heartbeats });
                next = tokio::time::Instant::now() + every;
            }
            // Try again soon: the lease is still there, only this beat was lost.
            Err(e) if e.is_transient() => next = tokio::time::Instant::now() + retry,
            Err(e) => {
                tx.send_replace(LeaseState::Lost(e));
                return;
            }
        }
    }
}

/// A view of a guard's heartbeats that can be moved elsewhere (into a job's task): whether
/// the lease is still alive, and a future that completes when it is lost.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    state: watch::Receiver<LeaseState>,
}

impl LeaseWatch {
    /// What the heartbeat task last saw.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
    }

    /// Why the lease was lost, if it was.
    pub fn lost_now(&self) -> Option<Error> {
        match &*self.state.borrow() {
            LeaseState::Lost(e) => Some(e.clone()),
            LeaseState::Alive { .. } => None,
        }
    }

    /// Waits until the lease is lost and returns why (NOT_FOUND once it expired or was
    /// released elsewhere). Pending for as long as the heartbeats succeed; pending forever
    /// once the guard is released or dropped (the lease was not lost, it was let go).
    pub async fn lost(&mut self) -> Error {
        loop {
            if let LeaseState::Lost(e) = &*self.state.borrow_and_update() {
                return e.clone();
            }
            if self.state.changed().await.is_err() {
                // The task ended without saying why: the guard stopped it.
                return std::future::pending().await;
            }
        }
    }
}

impl LeaseGuard {
    /// The lease this guard keeps.
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// What the task last saw.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
    }

    /// A view of the heartbeats to hand to other tasks.
    pub fn watch(&self) -> LeaseWatch {
        LeaseWatch { state: self.state.clone() }
    }

    /// Makes dropping this guard release the lease (see the `Drop` implementation for what
    /// that can and cannot guarantee). [`LeaseGuard::release`] still releases at once.
    pub fn release_on_drop(mut self) -> LeaseGuard {
        self.release_on_drop = Some(RELEASE_DEADLINE);
        self
    }

    /// Undoes [`LeaseGuard::release_on_drop`]: dropping only stops the heartbeats.
    pub fn keep_lease_on_drop(mut self) -> LeaseGuard {
        self.release_on_drop = None;
        self
    }

    /// Successful heartbeats so far.
    pub fn heartbeats(&self) -> u64 {
        match &*self.state.borrow() {
            LeaseState::Alive { heartbeats, .. } => *heartbeats,
            LeaseState::Lost(_) => 0,
        }
    }

    /// Waits until the lease is lost and returns why (NOT_FOUND once it expired or was
    /// released elsewhere). Pending for as long as the heartbeats succeed.
    pub async fn lost(&mut self) -> Error {
        loop {
            if let LeaseState::Lost(e) = &*self.state.borrow_and_update() {
                return e.clone();
            }
            if self.state.changed().await.is_err() {
                // The task ended without saying why: it was aborted, which only drop does.
                return Error::InvalidInput("the heartbeat task stopped".into());
            }
        }
    }

    /// Stops the heartbeats and releases the lease (its VM is deleted). Transient failures are
    /// retried for up to `deadline` (within the client's retry policy's backoff); NOT_FOUND
    /// after such a failure means an unanswered attempt released it, and counts as done.
    pub async fn release(mut self, deadline: Duration) -> Result<(), Error> {
        // Released here, not by drop.
        self.release_on_drop = None;
        self.task.abort();
        let until = tokio::time::Instant::now() + deadline;
        let mut retried = false;
        loop {
            match self.client.release_until(&self.lease_id, Some(until)).await {
                Ok(()) => return Ok(()),
                Err(e) if retried && e.status() == Some(&crate::error::Status::NotFound) => return Ok(()),
                Err(e) if e.is_transient() && tokio::time::Instant::now() < until => {
                    retried = true;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
