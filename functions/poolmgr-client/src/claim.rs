//! The safe claim: one `request_id` per logical claim, transient failures retried with that
//! same id, capped exponential backoff with jitter, until a deadline.
//!
//! Why the same id: a claim whose answer was lost (a reset, a time-out, a proxy dropping the
//! connection) may have committed. Retried with the same `request_id`, the server answers
//! with the lease that attempt created (`replayed: true`) instead of claiming a second VM.
//! So this module never sends an attempt with another id, and never retries without one.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::client::{Call, Client, Reply, check_request_id};
use crate::error::{Error, Status};
pub use crate::retry::Backoff;
use crate::types::{ClaimRequest, ClaimResponse, PoolRef};

/// What a retry callback is told before each wait.
#[derive(Debug)]
#[non_exhaustive]
pub struct RetryNotice<'a> {
    /// The attempt that failed (1-based).
    pub attempt: u32,
    /// Why it failed.
    pub error: &'a Error,
    /// How long until the next attempt.
    pub delay: Duration,
    /// What is left of the deadline after that wait.
    pub remaining: Duration,
    /// The claim's `request_id` (the same for every attempt).
    pub request_id: &'a str,
}

/// A callback told about each retry (progress output, metrics).
pub type OnRetry = Arc<dyn Fn(&RetryNotice<'_>) + Send + Sync>;

/// How [`Client::claim_with`] claims. Start from [`ClaimOptions::default`] and change what
/// you need: `ClaimOptions::default().with_request_id("job-42").with_deadline(d)`.
#[derive(Clone)]
#[non_exhaustive]
pub struct ClaimOptions {
    /// The idempotency key of this logical claim; a UUID v4 is generated when `None`. Give
    /// your own when you may need to recover the lease of a claim whose answer you never saw
    /// (see [`Client::claim_with`], "Cancel safety").
    pub request_id: Option<String>,
    /// How long to keep trying, from the first attempt (default 60 s). An attempt is always
    /// made; none starts after the deadline, and the attempt in flight when it passes is cut
    /// there (its time-out is capped at the time left, but never below 1 s).
    pub deadline: Duration,
    /// Retry RESOURCE_EXHAUSTED (no AVAILABLE VM) too, waiting for the pool to refill
    /// (default `true`). Without it an empty pool fails at once.
    pub wait_for_vm: bool,
    /// Retry a failed pre-lease hook (500 INTERNAL with `reason` `HOOK_FAILED`) with the same
    /// id (default `false`). The failed attempt created no lease and its VM went to the
    /// pool's hook-failure policy, so the retry is a fresh claim of another VM: turn it on
    /// when a hook fails now and then (a flaky network in the guest), not when it always
    /// fails — every retry costs a VM.
    pub retry_hook_failure: bool,
    /// The waits between attempts.
    pub backoff: Backoff,
    /// Told about each retry before its wait.
    pub on_retry: Option<OnRetry>,
}

impl Default for ClaimOptions {
    fn default() -> Self {
        ClaimOptions {
            request_id: None,
            deadline: Duration::from_secs(60),
            wait_for_vm: true,
            retry_hook_failure: false,
            backoff: Backoff::default(),
            on_retry: None,
        }
    }
}

impl ClaimOptions {
    /// With this `request_id` (see [`ClaimOptions::request_id`]).
    pub fn with_request_id(mut self, id: impl Into<String>) -> Self {
        self.request_id = Some(id.into());
        self
    }

    /// With this deadline (see [`ClaimOptions::deadline`]).
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Whether to wait for an empty pool to refill (see [`ClaimOptions::wait_for_vm`]).
    pub fn with_wait_for_vm(mut self, wait: bool) -> Self {
        self.wait_for_vm = wait;
        self
    }

    /// Whether to retry a failed pre-lease hook (see [`ClaimOptions::retry_hook_failure`]).
    pub fn with_retry_hook_failure(mut self, retry: bool) -> Self {
        self.retry_hook_failure = retry;
        self
    }

    /// With these waits between attempts.
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// With a callback told about each retry.
    pub fn with_on_retry(mut self, f: impl Fn(&RetryNotice<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Arc::new(f));
        self
    }

    /// Whether `e` is worth another attempt with the same id.
    fn retries(&self, e: &Error) -> bool {
        e.is_transient()
            || (self.wait_for_vm && e.status() == Some(&Status::ResourceExhausted))
            || (self.retry_hook_failure && matches!(e, Error::Api(a) if a.is_hook_failure()))
    }
}

impl std::fmt::Debug for ClaimOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimOptions")
            .field("request_id", &self.request_id)
            .field("deadline", &self.deadline)
            .field("wait_for_vm", &self.wait_for_vm)
            .field("retry_hook_failure", &self.retry_hook_failure)
            .field("backoff", &self.backoff)
            .field("on_retry", &self.on_retry.as_ref().map(|_| "…"))
            .finish()
    }
}

/// A successful claim and how it went.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Claimed {
    /// The lease and its VM.
    pub response: ClaimResponse,
    /// The answer as the server sent it.
    pub reply: Reply,
    /// Attempts made, the successful one included.
    pub attempts: u32,
}

impl Client {
    /// Claims a VM from `pool` with the default [`ClaimOptions`]: a fresh UUID v4 `request_id`,
    /// transient failures and an empty pool retried for up to 60 s. However many attempts it
    /// takes, at most one VM is claimed. See [`Client::claim_with`] for cancel safety.
    pub async fn claim(&self, pool: &PoolRef) -> Result<ClaimResponse, Error> {
        Ok(self.claim_with(pool, &ClaimOptions::default()).await?.response)
    }

