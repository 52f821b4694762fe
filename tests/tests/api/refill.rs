//! Issue 22 item 1: refill in seconds. A claim wakes the reconciler (`poolmgr_core::wake`),
//! a reconcile loop (`reconcile::run_loop`) keeps passing while VMs boot, one invocation loops
//! at a time (the loop lease), a wake that finds the lease held is never lost, and a loop
//! whose budget runs out hands on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use poolmgr_core::reconcile::run_loop;
use poolmgr_core::store;
use poolmgr_core::wake::Waker;
use poolmgr_tests::{CLIENT_A, TestApp};
use tokio::sync::Notify;

/// The local shape (poolmgr-local's ticker): a loop per wake, the schedule far away. A
/// claimed VM is replaced without any scheduled pass: the claim's wake starts the loop, which
/// passes until the replacement is AVAILABLE.
#[tokio::test]
async fn a_claim_wakes_the_reconciler_and_its_replacement_is_available_without_a_scheduled_pass() {
    let notify = Arc::new(Notify::new());
    let app = TestApp::spawn().await.with_waker(Waker::local(notify.clone()));
    // IMMEDIATE_ON_LEASE: a claimed VM is replaced at once (REPLACE_ON_DELETE waits for its
    // release).
    let mut spec = poolmgr_tests::pool_spec("ci", 2);
    spec["replenishment"] = serde_json::json!({"strategy": "IMMEDIATE_ON_LEASE"});
    app.post(poolmgr_tests::ADMIN, "/v1/pools", spec).await.assert_ok(201);
    // The pool's creation woke it: one loop fills the pool.
    tokio::time::timeout(Duration::from_secs(5), notify.notified()).await.expect("the create woke the reconciler");
    let r = run_loop(&app.state, Duration::from_secs(600)).await.unwrap();
    assert_eq!((r.total.created, r.total.available), (2, 2), "{r:?}");

    // A ticker that only wakes on the signal (no schedule at all), as poolmgr-local's does.
    let state = app.state.clone();
    let n = notify.clone();
    let ticker = tokio::spawn(async move {
        loop {
            n.notified().await;
            run_loop(&state, Duration::from_secs(600)).await.unwrap();
        }
    });
    let claimed = Instant::now();
    app.claim(CLIENT_A, "ci", Some("job-1")).await.assert_ok(200);
    let mut refilled = None;
    for _ in 0..200 {
        if app.count_phase("ci", "AVAILABLE").await == 2 {
            refilled = Some(claimed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    ticker.abort();
    let lag = refilled.expect("the claimed VM was never replaced: the claim's wake did not start a loop");
    // Not a timing assertion: the schedule here is "never", so any refill proves the wake.
    eprintln!("refill lag with a 50 ms boot: {lag:?}");
    assert_eq!(app.count_phase("ci", "LEASED").await, 1);
}

/// A replay changes nothing: it wakes nobody.
#[tokio::test]
async fn a_replayed_claim_does_not_wake_the_reconciler() {
    let notify = Arc::new(Notify::new());
    let app = TestApp::spawn().await.with_waker(Waker::local(notify.clone()));
    app.create_pool("ci", 1).await;
    app.seed_available("ci", 1).await;
    app.claim(CLIENT_A, "ci", Some("job-1")).await.assert_ok(200);
    tokio::time::timeout(Duration::from_secs(5), notify.notified()).await.expect("the claim woke it");
    app.claim(CLIENT_A, "ci", Some("job-1")).await.assert_ok(200);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), notify.notified()).await.is_err(),
        "a replay woke the reconciler"
    );
    // A refusal does (demand the pool could not serve).
    app.claim(CLIENT_A, "ci", Some("job-2")).await.assert_error(429, "RESOURCE_EXHAUSTED");
    tokio::time::timeout(Duration::from_secs(5), notify.notified()).await.expect("the refusal woke it");
}

/// One invocation loops at a time: an invocation that finds the loop lease held asks the
/// holder to go on and runs no pass of its own; the holder cannot give the lease back before
/// that ask has run out, so the wake is never lost in between.
#[tokio::test]
async fn a_wake_that_finds_the_loop_held_asks_the_holder_to_keep_going() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    // Force the moment: another invocation holds the loop lease, its last pass started now.
    let holder = "loop-elsewhere";
    let db = || async { app.state.db.get().await.unwrap() };
    assert!(store::loop_take(&db().await, holder, 60.0).await.unwrap());
    let pass_started: chrono::DateTime<chrono::Utc> =
        app.conn().await.query_one("SELECT now()", &[]).await.unwrap().get(0);
    let r = run_loop(&app.state, Duration::from_secs(600)).await.unwrap();
    assert!(r.joined, "{r:?}");
    assert_eq!(r.passes, 0, "the holder does the work: {r:?}");
    // The holder was asked to go on: it cannot give the lease back yet…
    assert!(!store::loop_release(&db().await, holder, false, Some(pass_started)).await.unwrap());
    let lease = store::loop_renew(&db().await, holder, 60.0).await.unwrap().expect("still held");
    assert!(lease.asked, "{lease:?}");
    // …not even once the asked-for linger (the suite's is 300 ms) is over, while its last pass
    // started before the ask: that pass may not have seen the work (a pass longer than the
    // linger, say a dead host's timeouts).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!store::loop_release(&db().await, holder, false, Some(pass_started)).await.unwrap());
    // A pass that started after the ask: now it may.
    let later: chrono::DateTime<chrono::Utc> = app.conn().await.query_one("SELECT now()", &[]).await.unwrap().get(0);
    assert!(store::loop_release(&db().await, holder, false, Some(later)).await.unwrap());
    // Free now: the next invocation loops itself.
    let r = run_loop(&app.state, Duration::from_secs(600)).await.unwrap();
    assert!(!r.joined, "{r:?}");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 1, "{r:?}");
}

