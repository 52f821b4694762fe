//! Heartbeats in the background: [`Client::keep_alive`] returns a [`LeaseGuard`] whose task
//! heartbeats the lease until the guard is released or dropped.
//!
//! Beats are scheduled from the lease's own `expires_at` (a third of the time it has left, at
//! most every third of its expiry window), so a replayed claim with little time left is
//! heartbeated at once. A failed heartbeat — no answer, 503, but also a 429, a proxy's 500 or
//! a 401 while a token is rotated — is tried again with a backoff, and each attempt is cut at
//! the lease's `expires_at`. Only two things end the task: the server saying the lease is
//! gone (its NOT_FOUND: released, expired or its release begun), or `expires_at` passing
//! without a successful heartbeat ([`Error::LeaseExpired`]). Either way the lease is lost and
//! [`LeaseGuard::lost`] (or a [`LeaseWatch`]) says why.
//!
//! Expiry is judged on this process's clock: for the lease handed over, from its `expires_at`
//! (so a skewed clock counts until the first heartbeat); after a heartbeat, from when that
//! heartbeat was sent plus the window it granted (no skew involved).
//!
//! Must never release a lease the caller did not hand over: a guard releases only through
//! [`LeaseGuard::release`], or on drop once [`LeaseGuard::release_on_drop`] asked for it.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use tokio::time::Instant;

use crate::client::Client;
use crate::error::{Error, Status};
use crate::retry::Backoff;
use crate::types::Lease;

/// How long a release is retried when the guard is dropped or a leased run ends.
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(30);

/// What the background task last saw.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LeaseState {
    /// Alive: the lease as the last successful heartbeat (or the claim) returned it.
    #[non_exhaustive]
    Alive {
        /// The lease as last seen.
        lease: Lease,
        /// Successful heartbeats so far.
        heartbeats: u64,
        /// Heartbeats failed since the last success (they are tried again until the lease's
        /// `expires_at`).
        failures: u32,
        /// Why the last heartbeat failed, while `failures` > 0.
        last_error: Option<Error>,
    },
    /// The task stopped: the server said the lease is gone (NOT_FOUND), or it expired without
    /// a successful heartbeat ([`Error::LeaseExpired`]).
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
    /// `heartbeat_expiry_seconds`, at least 1 s apart), sooner when it has less time left
    /// (see the module's documentation). Must be called inside a Tokio runtime.
    pub fn keep_alive(&self, lease: &Lease) -> LeaseGuard {
        let every = (lease.expiry_window() / 3).max(Duration::from_secs(1));
        self.keep_alive_every(lease, every)
    }

    /// Heartbeats `lease` in the background every `every`, sooner when it has less than three
    /// times that left.
    pub fn keep_alive_every(&self, lease: &Lease, every: Duration) -> LeaseGuard {
        let (tx, rx) =
            watch::channel(LeaseState::Alive { lease: lease.clone(), heartbeats: 0, failures: 0, last_error: None });
        let task = tokio::spawn(beat(self.clone(), lease.clone(), every, tx));
        LeaseGuard { client: self.clone(), lease_id: lease.lease_id.clone(), state: rx, task, release_on_drop: None }
    }
}

/// The shortest time between two heartbeats, so a lease whose window has shrunk to nothing
/// (its `max_lease_seconds` reached) is not heartbeated in a busy loop.
const MIN_GAP: Duration = Duration::from_millis(50);

/// Whether a heartbeat's error is the server saying the lease is gone: its NOT_FOUND (404 with
/// the contract's body; a bare 404 of a proxy is not taken for it — the expiry check ends the
/// lease if it is really gone).
fn lease_gone(e: &Error) -> bool {
    matches!(e, Error::Api(a) if a.status == Status::NotFound && a.code == 404 && a.reason.is_some())
}

/// When `lease`, as handed over, expires on this process's clock: what its `expires_at` leaves
/// from now, never more than its window.
fn local_expiry(lease: &Lease) -> Instant {
    let left = (lease.expires_at - chrono::Utc::now()).to_std().unwrap_or_default();
    Instant::now() + left.min(lease.expiry_window())
}

/// The next regular beat: after `every`, or when a third of the time left before `expires` is
/// left, whichever comes first.
fn next_beat(expires: Instant, every: Duration) -> Instant {
    let now = Instant::now();
    now + every.min(expires.saturating_duration_since(now) / 3).max(MIN_GAP)
}

