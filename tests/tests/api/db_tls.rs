//! TLS to PostgreSQL, against the TLS test server `scripts/test.sh` starts: `ssl = on`, a
//! certificate for `localhost` only, signed by a CA generated for this run
//! (`poolmgr_tests::tls`), and a pg_hba.conf that takes TCP clients only over TLS (`hostssl`).
//!
//! URLs name `localhost` and connect to `hostaddr=127.0.0.1`, so the name checked is the
//! certificate's; naming `127.0.0.1` instead is a wrong host name.

use std::time::Duration;

use poolmgr_core::db::{self, DbError, DbTls, SslMode};
use poolmgr_core::store::{self, StoreError};
use poolmgr_tests::tls::{SERVER_NAME, TestCa};
use poolmgr_tests::*;

/// A URL of the TLS test server: `host` is the name TLS checks, the address is 127.0.0.1.
fn url(host: &str, db: &str, sslmode: Option<&str>) -> String {
    let (port, _) = tls_server();
    let mode = sslmode.map(|m| format!("&sslmode={m}")).unwrap_or_default();
    format!("postgres://postgres@{host}:{port}/{db}?hostaddr=127.0.0.1{mode}")
}

/// Trusts the run's CA, given as `POOLMGR_DATABASE_CA_PEM` is: here the path form.
fn trusting_the_test_ca() -> DbTls {
    let (_, ca_path) = tls_server();
    DbTls::from_lookup(|k| (k == "POOLMGR_DATABASE_CA_PEM").then(|| ca_path.clone())).expect("the test CA")
}

/// Trusts only a CA that signed nothing the server has: here the PEM-text form.
fn trusting_a_stranger() -> DbTls {
    let pem = TestCa::generate("some other CA").cert_pem;
    DbTls::from_lookup(|k| (k == "POOLMGR_DATABASE_CA_PEM").then(|| pem.clone())).expect("a stranger CA")
}

/// Whether the server sees this session encrypted.
async fn encrypted(c: &tokio_postgres::Client) -> bool {
    c.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await.unwrap().get(0)
}

/// A one-connection pool's options over `tls`.
fn one_connection(tls: DbTls, statement_timeout: Option<Duration>) -> db::PoolOptions {
    db::PoolOptions {
        size: 1,
        connect_timeout: Duration::from_secs(10),
        check_idle: Duration::from_secs(60),
        statement_timeout,
        cancel_on_timeout: statement_timeout.is_some(),
        tls,
    }
}

