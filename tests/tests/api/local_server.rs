//! `poolmgr-local`'s own connection limits (issue 25 item 11), against the real binary: a
//! client that never finishes its request head is cut off, and connections beyond the cap
//! wait for a free one instead of each getting a task.

use std::time::Duration;

use poolmgr_tests::local::LocalServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr(s: &LocalServer) -> String {
    s.endpoint.trim_start_matches("http://").to_owned()
}

/// Reads until the server closes the connection (or `guard` passes, which fails the test).
async fn read_to_close(c: &mut TcpStream, guard: Duration) -> String {
    let mut got = Vec::new();
    tokio::time::timeout(guard, c.read_to_end(&mut got))
        .await
        .expect("the server kept the connection open")
        .expect("read");
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn a_request_head_not_finished_within_the_header_timeout_is_cut_off() {
    let s = LocalServer::start_with(&[("POOLMGR_HTTP_HEADER_TIMEOUT_SECONDS", "1")]).await;
    let mut slow = TcpStream::connect(addr(&s)).await.unwrap();
    // Half a request head, and then nothing.
    slow.write_all(b"GET /livez HTTP/1.1\r\nHost: poolmgr\r\n").await.unwrap();
    let answer = read_to_close(&mut slow, Duration::from_secs(30)).await;
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    // A connection that sends nothing at all is closed too (it would hold a slot for ever).
    let mut silent = TcpStream::connect(addr(&s)).await.unwrap();
    let answer = read_to_close(&mut silent, Duration::from_secs(30)).await;
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 408"), "{answer:?}");

    // A whole request on a fresh connection is answered as ever.
    let mut quick = TcpStream::connect(addr(&s)).await.unwrap();
    quick.write_all(b"GET /livez HTTP/1.1\r\nHost: poolmgr\r\nConnection: close\r\n\r\n").await.unwrap();
    let answer = read_to_close(&mut quick, Duration::from_secs(30)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_for_one_to_close() {
    let s = LocalServer::start_with(&[
        ("POOLMGR_HTTP_MAX_CONNECTIONS", "2"),
        ("POOLMGR_HTTP_HEADER_TIMEOUT_SECONDS", "600"),
    ])
    .await;
    // The harness's start-up probe may still hold a kept-alive connection: wait until two
    // fresh idle connections are both taken (each answers a request), so the cap is full.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(addr(&s)).await.unwrap();
        c.write_all(b"GET /livez HTTP/1.1\r\nHost: poolmgr\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(30), c.read(&mut buf))
            .await
            .expect("a held connection is served once the start-up probe's closes")
            .unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        held.push(c); // kept alive, idle
    }
    // A third connection is accepted by the kernel but not served while both are open.
    let mut third = TcpStream::connect(addr(&s)).await.unwrap();
    third.write_all(b"GET /livez HTTP/1.1\r\nHost: poolmgr\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 512];
    let early = tokio::time::timeout(Duration::from_millis(700), third.read(&mut buf)).await;
    assert!(early.is_err(), "the third connection was served past the cap of 2: {early:?}");
    // One closes: the third is served.
    drop(held.pop());
    let answer = read_to_close(&mut third, Duration::from_secs(30)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(s.log().contains("POOLMGR_HTTP_MAX_CONNECTIONS"), "the cap is logged when reached:\n{}", s.log());
}

/// SIGTERM: poolmgr-local stops its reconcile ticker with the HTTP server and gives the loop
/// lease back, so a restarted process (or another one on the database) loops at once. Before,
/// the lease stayed with the dead process until it ran out and a restart's refills waited.
#[tokio::test]
async fn sigterm_gives_the_reconcile_loop_lease_back() {
    use poolmgr_tests::{ADMIN, SIM_HOST, pool_spec};
    use serde_json::json;
    // A ten-minute linger: after creating the pool's VM the loop keeps the lease.
    let mut s = LocalServer::start_with(&[("POOLMGR_RECONCILE_LINGER_MS", "600000")]).await;
    let http = reqwest::Client::new();
    let host = json!({"name": SIM_HOST, "address": s.sim_server.addr.to_string(), "tls": {"insecure": true}});
    let r = http.post(format!("{}/v1/hosts", s.endpoint)).bearer_auth(ADMIN).json(&host).send().await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let r = http
        .post(format!("{}/v1/pools", s.endpoint))
        .bearer_auth(ADMIN)
        .json(&pool_spec("ci", 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let db = s.db.client().await;
    let held = "SELECT count(*) FROM reconcile_loop WHERE owner IS NOT NULL AND until > now()";
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n: i64 = db.query_one(held, &[]).await.unwrap().get(0);
        let vms: i64 = db.query_one("SELECT count(*) FROM vms WHERE phase = 'AVAILABLE'", &[]).await.unwrap().get(0);
        if n == 1 && vms == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the loop never filled the pool while holding the lease:\n{}",
            s.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = s.server.id().expect("poolmgr-local runs").to_string();
    let killed = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(60), s.server.wait())
        .await
        .expect("poolmgr-local exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}; its log:\n{}", s.log());
    let owners: i64 =
        db.query_one("SELECT count(*) FROM reconcile_loop WHERE owner IS NOT NULL", &[]).await.unwrap().get(0);
    assert_eq!(owners, 0, "the loop lease was left to run out; its log:\n{}", s.log());
}
