//! How every retrying call waits and when it stops: [`Backoff`] (capped, doubling, jittered)
//! and [`RetryPolicy`] (how many attempts a safe call gets).
//!
//! Must never decide *what* is safe to retry: that is the caller's ([`crate::Call::is_idempotent`],
//! [`crate::claim`]). This module only spaces and bounds the attempts.

use std::time::Duration;

use rand::RngExt;

/// The shortest wait a [`Backoff`] gives, whatever its fields say: a zero backoff would make
/// a retry loop (a claim waiting for an empty pool, a followed event feed) spin on the server.
pub const MIN_BACKOFF: Duration = Duration::from_millis(10);

/// Capped exponential backoff: attempt `n` (from 1) waits a random time between half and all
/// of `min(max, first · 2^(n-1))`, never less than the server's `Retry-After`, and never less
/// than [`MIN_BACKOFF`] (so `Backoff::new(Duration::ZERO, …)` waits 10 ms, not nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The ceiling of the first wait.
    pub first: Duration,
    /// The largest ceiling: waits stop doubling here.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { first: Duration::from_millis(250), max: Duration::from_secs(5) }
    }
}

impl Backoff {
    /// Waits from `first`, doubling up to `max`.
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { first, max }
    }

    /// The ceiling of the wait after failed attempt `attempt` (1-based), before jitter.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(30);
        self.first.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// The wait after failed attempt `attempt`: jittered in `[ceiling/2, ceiling]`, at least
    /// `retry_after` and at least [`MIN_BACKOFF`].
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>, rng: &mut impl RngExt) -> Duration {
        let c = self.ceiling(attempt);
        let half = c / 2;
        let extra = if c > half { rng.random_range(Duration::ZERO..=c - half) } else { Duration::ZERO };
        (half + extra).max(retry_after.unwrap_or_default()).max(MIN_BACKOFF)
    }
}

/// How the calls that are safe to repeat (every GET, a heartbeat, a release: see
/// [`crate::Call::is_idempotent`]) are retried on a transient failure ([`crate::Error::is_transient`]):
/// at most `attempts` attempts in all, spaced by `backoff` (and the server's `Retry-After`).
/// Writes that are not idempotent (create, update, delete of pools and hosts) are never
/// retried; a claim has its own retry loop ([`crate::ClaimOptions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1: no retry).
    pub attempts: u32,
    /// The waits between them.
    pub backoff: Backoff,
}

impl Default for RetryPolicy {
    /// 3 attempts, waits from 200 ms doubling up to 2 s: a blip (a restart behind a load
    /// balancer, one reset connection) is ridden out in about a second.
    fn default() -> Self {
        RetryPolicy { attempts: 3, backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(2)) }
    }
}

impl RetryPolicy {
    /// One attempt only.
    pub fn none() -> RetryPolicy {
        RetryPolicy { attempts: 1, ..RetryPolicy::default() }
    }

    /// `attempts` attempts in all (at least 1), spaced by `backoff`.
    pub fn new(attempts: u32, backoff: Backoff) -> RetryPolicy {
        RetryPolicy { attempts: attempts.max(1), backoff }
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
    fn a_zero_backoff_still_waits_the_floor() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for b in [Backoff::new(Duration::ZERO, Duration::ZERO), Backoff::new(Duration::ZERO, Duration::from_secs(1))] {
            for attempt in [1, 2, 10, u32::MAX] {
                assert_eq!(b.delay(attempt, None, &mut rng), MIN_BACKOFF, "{b:?} attempt {attempt}");
            }
        }
        // A tiny one too (its jitter would go as low as 1 ms).
        let b = Backoff::new(Duration::from_millis(2), Duration::from_millis(4));
        assert!((0..100).all(|_| b.delay(1, None, &mut rng) == MIN_BACKOFF));
        // Above the floor nothing changes.
        assert!(Backoff::default().delay(1, None, &mut rng) >= Duration::from_millis(125));
    }

    #[test]
    fn a_policy_makes_at_least_one_attempt() {
        assert_eq!(RetryPolicy::new(0, Backoff::default()).attempts, 1);
        assert_eq!(RetryPolicy::none().attempts, 1);
        assert_eq!(RetryPolicy::default().attempts, 3);
    }
}