#[track_caller]
fn refused(r: Result<tokio_postgres::Client, DbError>) -> String {
    match r {
        Ok(_) => panic!("the connection was accepted"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn verify_full_connects_over_tls_with_the_ca_that_signed_the_server_certificate() {
    let c = db::connect_one(&url(SERVER_NAME, "postgres", Some("verify-full")), &trusting_the_test_ca()).await.unwrap();
    assert!(encrypted(&c).await);
}

#[tokio::test]
async fn verify_full_without_that_ca_is_refused_and_says_to_set_the_ca() {
    // The compiled-in public roots do not know the test CA.
    let err = refused(db::connect_one(&url(SERVER_NAME, "postgres", Some("verify-full")), &DbTls::default()).await);
    assert!(err.contains("sslmode=verify-full") && err.contains("UnknownIssuer"), "{err}");
    assert!(err.contains("set POOLMGR_DATABASE_CA_PEM"), "{err}");
    // Nor does a CA that signed something else.
    let err =
        refused(db::connect_one(&url(SERVER_NAME, "postgres", Some("verify-full")), &trusting_a_stranger()).await);
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn verify_full_refuses_a_host_name_the_certificate_is_not_for_and_verify_ca_needs_a_ca_of_its_own() {
    let by_address = url("127.0.0.1", "postgres", Some("verify-full"));
    let err = refused(db::connect_one(&by_address, &trusting_the_test_ca()).await);
    assert!(err.contains("not valid for name \"127.0.0.1\""), "{err}");
    // The hint says how to fix the name, not how to stop checking it.
    assert!(err.contains("subjectAltName") && err.contains("re-issue"), "{err}");
    assert!(!err.contains("verify-ca"), "the hint must not suggest a weaker mode: {err}");

    // verify-ca checks the chain only: the same address is fine with the right CA…
    let c = db::connect_one(&url("127.0.0.1", "postgres", Some("verify-ca")), &trusting_the_test_ca()).await.unwrap();
    assert!(encrypted(&c).await);
    // …and refused before connecting without one: the public roots would take any certificate.
    let err = refused(db::connect_one(&url("127.0.0.1", "postgres", Some("verify-ca")), &DbTls::default()).await);
    assert!(err.contains("Set POOLMGR_DATABASE_CA_PEM"), "{err}");
}

/// With neither `sslmode` in the URL nor `POOLMGR_DATABASE_SSLMODE`, a server reached by a
/// name that is not loopback is verified in full; one on this machine gets `prefer`.
#[tokio::test]
async fn without_any_sslmode_a_remote_name_is_verified_in_full_and_a_loopback_one_is_not() {
    // `db.example`, reached at 127.0.0.1, is not a name the certificate carries: only
    // verify-full looks at names, so this refusal proves that is the mode chosen.
    let err = refused(db::connect_one(&url("db.example", "postgres", None), &trusting_the_test_ca()).await);
    assert!(err.contains("sslmode=verify-full") && err.contains("not valid for name \"db.example\""), "{err}");
    // And without the CA the chain is checked against the public roots.
    let err = refused(db::connect_one(&url("db.example", "postgres", None), &DbTls::default()).await);
    assert!(err.contains("UnknownIssuer"), "{err}");

    // 127.0.0.1, which the certificate is not for either, connects: prefer, still encrypted
    // because this server offers TLS.
    let c = db::connect_one(&url("127.0.0.1", "postgres", None), &DbTls::default()).await.unwrap();
    assert!(encrypted(&c).await);
}

#[tokio::test]
async fn require_and_prefer_encrypt_without_checking_the_certificate_unless_a_ca_is_given() {
    for mode in ["require", "prefer"] {
        let c = db::connect_one(&url("127.0.0.1", "postgres", Some(mode)), &DbTls::default()).await.unwrap();
        assert!(encrypted(&c).await, "{mode}");
        // With a CA configured the chain is checked, as libpq does with a root certificate.
        let err = refused(db::connect_one(&url(SERVER_NAME, "postgres", Some(mode)), &trusting_a_stranger()).await);
        assert!(err.contains("UnknownIssuer"), "{mode}: {err}");
    }
}

#[tokio::test]
async fn sslmode_disable_is_refused_by_a_server_that_takes_tcp_clients_only_over_tls() {
    let err = refused(db::connect_one(&url(SERVER_NAME, "postgres", Some("disable")), &trusting_the_test_ca()).await);
    assert!(err.contains("no pg_hba.conf entry") && err.contains("no encryption"), "{err}");
    assert!(err.contains("use sslmode=verify-full"), "{err}");
}

/// A function's pool against a server it cannot verify answers 503 (`Unavailable`), and the
/// logged cause says what is wrong with the certificate.
#[tokio::test]
async fn a_pool_refuses_a_server_it_cannot_verify_and_its_error_says_why() {
    let opts = one_connection(DbTls::default().with_default_mode(SslMode::VerifyFull), None);
    let pool = db::connect_pool(&url(SERVER_NAME, "postgres", None), &opts).unwrap();
    match pool.get().await {
        Err(StoreError::Unavailable(cause)) => assert!(cause.contains("UnknownIssuer"), "{cause}"),
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("the pool connected to a server whose CA it does not trust"),
    }
}

/// The pool (with `sslmode` from `POOLMGR_DATABASE_SSLMODE`, the URL naming none), the
/// migrations and the store's cancel requests all run over verified TLS.
#[tokio::test]
async fn the_pool_migrations_and_statement_cancels_run_over_verified_tls() {
    let tls = trusting_the_test_ca().with_default_mode(SslMode::VerifyFull);
    let name = format!("poolmgr_test_tls_{}", ulid::Ulid::generate().to_string().to_lowercase());
    let admin = db::connect_one(&url(SERVER_NAME, "postgres", None), &tls).await.unwrap();
    assert!(encrypted(&admin).await);
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    let db_url = url(SERVER_NAME, &name, None);

    let applied = db::migrate_url(&db_url, &tls).await.expect("migrations over TLS");
    assert_eq!(applied.last().copied(), Some(db::latest_version()));

    let pool = db::connect_pool(&db_url, &one_connection(tls.clone(), Some(Duration::from_millis(300)))).unwrap();
    {
        let conn = pool.get().await.expect("a pooled connection over TLS");
        assert_eq!(store::pool_list(&conn, None).await.unwrap().len(), 0);
    }
    {
        // The same (only) connection, back from the pool.
        let raw = pool.raw().get().await.unwrap();
        assert!(encrypted(&raw).await);
    }

    // A statement stuck on a lock past its timeout is cancelled on the server: the cancel
    // request must speak TLS too, or this server refuses it and the statement keeps waiting.
    let mut locker = db::connect_one(&db_url, &tls).await.unwrap();
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE pools IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let conn = pool.get().await.unwrap();
    match store::pool_list(&conn, None).await {
        Err(StoreError::Unavailable(msg)) => assert!(msg.contains("timed out"), "{msg}"),
        other => panic!("expected a statement timeout, got {other:?}"),
    }
    let waiting = || async {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
                &[&name],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let mut left = waiting().await;
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = waiting().await;
    }
    assert_eq!(left, 0, "the timed-out statement was cancelled server-side while the lock is still held");
    tx.rollback().await.unwrap();
    drop((conn, pool, locker));
    admin.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)")).await.unwrap();
}