/// Many invocations at once (a burst of wakes): exactly one of them loops, the others join.
#[tokio::test]
async fn racing_invocations_loop_once_and_the_others_join() {
    let app = TestApp::spawn().await;
    app.create_pool("ci", 3).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let runs = (0..8).map(|_| {
        let (state, barrier) = (app.state.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            run_loop(&state, Duration::from_secs(600)).await.unwrap()
        })
    });
    let reports: Vec<_> = futures::future::join_all(runs).await.into_iter().map(Result::unwrap).collect();
    let loopers = reports.iter().filter(|r| !r.joined).count();
    assert!(loopers >= 1, "{reports:?}");
    // A joiner may find the lease free again once the looper is done (it then loops itself,
    // with nothing left to do): never two loops at once, which the lease row forbids.
    assert!(reports.iter().filter(|r| r.joined).all(|r| r.passes == 0), "{reports:?}");
    assert_eq!(app.count_phase("ci", "AVAILABLE").await, 3);
    assert_eq!(app.scalar_i64("SELECT count(*) FROM vms").await, 3, "no VM twice");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM reconcile_loop WHERE owner IS NOT NULL").await, 0);
}

/// The schedule's safety-net pass on a settled fleet returns after one pass (no linger): an
/// idle fleet costs one short pass a minute. A wake lingers.
#[tokio::test]
async fn a_scheduled_loop_with_nothing_to_do_returns_after_one_pass() {
    use poolmgr_core::reconcile::{Start, run_loop_from};
    let app = TestApp::spawn().await;
    app.create_pool("ci", 1).await;
    app.settle(40, "1 AVAILABLE", || async { app.count_phase("ci", "AVAILABLE").await == 1 }).await;
    app.pass().await;
    let r = run_loop_from(&app.state, Duration::from_secs(600), Start::Schedule).await.unwrap();
    assert_eq!((r.passes, r.passes_with_work), (1, 0), "{r:?}");
    let r = run_loop_from(&app.state, Duration::from_secs(600), Start::Wake).await.unwrap();
    assert!(r.passes > 1, "a wake lingers for the wakes debounced after it: {r:?}");
}

/// A loop whose budget would not hold one more pass stops, gives the lease back and wakes a
/// successor while work remains: a function timeout never leaves the work to the schedule.
#[tokio::test]
async fn a_loop_out_of_budget_hands_on_to_a_fresh_invocation() {
    let notify = Arc::new(Notify::new());
    let app = TestApp::spawn().await.with_waker(Waker::local(notify.clone()));
    app.create_pool("ci", 2).await;
    // Drain the create's wake.
    let _ = tokio::time::timeout(Duration::from_secs(1), notify.notified()).await;
    let r = run_loop(&app.state, Duration::from_millis(1)).await.unwrap();
    assert_eq!(r.passes, 1, "{r:?}");
    assert_eq!(r.total.created, 2, "{r:?}");
    assert!(r.handed_on, "{r:?}");
    tokio::time::timeout(Duration::from_secs(1), notify.notified()).await.expect("a successor was woken");
    assert_eq!(app.scalar_i64("SELECT count(*) FROM reconcile_loop WHERE owner IS NOT NULL").await, 0);
    // The successor finishes the job.
    let r = run_loop(&app.state, Duration::from_secs(600)).await.unwrap();
    assert_eq!(r.total.available, 2, "{r:?}");
}

/// A pool that wants VMs it cannot get (its only host cordoned) is selected by every pass but
/// moves nothing: it keeps no loop running (on Lambda: no invocation around the clock), and
/// nothing is handed on.
#[tokio::test]
async fn a_pool_that_cannot_get_vms_keeps_no_loop_running() {
    use poolmgr_core::reconcile::{Start, run_loop_from};
    let app = TestApp::spawn().await;
    app.cordoned(poolmgr_tests::SIM_HOST, Some(serde_json::json!({"reason": "maintenance"}))).await;
    app.create_pool("ci", 2).await;
    let r = run_loop_from(&app.state, Duration::from_secs(600), Start::Wake).await.unwrap();
    assert_eq!(r.total.created, 0, "{r:?}");
    assert!(!r.handed_on, "{r:?}");
    // The suite's linger is 300 ms at 50 ms between passes: a handful, not a budget's worth.
    assert!(r.passes < 20, "{r:?}");
    let r = run_loop_from(&app.state, Duration::from_secs(600), Start::Schedule).await.unwrap();
    assert_eq!(r.passes, 1, "the schedule's pass finds nothing it can move: {r:?}");
}

