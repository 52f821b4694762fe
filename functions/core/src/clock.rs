//! What "now" is for the code that compares times: lease expiry and its warning, heartbeats,
//! abandoned claims, provisioning and guest-agent timeouts.
//!
//! In production it is the database's clock: statements get `None` as their `now` parameter
//! and use `coalesce($now, now())`, so every process agrees on one clock whatever its own says.
//! Tests use [`Clock::adjustable`] and [`Clock::advance`] to move time instead of sleeping or
//! rewriting rows (River's `now` parameter). This module must never be the only clock a
//! production statement reads: with no adjustment the database decides.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// The clock a process compares times with; cheap to clone (clones share one adjustment).
#[derive(Clone, Debug, Default)]
pub struct Clock {
    /// `None`: the system clock, never adjusted. `Some`: milliseconds added to it (tests).
    offset_ms: Option<Arc<AtomicI64>>,
    /// Tests: how far this process's own clock is off the database's (`Clock::skew`). Moves
    /// [`Clock::now`] only, never a statement's `now`: a process whose clock drifted.
    skew_ms: Option<Arc<AtomicI64>>,
}

impl Clock {
    /// The production clock: the database's `now()` in SQL, the system clock in Rust.
    pub fn system() -> Clock {
        Clock { offset_ms: None, skew_ms: None }
    }

    /// A clock tests can move forward with [`Clock::advance`]; it starts at the system time.
    pub fn adjustable() -> Clock {
        Clock { offset_ms: Some(Arc::new(AtomicI64::new(0))), skew_ms: Some(Arc::new(AtomicI64::new(0))) }
    }

    /// Moves an adjustable clock forward by `by`. Panics on the system clock: production
    /// time is never moved.
    pub fn advance(&self, by: Duration) {
        let offset = self.offset_ms.as_ref().expect("only an adjustable clock (tests) can be moved");
        offset.fetch_add(i64::try_from(by.as_millis()).unwrap_or(i64::MAX), Ordering::SeqCst);
    }

    /// Moves an adjustable clock back to the system time.
    pub fn reset(&self) {
        if let Some(offset) = &self.offset_ms {
            offset.store(0, Ordering::SeqCst);
        }
    }

    fn offset(&self) -> i64 {
        self.offset_ms.as_ref().map_or(0, |o| o.load(Ordering::SeqCst))
    }

    /// The `now` parameter of a time-comparing statement: `None` (the database's `now()`)
    /// unless the clock was moved.
    pub fn now_param(&self) -> Option<DateTime<Utc>> {
        match self.offset() {
            0 => None,
            ms => Some(Utc::now() + chrono::Duration::milliseconds(ms)),
        }
    }

    /// This process's now: the system clock (plus a test's adjustment and skew). Not for
    /// comparisons with database timestamps: those use the database's clock (a reconcile
    /// pass's `Pass::now`, or `now_param` in the statement), so a process whose clock drifted
    /// decides nothing differently (issue 23 finding 5).
    pub fn now(&self) -> DateTime<Utc> {
        let skew = self.skew_ms.as_ref().map_or(0, |s| s.load(Ordering::SeqCst));
        Utc::now() + chrono::Duration::milliseconds(self.offset() + skew)
    }

    /// The adjustment tests made ([`Clock::advance`]), zero in production: what a time read
    /// from the database is moved by to be compared like `now_param`.
    pub fn adjustment(&self) -> chrono::Duration {
        chrono::Duration::milliseconds(self.offset())
    }

    /// Tests: this process's clock is `by` milliseconds off the database's (a drifted host).
    /// Panics on the system clock.
    pub fn skew(&self, by_ms: i64) {
        self.skew_ms.as_ref().expect("only an adjustable clock (tests) can be skewed").store(by_ms, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_clock_leaves_now_to_the_database() {
        let c = Clock::system();
        assert_eq!(c.now_param(), None);
        let before = Utc::now();
        assert!(c.now() >= before);
    }

    #[test]
    fn an_adjustable_clock_moves_forward_and_back_for_every_clone() {
        let c = Clock::adjustable();
        assert_eq!(c.now_param(), None, "unmoved, the database decides");
        let clone = c.clone();
        c.advance(Duration::from_secs(3600));
        let param = clone.now_param().expect("moved");
        assert!(param - Utc::now() > chrono::Duration::seconds(3590));
        assert!(clone.now() - Utc::now() > chrono::Duration::seconds(3590));
        c.reset();
        assert_eq!(clone.now_param(), None);
    }

    #[test]
    #[should_panic(expected = "only an adjustable clock")]
    fn the_system_clock_cannot_be_moved() {
        Clock::system().advance(Duration::from_secs(1));
    }
}
