//! Heartbeats in the background: [`Client::keep_alive`] returns a [`LeaseGuard`] whose task
//! heartbeats the lease until the guard is released or dropped.
//!
//! A transient failure (no answer, 503) is retried before the next regular beat, with a
//! short backoff, so one lost heartbeat does not cost the lease. Any other error — above all
//! NOT_FOUND, the lease expired or was released elsewhere — ends the task: the lease is lost
//! and [`LeaseGuard::lost`] says why.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::Client;
use crate::error::{Error, Status};
use crate::types::Lease;

/// What the background task last saw.
#[derive(Debug, Clone)]
pub enum LeaseState {
    /// Alive: the lease as the last successful heartbeat (or the claim) returned it.
    Alive { lease: Lease, heartbeats: u64 },
    /// The task stopped: the lease is gone or the server refused the heartbeat.
    Lost(Error),
}

/// Keeps a lease alive while it exists. Dropping it stops the heartbeats (the lease then
/// expires after the pool's `heartbeat_expiry_seconds`); [`LeaseGuard::release`] ends the
/// lease at once.
#[derive(Debug)]
pub struct LeaseGuard {
    client: Client,
    lease_id: String,
    state: watch::Receiver<LeaseState>,
    task: JoinHandle<()>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.task.abort();
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
        LeaseGuard { client: self.clone(), lease_id: lease.lease_id.clone(), state: rx, task }
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

impl LeaseGuard {
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// What the task last saw.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
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
    /// retried for up to `deadline`; NOT_FOUND after such a failure means an unanswered
    /// attempt released it, and counts as done.
    pub async fn release(self, deadline: Duration) -> Result<(), Error> {
        self.task.abort();
        let until = tokio::time::Instant::now() + deadline;
        let mut retried = false;
        loop {
            match self.client.release(&self.lease_id).await {
                Ok(()) => return Ok(()),
                Err(e) if retried && e.status() == Some(&Status::NotFound) => return Ok(()),
                Err(e) if e.is_transient() && tokio::time::Instant::now() < until => {
                    retried = true;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
