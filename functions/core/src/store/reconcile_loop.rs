//! The `reconcile_loop` table: the one row whose lease says which invocation of the reconcile
//! function is looping (`reconcile::driver`), and until when somebody asked for passes.
//!
//! Never loses a wake: the holder gives the lease back only in a statement that also checks
//! that `wake_until` has passed ([`loop_release`]), and a wake that finds the lease held moves
//! `wake_until` only while the lease is held ([`loop_ask`]); the row lock orders the two.

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Executor, Result, Timed};

/// Takes the loop lease for `lease_seconds` if nobody holds it (or its holder's lease ran
/// out, or it is `owner`'s already): `true` if `owner` holds it now.
pub async fn loop_take(c: &impl Executor, owner: &str, lease_seconds: f64) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "UPDATE reconcile_loop SET owner = $1, until = now() + make_interval(secs => $2), updated_at = now()
             WHERE owner IS NULL OR until < now() OR owner = $1
             RETURNING true",
            &[(&owner, Type::TEXT), (&lease_seconds, Type::FLOAT8)],
        )
        .await?;
    Ok(row.is_some())
}

/// Asks the holder of the loop lease to keep passing until at least `linger_seconds` from now;
/// `false` if nobody holds it (take it instead).
pub async fn loop_ask(c: &impl Executor, linger_seconds: f64) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "UPDATE reconcile_loop SET wake_until = greatest(wake_until, now() + make_interval(secs => $1)),
                 asked_at = greatest(asked_at, now())
             WHERE owner IS NOT NULL AND until >= now()
             RETURNING true",
            &[(&linger_seconds, Type::FLOAT8)],
        )
        .await?;
    Ok(row.is_some())
}

/// What a holder renewing its lease learns.
#[derive(Debug, Clone, Copy)]
pub struct LoopLease {
    pub now: DateTime<Utc>,
    /// Somebody asked for passes until after now (`wake_until`, which starts at -infinity).
    pub asked: bool,
}

/// Extends `owner`'s lease by `lease_seconds`; `None` if it lost the lease (it ran out and
/// another invocation took it: stop looping).
pub async fn loop_renew(c: &impl Executor, owner: &str, lease_seconds: f64) -> Result<Option<LoopLease>> {
    let row = c
        .timed_query_opt(
            "UPDATE reconcile_loop SET until = now() + make_interval(secs => $2), updated_at = now()
             WHERE owner = $1
             RETURNING now(), wake_until > now()",
            &[(&owner, Type::TEXT), (&lease_seconds, Type::FLOAT8)],
        )
        .await?;
    row.map(|r| Ok(LoopLease { now: r.try_get(0)?, asked: r.try_get(1)? })).transpose()
}

/// Gives `owner`'s lease back unless somebody asked for passes until after now, or asked
/// at or after `last_pass_started` (its last pass's start on the database's clock: that pass
/// may not have seen the work of the ask). `force`: in any case (the end of an invocation's
/// budget, an error). `true`: given back (or not held).
pub async fn loop_release(
    c: &impl Executor,
    owner: &str,
    force: bool,
    last_pass_started: Option<DateTime<Utc>>,
) -> Result<bool> {
    let row = c
        .timed_query_opt(
            "WITH mine AS (SELECT owner, wake_until, asked_at FROM reconcile_loop WHERE owner = $1 FOR UPDATE),
                  released AS (
                      UPDATE reconcile_loop l SET owner = NULL, until = '-infinity', updated_at = now()
                      FROM mine WHERE l.owner = mine.owner
                        AND ($2 OR (mine.wake_until <= now() AND mine.asked_at < coalesce($3, 'infinity')))
                      RETURNING true
                  )
             SELECT EXISTS (SELECT 1 FROM released) OR NOT EXISTS (SELECT 1 FROM mine)",
            &[(&owner, Type::TEXT), (&force, Type::BOOL), (&last_pass_started, Type::TIMESTAMPTZ)],
        )
        .await?;
    Ok(row.is_some_and(|r| r.get::<_, bool>(0)))
}