async fn beat(client: Client, mut lease: Lease, every: Duration, tx: watch::Sender<LeaseState>) {
    let lease_id = lease.lease_id.clone();
    let mut heartbeats = 0u64;
    let mut failures = 0u32;
    let mut last_error: Option<Error> = None;
    let backoff = Backoff::new((every / 8).clamp(Duration::from_millis(100), Duration::from_secs(2)), every);
    let mut expires = local_expiry(&lease);
    let mut next = next_beat(expires, every);
    loop {
        tokio::time::sleep_until(next.min(expires)).await;
        if Instant::now() >= expires {
            break;
        }
        let sent = Instant::now();
        // Each attempt (and the client's retries) is cut at the lease's expiry: an answer
        // after it could not save the lease.
        let result = match tokio::time::timeout_at(expires, client.heartbeat_until(&lease_id, expires)).await {
            Ok(r) => r,
            Err(_) => break,
        };
        match result {
            Ok(l) => {
                heartbeats += 1;
                (failures, last_error) = (0, None);
                // The server's now is after `sent`: the window it granted counts from there.
                expires = sent + l.expiry_window();
                lease = l;
                tx.send_replace(LeaseState::Alive { lease: lease.clone(), heartbeats, failures, last_error: None });
                next = next_beat(expires, every);
            }
            Err(e) if lease_gone(&e) => {
                tx.send_replace(LeaseState::Lost(e));
                return;
            }
            // The lease may still be there: a throttle, an unreachable server, a proxy's
            // error, a token being rotated. Try again, backing off, until it expires.
            Err(e) => {
                failures = failures.saturating_add(1);
                let delay = backoff.delay(failures, e.retry_after(), &mut rand::rng());
                next = Instant::now() + delay;
                last_error = Some(e.clone());
                tx.send_replace(LeaseState::Alive { lease: lease.clone(), heartbeats, failures, last_error: Some(e) });
            }
        }
    }
    tx.send_replace(LeaseState::Lost(Error::LeaseExpired {
        lease_id,
        expires_at: lease.expires_at,
        last_error: last_error.map(Box::new),
    }));
}

/// A view of a guard's heartbeats that can be moved elsewhere (into a job's task): whether
/// the lease is still alive, and a future that completes when it is lost.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    state: watch::Receiver<LeaseState>,
}

impl LeaseWatch {
    /// A watch with no heartbeats behind it that always says `lease` is alive: [`LeaseWatch::lost`]
    /// never completes, [`LeaseWatch::next_change`] answers `None`. For tests of code that
    /// takes a watch or an [`crate::ActiveLease`]; a real one comes from [`LeaseGuard::watch`].
    pub fn alive(lease: Lease) -> LeaseWatch {
        LeaseWatch::fixed(LeaseState::Alive { lease, heartbeats: 0, failures: 0, last_error: None })
    }

    /// As [`LeaseWatch::alive`], for a lease already lost for `why`: [`LeaseWatch::lost`]
    /// answers `why` at once.
    pub fn lost_with(why: Error) -> LeaseWatch {
        LeaseWatch::fixed(LeaseState::Lost(why))
    }

    fn fixed(state: LeaseState) -> LeaseWatch {
        // The sender is dropped: the state never changes.
        let (_, state) = watch::channel(state);
        LeaseWatch { state }
    }

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

    /// Waits for the next change of what the heartbeat task saw (a heartbeat, a failed one,
    /// the loss) and returns it; `None` once the task has ended and every change was seen.
    /// Changes in quick succession may be seen as the last of them only.
    pub async fn next_change(&mut self) -> Option<LeaseState> {
        self.state.changed().await.ok()?;
        Some(self.state.borrow_and_update().clone())
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

    /// Waits until the lease is lost and returns why (NOT_FOUND once the server says it
    /// expired or was released elsewhere, [`Error::LeaseExpired`] once its `expires_at` passed
    /// without a successful heartbeat). Pending for as long as the lease is alive.
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
    /// after such a failure means an unanswered attempt released it, and counts as done, as
    /// does NOT_FOUND for a lease already lost (it expired). If the future is dropped before
    /// the release completed, the release is spawned as [`LeaseGuard::release_on_drop`]'s is.
    pub async fn release(mut self, deadline: Duration) -> Result<(), Error> {
        self.task.abort();
        let until = tokio::time::Instant::now() + deadline;
        // Armed until the release completed: a drop while it is in flight spawns it again.
        self.release_on_drop = Some(deadline);
        let lost = matches!(self.state(), LeaseState::Lost(_));
        let mut retried = false;
        let result = loop {
            match self.client.release_until(&self.lease_id, Some(until)).await {
                Ok(()) => break Ok(()),
                Err(e) if (retried || lost) && e.status() == Some(&Status::NotFound) => break Ok(()),
                Err(e) if e.is_transient() && tokio::time::Instant::now() < until => {
                    retried = true;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => break Err(e),
            }
        };
        self.release_on_drop = None;
        result
    }
}
