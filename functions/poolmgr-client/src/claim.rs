//! The safe claim: one `request_id` per logical claim, transient failures retried with that
//! same id, capped exponential backoff with jitter, until a deadline.
//!
//! Why the same id: a claim whose answer was lost (a reset, a time-out, a proxy dropping the
//! connection) may have committed. Retried with the same `request_id`, the server answers
//! with the lease that attempt created (`replayed: true`) instead of claiming a second VM.
//! So this module never sends an attempt with another id, and never retries without one.

use std::sync::Arc;
use std::time::Duration;

use rand::RngExt;
use tokio::time::Instant;

use crate::client::{Call, Client, Reply, check_request_id};
use crate::error::{Error, Status};
use crate::types::{ClaimRequest, ClaimResponse, PoolRef};

/// Capped exponential backoff: attempt `n` (from 1) waits a random time between half and all
/// of `min(max, first · 2^(n-1))`, and never less than the server's `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { first: Duration::from_millis(250), max: Duration::from_secs(5) }
    }
}

impl Backoff {
    /// The ceiling of the wait after failed attempt `attempt` (1-based), before jitter.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(30);
        self.first.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// The wait after failed attempt `attempt`: jittered in `[ceiling/2, ceiling]`, at least
    /// `retry_after`.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>, rng: &mut impl RngExt) -> Duration {
        let c = self.ceiling(attempt);
        let half = c / 2;
        let extra = if c > half { rng.random_range(Duration::ZERO..=c - half) } else { Duration::ZERO };
        (half + extra).max(retry_after.unwrap_or_default())
    }
}

/// What a retry callback is told before each wait.
#[derive(Debug)]
pub struct RetryNotice<'a> {
    /// The attempt that failed (1-based).
    pub attempt: u32,
    pub error: &'a Error,
    /// How long until the next attempt.
    pub delay: Duration,
    /// What is left of the deadline after that wait.
    pub remaining: Duration,
    pub request_id: &'a str,
}

/// A callback told about each retry (progress output, metrics).
pub type OnRetry = Arc<dyn Fn(&RetryNotice<'_>) + Send + Sync>;

/// How [`Client::claim_with`] claims.
#[derive(Clone)]
pub struct ClaimOptions {
    /// The idempotency key of this logical claim; a UUID v4 is generated when `None`.
    pub request_id: Option<String>,
    /// How long to keep retrying, from the first attempt (default 60 s). An attempt is always
    /// made; none starts after the deadline.
    pub deadline: Duration,
    /// Retry RESOURCE_EXHAUSTED (no AVAILABLE VM) too, waiting for the pool to refill
    /// (default `true`). Without it an empty pool fails at once.
    pub wait_for_vm: bool,
    pub backoff: Backoff,
    pub on_retry: Option<OnRetry>,
}

impl Default for ClaimOptions {
    fn default() -> Self {
        ClaimOptions {
            request_id: None,
            deadline: Duration::from_secs(60),
            wait_for_vm: true,
            backoff: Backoff::default(),
            on_retry: None,
        }
    }
}

impl std::fmt::Debug for ClaimOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimOptions")
            .field("request_id", &self.request_id)
            .field("deadline", &self.deadline)
            .field("wait_for_vm", &self.wait_for_vm)
            .field("backoff", &self.backoff)
            .field("on_retry", &self.on_retry.as_ref().map(|_| "…"))
            .finish()
    }
}

/// A successful claim and how it went.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub response: ClaimResponse,
    /// The answer as the server sent it.
    pub reply: Reply,
    /// Attempts made, the successful one included.
    pub attempts: u32,
}

impl ClaimOptions {
    /// Whether `e` is worth another attempt with the same id.
    fn retries(&self, e: &Error) -> bool {
        e.is_transient() || (self.wait_for_vm && e.status() == Some(&Status::ResourceExhausted))
    }
}

impl Client {
    /// Claims a VM from `pool` with the default [`ClaimOptions`]: a fresh UUID v4 `request_id`,
    /// transient failures and an empty pool retried for up to 60 s. However many attempts it
    /// takes, at most one VM is claimed.
    pub async fn claim(&self, pool: &PoolRef) -> Result<ClaimResponse, Error> {
        Ok(self.claim_with(pool, &ClaimOptions::default()).await?.response)
    }

    /// Claims a VM from `pool`, retrying as `opts` says, always with the same `request_id`.
    /// The last attempt's error is returned when the deadline passes or an error is not
    /// worth retrying (NOT_FOUND, INVALID_ARGUMENT, INTERNAL: a failed pre-lease hook, …).
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
            let err = match self.send(Call::claim(&req)).await {
                Ok(reply) => {
                    let response = reply.json()?;
                    return Ok(Claimed { response, reply, attempts: attempt });
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if !opts.retries(&err) || now >= deadline {
                return Err(err);
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter_in_the_upper_half() {
        let b = Backoff { first: Duration::from_millis(100), max: Duration::from_secs(1) };
        let ceilings: Vec<u128> = (1..=6).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let d = b.delay(3, None, &mut rng);
            assert!(d >= Duration::from_millis(200) && d <= Duration::from_millis(400), "{d:?}");
            seen.insert(d);
        }
        assert!(seen.len() > 50, "jitter spreads the waits: {} distinct", seen.len());
    }

    #[test]
    fn retry_after_is_a_floor() {
        let b = Backoff::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(b.delay(1, Some(Duration::from_secs(3)), &mut rng), Duration::from_secs(3));
        assert!(b.delay(1, Some(Duration::from_millis(1)), &mut rng) >= Duration::from_millis(125));
    }

    #[test]
    fn what_a_claim_retries() {
        let api = |status| {
            Error::Api(crate::error::ApiError {
                code: 0,
                status,
                message: String::new(),
                reason: None,
                request_id: None,
                retry_after: None,
            })
        };
        let mut o = ClaimOptions::default();
        assert!(o.retries(&api(Status::Unavailable)));
        assert!(o.retries(&api(Status::Aborted)));
        assert!(o.retries(&api(Status::ResourceExhausted)));
        assert!(!o.retries(&api(Status::Internal)));
        assert!(!o.retries(&api(Status::NotFound)));
        o.wait_for_vm = false;
        assert!(!o.retries(&api(Status::ResourceExhausted)));
    }
}