/// Several poolmgr-local on one database (issue 22's "Also"): a ticker whose loop joined
/// another process's (the lease held elsewhere) pauses for the wake debounce before it asks
/// again, so 40 claims' wakes in 2 s make a handful of asks, not 40 contended writes of the
/// one `reconcile_loop` row; and the last wake is still asked for (none is lost: the holder
/// lingers past the pause).
#[tokio::test]
async fn a_ticker_that_joined_another_processes_loop_asks_at_most_once_per_debounce() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_WAKE_DEBOUNCE_MS".into(), "400".into()));
        // The pause is at most half the linger, which covers it.
        env.push(("POOLMGR_RECONCILE_LINGER_MS".into(), "1000".into()));
    })
    .await;
    let notify = Arc::new(tokio::sync::Notify::new());
    let app = app.with_waker(poolmgr_core::wake::Waker::local(notify.clone()));
    let c = app.conn().await;
    // Another process holds the loop for the next minute.
    c.batch_execute(
        "UPDATE reconcile_loop SET owner = 'another-process', until = now() + interval '60 s';
         CREATE TABLE loop_asks (at timestamptz NOT NULL);
         CREATE FUNCTION count_ask() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.asked_at IS DISTINCT FROM OLD.asked_at THEN INSERT INTO loop_asks VALUES (NEW.asked_at); END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER count_ask AFTER UPDATE ON reconcile_loop FOR EACH ROW EXECUTE FUNCTION count_ask();",
    )
    .await
    .unwrap();
    let ticker =
        tokio::spawn(poolmgr_core::reconcile::run_ticker(app.state.clone(), poolmgr_core::reconcile::Stop::new().1));
    for _ in 0..40 {
        notify.notify_one();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last_wake: chrono::DateTime<chrono::Utc> = c.query_one("SELECT now()", &[]).await.unwrap().get(0);
    tokio::time::sleep(Duration::from_millis(900)).await;
    ticker.abort();
    let asks = app.scalar_i64("SELECT count(*) FROM loop_asks").await;
    assert!((1..=8).contains(&asks), "{asks} asks for 40 wakes in 2 s with a 400 ms debounce");
    let latest: chrono::DateTime<chrono::Utc> = c.query_one("SELECT max(at) FROM loop_asks", &[]).await.unwrap().get(0);
    assert!(
        latest >= last_wake - chrono::Duration::milliseconds(450),
        "the last wake was asked for: last ask {latest}, last wake {last_wake}"
    );
    let owner: Option<String> = c.query_one("SELECT owner FROM reconcile_loop", &[]).await.unwrap().get(0);
    assert_eq!(owner.as_deref(), Some("another-process"), "the ticker never took a held lease");
}

/// poolmgr-local's shutdown: a ticker told to stop while its loop holds the loop lease (here
/// lingering for ten minutes after a wake) returns and gives the lease back, so another process
/// loops at once instead of waiting for the lease to run out (15 s).
#[tokio::test]
async fn a_stopped_ticker_gives_the_loop_lease_back() {
    let app = TestApp::spawn_with(|env| {
        env.push(("POOLMGR_RECONCILE_LINGER_MS".into(), "600000".into()));
        env.push(("POOLMGR_RECONCILE_INTERVAL_SECONDS".into(), "3600".into()));
    })
    .await;
    let notify = Arc::new(tokio::sync::Notify::new());
    let app = app.with_waker(poolmgr_core::wake::Waker::local(notify.clone()));
    let (stop, stopped) = poolmgr_core::reconcile::Stop::new();
    let ticker = tokio::spawn(poolmgr_core::reconcile::run_ticker(app.state.clone(), stopped));
    notify.notify_one();
    // Wait for the moment: the wake's loop holds the lease (and keeps it for its linger).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while app.scalar_i64("SELECT count(*) FROM reconcile_loop WHERE owner IS NOT NULL AND until > now()").await == 0 {
        assert!(std::time::Instant::now() < deadline, "the ticker's loop never took the lease");
        notify.notify_one();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), ticker)
        .await
        .expect("a stopped ticker returns after the pass in flight, not after its linger")
        .unwrap();
    assert_eq!(app.scalar_i64("SELECT count(*) FROM reconcile_loop WHERE owner IS NOT NULL").await, 0);
    // Another process takes the loop at once.
    let c = app.conn().await;
    assert!(poolmgr_core::store::loop_take(&**c, "next-process", 15.0).await.unwrap());
}