    /// Claims a VM from `pool`, retrying as `opts` says, always with the same `request_id`.
    /// The last attempt's error is returned when the deadline passes or an error is not
    /// worth retrying (NOT_FOUND, INVALID_ARGUMENT, INTERNAL: a failed pre-lease hook unless
    /// [`ClaimOptions::retry_hook_failure`], …).
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe. A claim future dropped while an attempt is in flight (a
    /// `tokio::select!` branch that lost, a `tokio::time::timeout` around it) may leave a
    /// lease the server committed under a `request_id` the caller never saw: its VM stays
    /// leased until the lease expires (the pool's `heartbeat_expiry_seconds`, as nothing
    /// heartbeats it). Likewise when the last attempt's answer is lost (a time-out error
    /// whose [`Error::outcome_unknown`] is true). To recover such a lease, pass your own
    /// [`ClaimOptions::request_id`] and claim again with it: while the lease lives, the
    /// server answers with that same lease (`replayed: true`) instead of a new one; release
    /// it if you no longer want it. Prefer [`ClaimOptions::deadline`] over an outer
    /// time-out: it stops at the deadline without dropping an attempt blind.
    pub async fn claim_with(&self, pool: &PoolRef, opts: &ClaimOptions) -> Result<Claimed, Error> {
        let request_id = match &opts.request_id {
            Some(r) if r.is_empty() => {
                return Err(Error::InvalidInput("request_id is empty: give one, or None to generate one".into()));
            }
            Some(r) => r.clone(),
            None => uuid::Uuid::new_v4().to_string(),
        };
        check_request_id(Some(&request_id))?;
        let req = ClaimRequest { pool: pool.clone(), request_id: Some(request_id.clone()) };
        let deadline = Instant::now() + opts.deadline;
        let mut attempt = 1u32;
        loop {
            // Each attempt's time-out is cut at the deadline: a deadline is a promise to the
            // caller, and an attempt started just before it must not run 30 s past it.
            let err = match self.attempt(&Call::claim(&req), Some(deadline)).await {
                Ok(reply) => {
                    let response = decode_claim(&reply, Some(&request_id))?;
                    return Ok(Claimed { response, reply, attempts: attempt });
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if !opts.retries(&err) || now >= deadline {
                return Err(with_replay_hint(err, &request_id));
            }
            let delay = opts.backoff.delay(attempt, err.retry_after(), &mut rand::rng()).min(deadline - now);
            if let Some(cb) = &opts.on_retry {
                let remaining = deadline.saturating_duration_since(now + delay);
                cb(&RetryNotice { attempt, error: &err, delay, remaining, request_id: &request_id });
            }
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }
}

/// A claim's success answer as a [`ClaimResponse`]. One that cannot be read still claimed a
/// VM (the server committed before answering): the error says which id recovers its lease.
pub(crate) fn decode_claim(reply: &Reply, request_id: Option<&str>) -> Result<ClaimResponse, Error> {
    reply.json().map_err(|e| match (e, request_id) {
        (Error::Decode(m), Some(id)) => Error::Decode(format!(
            "{m}; the claim succeeded all the same: claim again with request_id {id} to get its lease"
        )),
        (e, _) => e,
    })
}

/// A claim that ended without an answer may have claimed a VM: say which id recovers it.
fn with_replay_hint(err: Error, request_id: &str) -> Error {
    match err {
        Error::Transport { kind, message, source } if err_outcome_unknown(kind) => Error::Transport {
            kind,
            message: format!(
                "{message}; the claim may have succeeded: claim again with request_id {request_id} to get its lease"
            ),
            source,
        },
        other => other,
    }
}

fn err_outcome_unknown(kind: crate::error::TransportKind) -> bool {
    !matches!(kind, crate::error::TransportKind::Connect)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{ApiError, REASON_HOOK_FAILED, TransportKind};

    #[test]
    fn what_a_claim_retries() {
        let api = |status| Error::Api(ApiError::new(0, status, ""));
        let hook = Error::Api(ApiError::new(500, Status::Internal, "hook").with_reason(REASON_HOOK_FAILED));
        let mut o = ClaimOptions::default();
        assert!(o.retries(&api(Status::Unavailable)));
        assert!(o.retries(&api(Status::Aborted)));
        assert!(o.retries(&api(Status::ResourceExhausted)));
        assert!(!o.retries(&api(Status::Internal)));
        assert!(!o.retries(&hook), "a failed hook is not retried unless asked");
        assert!(!o.retries(&api(Status::NotFound)));
        o.wait_for_vm = false;
        assert!(!o.retries(&api(Status::ResourceExhausted)));
        let o = ClaimOptions::default().with_retry_hook_failure(true);
        assert!(o.retries(&hook));
        assert!(!o.retries(&api(Status::Internal)), "only a hook's failure");
    }

    #[test]
    fn an_unreadable_claim_answer_names_the_id_that_recovers_the_lease() {
        let reply = Reply::for_test(200, "{\"lease\": 7}");
        let e = decode_claim(&reply, Some("r-9")).unwrap_err();
        assert!(matches!(&e, Error::Decode(m) if m.contains("request_id r-9") && m.contains("succeeded")), "{e:?}");
        // Without an id there is none to name.
        let e = decode_claim(&reply, None).unwrap_err();
        assert!(matches!(&e, Error::Decode(m) if !m.contains("request_id")), "{e:?}");
    }

    #[test]
    fn a_lost_answer_names_the_id_that_recovers_the_lease() {
        let e = with_replay_hint(Error::transport(TransportKind::Timeout, "no answer", None), "r-9");
        assert!(e.to_string().contains("request_id r-9"), "{e}");
        let e = with_replay_hint(Error::transport(TransportKind::Connect, "refused", None), "r-9");
        assert_eq!(e.to_string(), "refused", "a refused connection sent nothing");
    }
}
