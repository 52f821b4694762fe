//! The client-side statement timeout (`POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS`). Its own test
//! binary: the limit is process-wide, and 1 s would be too short for the races elsewhere.

use std::time::{Duration, Instant};

use poolmgr_core::db;
use poolmgr_tests::*;

#[tokio::test]
async fn a_statement_stuck_on_a_lock_answers_503_and_is_cancelled_on_the_server() {
    // PgBouncer 1.18 (Debian 12) crashes on tokio-postgres's cancel requests: through it the
    // timeout applies without the cancel.
    let cancel = !through_pooler();
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_DB_STATEMENT_TIMEOUT_SECONDS".into(), "1".into()));
        env.push(("POOLMGR_DB_CANCEL_ON_TIMEOUT".into(), cancel.to_string()));
    })
    .await;
    app.create_pool("ci", 1).await;

    // Another session holds the pools table exclusively: listing pools waits on the lock.
    let mut locker = db::connect_one(&app.db.url).await.expect("locker connection");
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE pools IN ACCESS EXCLUSIVE MODE").await.unwrap();

    let t0 = Instant::now();
    let r = app.get(ADMIN, "/v1/pools").await;
    r.assert_error(503, "UNAVAILABLE");
    assert_eq!(r.headers.get("retry-after").unwrap(), "1");
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "took {took:?}");

    // The cancel request reached the server: nothing waits on the lock any more, although
    // the lock is still held.
    let mut waiting = if cancel { -1 } else { 0 };
    for _ in 0..if cancel { 100 } else { 0 } {
        waiting = app
            .scalar_i64(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND wait_event_type = 'Lock'",
                app.db.name
            ))
            .await;
        if waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(waiting, 0, "the timed-out statement was cancelled server-side");

    tx.rollback().await.unwrap();
    app.get(ADMIN, "/v1/pools").await.assert_ok(200);
}
