//! `poolmgr-client` against a real `poolmgr-local` (fresh test database, in-process
//! `flintlock-sim`), some of it through a fault-injecting TCP proxy.
//!
//! Needs `POOLMGR_TEST_DATABASE_URL`: run with `scripts/test.sh -p poolmgr-client`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use poolmgr_client::*;
use poolmgr_tests::local::LocalServer;
use poolmgr_tests::{ADMIN, CLIENT_A};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn admin(s: &LocalServer) -> Client {
    Client::builder(&s.endpoint).token(ADMIN).build().unwrap()
}

fn client_a(endpoint: &str) -> Client {
    Client::builder(endpoint).token(CLIENT_A).build().unwrap()
}

fn spec(name: &str, size: i32) -> PoolSpec {
    PoolSpec {
        namespace: Some("default".into()),
        name: name.into(),
        size,
        flintlock_hosts: vec!["sim".into()],
        replenishment: Replenishment { strategy: Strategy::ReplaceOnDelete, min_size: None },
        microvm_template: poolmgr_tests::template(),
        create_commands: vec![],
        pre_lease_commands: vec![],
        hook_failure_policy: None,
        heartbeat_interval_seconds: None,
        heartbeat_expiry_seconds: None,
        max_lease_seconds: None,
        autoscaling: None,
        rollout: None,
    }
}

fn pool(name: &str) -> PoolRef {
    PoolRef::new("default", name).unwrap()
}

async fn register_sim(s: &LocalServer) -> Host {
    let host = HostSpec {
        name: "sim".into(),
        address: s.sim_server.addr.to_string(),
        tls: HostTls { insecure: true, ..Default::default() },
        basic_auth_token: None,
        exec: None,
    };
    admin(s).create_host(&host).await.unwrap()
}

/// Waits until `pool` has `n` AVAILABLE VMs and nothing provisioning.
async fn wait_available(c: &Client, p: &PoolRef, n: i64) -> Pool {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let got = c.get_pool(p).await.unwrap();
        if got.status.available == n && got.status.provisioning == 0 {
            return got;
        }
        assert!(Instant::now() < deadline, "pool {p} never had {n} AVAILABLE VMs: {:?}", got.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends `call`, reads the answer as `T`, and checks `T` writes back exactly the body the
/// server sent: a field the client's type lacks (or spells differently) fails here.
#[track_caller]
fn exact<T: DeserializeOwned + Serialize>(reply: &Reply) -> T {
    let typed: T = reply.json().unwrap();
    let wire: Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(serde_json::to_value(&typed).unwrap(), wire, "the client's type loses or changes fields");
    typed
}

#[track_caller]
fn api_error(r: Result<impl std::fmt::Debug, Error>, code: u16, status: Status) -> ApiError {
    match r {
        Err(Error::Api(e)) if e.code == code && e.status == status => {
            assert!(!e.message.is_empty(), "{e:?}");
            e
        }
        other => panic!("expected {code} {status}, got {other:?}"),
    }
}

async fn lease_count(s: &LocalServer) -> i64 {
    let db = s.db.client().await;
    db.query_one("SELECT count(*) FROM leases", &[]).await.unwrap().get(0)
}

// ---------------------------------------------------------------------------------------
// A fault-injecting proxy
// ---------------------------------------------------------------------------------------

/// A TCP proxy in front of the server that forwards HTTP/1.1 exchanges one at a time and,
/// for the first `lose` claims (`POST /v1/claims`), reads the server's whole answer — so the
/// claim committed — then resets the client's connection instead of passing it on.
struct Proxy {
    addr: SocketAddr,
    /// The answers it swallowed, as the server sent them.
    swallowed: Arc<Mutex<Vec<String>>>,
    /// Claims forwarded so far.
    claims: Arc<AtomicUsize>,
}

impl Proxy {
    async fn start(upstream: &str, lose: usize) -> Proxy {
        let upstream: SocketAddr = upstream.trim_start_matches("http://").parse().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let swallowed = Arc::new(Mutex::new(Vec::new()));
        let claims = Arc::new(AtomicUsize::new(0));
        let to_lose = Arc::new(AtomicUsize::new(lose));
        let (sw, cl) = (swallowed.clone(), claims.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(relay(conn, upstream, to_lose.clone(), sw.clone(), cl.clone()));
            }
        });
        Proxy { addr, swallowed, claims }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// One HTTP/1.1 message (head and a `Content-Length` body): its first line and its bytes.
async fn read_message<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> Option<(String, Vec<u8>)> {
    let mut raw = Vec::new();
    loop {
        let mut line = Vec::new();
        if r.read_until(b'\n', &mut line).await.ok()? == 0 {
            return None;
        }
        raw.extend_from_slice(&line);
        if line == b"\r\n" {
            break;
        }
    }
    let head = String::from_utf8_lossy(&raw).into_owned();
    assert!(!head.to_ascii_lowercase().contains("transfer-encoding: chunked"), "the proxy reads sized bodies only");
    let len = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .map_or(0, |(_, v)| v.trim().parse::<usize>().unwrap());
    let mut body = vec![0; len];
    r.read_exact(&mut body).await.ok()?;
    raw.extend_from_slice(&body);
    Some((head.lines().next().unwrap_or_default().to_owned(), raw))
}

async fn relay(
    conn: TcpStream,
    upstream: SocketAddr,
    to_lose: Arc<AtomicUsize>,
    swallowed: Arc<Mutex<Vec<String>>>,
    claims: Arc<AtomicUsize>,
) {
    let Ok(up) = TcpStream::connect(upstream).await else { return };
    let (cr, mut cw) = conn.into_split();
    let (ur, mut uw) = up.into_split();
    let (mut cr, mut ur) = (BufReader::new(cr), BufReader::new(ur));
    while let Some((request_line, request)) = read_message(&mut cr).await {
        if uw.write_all(&request).await.is_err() {
            return;
        }
        let Some((_, answer)) = read_message(&mut ur).await else { return };
        let is_claim = request_line.starts_with("POST /v1/claims ");
        if is_claim {
            claims.fetch_add(1, Ordering::SeqCst);
        }
        if is_claim && to_lose.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            swallowed.lock().unwrap().push(String::from_utf8_lossy(&answer).into_owned());
            // RST instead of the answer: the client sees a connection reset.
            let conn = cr.into_inner().reunite(cw).unwrap();
            let _ = conn.set_zero_linger();
            return;
        }
        if cw.write_all(&answer).await.is_err() {
            return;
        }
    }
}

/// The JSON body of a swallowed HTTP answer.
fn body_of(answer: &str) -> Value {
    serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------
// Issue 13: the lost answer
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_is_lost_is_retried_with_the_same_id_and_costs_one_vm() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 3)).await.unwrap();
    wait_available(&a, &pool("ci"), 3).await;

    let proxy = Proxy::start(&s.endpoint, 1).await;
    let retries = Arc::new(Mutex::new(Vec::new()));
    let seen = retries.clone();
    let opts = ClaimOptions {
        on_retry: Some(Arc::new(move |n: &RetryNotice<'_>| {
            seen.lock().unwrap().push((n.attempt, n.request_id.to_owned(), n.error.to_string()))
        })),
        ..ClaimOptions::default()
    };
    let got = client_a(&proxy.endpoint()).claim_with(&pool("ci"), &opts).await.unwrap();

    // The server committed the first attempt; its answer never arrived.
    let lost = proxy.swallowed.lock().unwrap().clone();
    assert_eq!(lost.len(), 1);
    assert!(lost[0].starts_with("HTTP/1.1 200"), "{}", lost[0]);
    let first = body_of(&lost[0]);
    assert_eq!(first["replayed"], json!(false));
    // The retry came back with that very lease, as a replay, under the same request_id.
    assert_eq!(got.attempts, 2);
    assert_eq!(proxy.claims.load(Ordering::SeqCst), 2);
    assert!(got.response.replayed && got.reply.replayed());
    assert_eq!(json!(got.response.lease.lease_id), first["lease"]["lease_id"]);
    assert_eq!(json!(got.response.vm.id), first["vm"]["id"]);
    let id = got.response.lease.request_id.clone().expect("the client sent a request_id");
    assert!(uuid::Uuid::parse_str(&id).is_ok_and(|u| u.get_version_num() == 4), "{id}");
    assert_eq!(first["lease"]["request_id"], json!(id));
    let retries = retries.lock().unwrap().clone();
    assert_eq!(retries.len(), 1, "{retries:?}");
    assert_eq!((retries[0].0, retries[0].1.as_str()), (1, id.as_str()));

    // Exactly one fewer VM: one lease, one LEASED VM.
    assert_eq!(lease_count(&s).await, 1);
    let p = a.get_pool(&pool("ci")).await.unwrap();
    assert_eq!((p.status.available + p.status.provisioning, p.status.leased), (2, 1), "{:?}", p.status);
    assert_eq!(a.get_lease(&got.response.lease.lease_id).await.unwrap(), got.response.lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poolmgr_locals_fault_point_loses_claim_answers_after_commit_and_the_client_recovers() {
    let s = LocalServer::start_with(&[("POOLMGR_LOCAL_FAULT_LOSE_CLAIM_ANSWER_EVERY", "1")]).await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 3)).await.unwrap();
    wait_available(&a, &pool("ci"), 3).await;
    let c = client_a(&s.endpoint);

    // One attempt only: the answer is lost, yet the lease exists.
    let once = c.claim_once(&ClaimRequest { pool: pool("ci"), request_id: Some("r-once".into()) }).await;
    match &once {
        Err(e @ Error::Transport { kind: TransportKind::Interrupted, .. }) => assert!(e.outcome_unknown()),
        other => panic!("the answer should have been lost: {other:?}"),
    }
    assert_eq!(lease_count(&s).await, 1);
    // Its retry with the same id is a replay, whose answer is never lost.
    let again = c.claim_once(&ClaimRequest { pool: pool("ci"), request_id: Some("r-once".into()) }).await.unwrap();
    assert!(again.replayed);

    // The client's claim: first answer lost, the retry replays it.
    let got = c.claim_with(&pool("ci"), &ClaimOptions::default()).await.unwrap();
    assert_eq!(got.attempts, 2);
    assert!(got.response.replayed);
    assert_eq!(lease_count(&s).await, 2);
    let p = a.get_pool(&pool("ci")).await.unwrap();
    assert_eq!(p.status.leased, 2, "{:?}", p.status);
    let log = s.log();
    assert_eq!(log.matches("claim answer lost on purpose").count(), 2, "{log}");
    assert!(log.contains(&got.response.lease.lease_id), "the loss is logged with its lease: {log}");
}

// ---------------------------------------------------------------------------------------
// Every route, typed
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_reads_the_servers_objects_exactly() {
    let s = LocalServer::start().await;
    let a = admin(&s);
    assert_eq!(a.health().await.unwrap().status, "ok");

    // Hosts.
    let sim = register_sim(&s).await;
    assert_eq!((sim.name.as_str(), sim.exec, sim.tls.insecure), ("sim", HostExec::Auto, true));
    exact::<Host>(&a.send(Call::get_host("sim")).await.unwrap());
    exact::<HostList>(&a.send(Call::list_hosts()).await.unwrap());
    let spare = HostSpec {
        name: "spare".into(),
        address: "127.0.0.1:9".into(),
        tls: HostTls { insecure: true, ..Default::default() },
        basic_auth_token: Some("s3cret".into()),
        exec: Some(HostExec::Disabled),
    };
    let h = a.create_host(&spare).await.unwrap();
    assert_eq!((h.exec, h.basic_auth_token), (HostExec::Disabled, None));
    api_error(a.create_host(&spare).await, 409, Status::AlreadyExists);
    let h = exact::<Host>(&a.send(Call::cordon_host("spare", Some("disk"))).await.unwrap());
    assert_eq!((h.cordoned, h.cordoned_reason.as_deref()), (true, Some("disk")));
    assert!(h.cordoned_at.is_some());
    assert!(!a.uncordon_host("spare").await.unwrap().cordoned);
    let h = a.update_host(&HostSpec { address: "127.0.0.1:10".into(), exec: None, ..spare.clone() }).await.unwrap();
    assert_eq!((h.address.as_str(), h.exec), ("127.0.0.1:10", HostExec::Auto));
    a.delete_host("spare").await.unwrap();
    api_error(a.get_host("spare").await, 404, Status::NotFound);

    // Pools.
    let created = exact::<Pool>(&a.send(Call::create_pool(&spec("ci", 2))).await.unwrap());
    assert_eq!(created.spec.heartbeat_expiry_seconds, Some(120), "the server fills the defaults");
    api_error(a.create_pool(&spec("ci", 2)).await, 409, Status::AlreadyExists);
    let mut unknown_host = spec("other", 1);
    unknown_host.flintlock_hosts = vec!["nohost".into()];
    api_error(a.create_pool(&unknown_host).await, 400, Status::FailedPrecondition);
    wait_available(&a, &pool("ci"), 2).await;
    exact::<Pool>(&a.send(Call::get_pool(&pool("ci"))).await.unwrap());
    let list = exact::<PoolList>(&a.send(Call::list_pools(Some("default"))).await.unwrap());
    assert_eq!(list.pools.len(), 1);
    assert!(a.list_pools(Some("elsewhere")).await.unwrap().is_empty());
    let grown = a.update_pool(&spec("ci", 3)).await.unwrap();
    assert_eq!(grown.spec.size, 3);
    wait_available(&a, &pool("ci"), 3).await;

    // Claims and leases (a client token).
    let c = client_a(&s.endpoint);
    let req = ClaimRequest { pool: pool("ci"), request_id: Some("r-1".into()) };
    let first = exact::<ClaimResponse>(&c.send(Call::claim(&req)).await.unwrap());
    assert!(!first.replayed);
    let replay = c.send(Call::claim(&req)).await.unwrap();
    assert!(replay.replayed());
    assert_eq!(exact::<ClaimResponse>(&replay).lease, first.lease);
    let got = c.claim_with(&pool("ci"), &ClaimOptions::default()).await.unwrap();
    assert_eq!((got.attempts, got.response.replayed), (1, false));
    let lease = exact::<Lease>(&c.send(Call::get_lease(&first.lease.lease_id)).await.unwrap());
    assert_eq!(lease, first.lease);
    let hb = exact::<HeartbeatResponse>(&c.send(Call::heartbeat(&lease.lease_id)).await.unwrap());
    assert!(hb.lease.expires_at >= lease.expires_at);
    let page = exact::<LeaseList>(
        &c.send(Call::list_leases(&LeaseQuery { page_size: Some(1), ..Default::default() })).await.unwrap(),
    );
    assert_eq!(page.leases.len(), 1);
    assert!(!page.next_page_token.is_empty());
    let rest = c
        .list_leases(&LeaseQuery { page_size: Some(1), page_token: Some(page.next_page_token), pool: Some(pool("ci")) })
        .await
        .unwrap();
    assert_eq!(rest.leases.len(), 1);
    assert_ne!(rest.leases[0].lease_id, page.leases[0].lease_id);
    api_error(c.list_pools(None).await, 403, Status::PermissionDenied);
    api_error(
        Client::builder(&s.endpoint)
            .token("wrong-token-0123456789")
            .build()
            .unwrap()
            .list_leases(&LeaseQuery::default())
            .await,
        401,
        Status::Unauthenticated,
    );
    api_error(c.claim(&pool("ghost")).await, 404, Status::NotFound);

    // VMs.
    let vms = exact::<VmList>(&a.send(Call::list_vms(&VmQuery::pool(&pool("ci")))).await.unwrap());
    assert_eq!(vms.vms.len(), 3);
    let leased = a.list_vms(&VmQuery { phase: Some(Phase::Leased), ..Default::default() }).await.unwrap();
    assert_eq!(leased.len(), 2);
    let vm = exact::<Vm>(&a.send(Call::get_vm(&first.vm.id)).await.unwrap());
    assert_eq!((vm.phase, vm.lease_id.as_deref()), (Phase::Leased, Some(first.lease.lease_id.as_str())));
    assert_eq!(vm.network_interfaces, first.vm.network_interfaces);
    api_error(a.delete_vm(&vm.id).await, 400, Status::FailedPrecondition);

    // The last VM, without a request id; the pool is empty then: 429 with Retry-After, at
    // once when not waiting for a VM.
    let last = c.claim_once(&ClaimRequest { pool: pool("ci"), request_id: None }).await.unwrap();
    assert_eq!(last.lease.request_id, None);
    let no_wait = ClaimOptions { wait_for_vm: false, ..ClaimOptions::default() };
    let e = api_error(c.claim_with(&pool("ci"), &no_wait).await, 429, Status::ResourceExhausted);
    assert_eq!(e.retry_after, Some(Duration::from_secs(1)));
    assert_eq!(e.reason.as_deref(), Some("POOL_EXHAUSTED"));
    assert!(e.request_id.as_deref().is_some_and(|id| !id.is_empty()), "{e:?}");

    // Release, then the events of all this.
    c.release(&first.lease.lease_id).await.unwrap();
    api_error(c.release(&first.lease.lease_id).await, 404, Status::NotFound);
    api_error(c.heartbeat(&first.lease.lease_id).await, 404, Status::NotFound);
    let q = EventQuery { after: 0, pool: Some(pool("ci")), limit: Some(1000), wait_seconds: None };
    let events = exact::<EventList>(&a.send(Call::events(&q)).await.unwrap());
    assert!(events.events.iter().any(|e| e.kind == "VM_CLAIMED" && e.lease_id == Some(first.lease.lease_id.clone())));
    // A long-poll from the end returns when the next event commits.
    let q = EventQuery { after: events.next_after, pool: Some(pool("ci")), limit: Some(10), wait_seconds: Some(20) };
    let poll = tokio::spawn({
        let a = a.clone();
        async move { a.events(&q).await }
    });
    c.release(&got.response.lease.lease_id).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(25), poll).await.unwrap().unwrap().unwrap();
    assert!(next.events.iter().all(|e| e.id > events.next_after) && !next.events.is_empty(), "{next:?}");

    // Pool delete.
    api_error(a.delete_pool(&pool("ghost"), false).await, 404, Status::NotFound);
    a.delete_pool(&pool("ci"), true).await.unwrap();
    api_error(a.get_pool(&pool("ci")).await, 404, Status::NotFound);
    assert!(!s.log().contains("lost on purpose"), "the fault point is off by default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_specs_refused_locally_are_the_ones_the_server_refuses() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    let bad: Vec<(&str, PoolSpec)> = vec![
        ("name", PoolSpec { name: "CI".into(), ..spec("x", 1) }),
        ("namespace", PoolSpec { namespace: Some("a_b".into()), ..spec("x", 1) }),
        ("size", PoolSpec { size: -1, ..spec("x", 1) }),
        ("size", PoolSpec { size: MAX_POOL_SIZE + 1, ..spec("x", 1) }),
        ("flintlock_hosts", PoolSpec { flintlock_hosts: vec!["Sim".into()], ..spec("x", 1) }),
        (
            "min_size",
            PoolSpec {
                replenishment: Replenishment { strategy: Strategy::MinSizeThreshold, min_size: None },
                ..spec("x", 1)
            },
        ),
        (
            "min_size",
            PoolSpec {
                replenishment: Replenishment { strategy: Strategy::MinSizeThreshold, min_size: Some(2) },
                ..spec("x", 1)
            },
        ),
        ("heartbeat_interval_seconds", PoolSpec { heartbeat_interval_seconds: Some(0), ..spec("x", 1) }),
        (
            "heartbeat_expiry_seconds",
            PoolSpec { heartbeat_interval_seconds: Some(60), heartbeat_expiry_seconds: Some(30), ..spec("x", 1) },
        ),
        ("microvm_template", PoolSpec { microvm_template: json!("kernel"), ..spec("x", 1) }),
    ];
    for (field, spec) in bad {
        let local = spec.validate().expect_err(field);
        assert!(local.contains(field), "{field}: {local}");
        assert!(matches!(a.create_pool(&spec).await, Err(Error::InvalidInput(_))), "{field}: sent anyway");
        // Sent without the local check, the server refuses it too.
        api_error(a.send(Call::create_pool(&spec)).await, 400, Status::InvalidArgument);
    }
    // And what passes locally, the server takes.
    let ok = PoolSpec {
        replenishment: Replenishment { strategy: Strategy::MinSizeThreshold, min_size: Some(1) },
        heartbeat_interval_seconds: Some(5),
        heartbeat_expiry_seconds: Some(5),
        ..spec("fine", 1)
    };
    ok.validate().unwrap();
    a.create_pool(&ok).await.unwrap();
    // The name rules are the server's own.
    for name in ["ci", "a", "a-b", "-a", "a-", "A", "a_b", "", &"a".repeat(63), &"a".repeat(64)] {
        assert_eq!(
            validate_name("name", name).is_ok(),
            poolmgr_core::domain::validate_name("name", name).is_ok(),
            "{name:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Waiting, deadlines, heartbeats
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_an_empty_pool_until_its_deadline_with_one_request_id() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 0)).await.unwrap();
    let c = client_a(&s.endpoint);
    let ids = Arc::new(Mutex::new(Vec::new()));
    let seen = ids.clone();
    let opts = ClaimOptions {
        request_id: Some("job-7".into()),
        deadline: Duration::from_millis(1500),
        backoff: Backoff { first: Duration::from_millis(50), max: Duration::from_millis(200) },
        on_retry: Some(Arc::new(move |n: &RetryNotice<'_>| seen.lock().unwrap().push(n.request_id.to_owned()))),
        ..ClaimOptions::default()
    };
    let started = Instant::now();
    api_error(c.claim_with(&pool("ci"), &opts).await, 429, Status::ResourceExhausted);
    assert!(started.elapsed() >= Duration::from_millis(1500), "gave up early: {:?}", started.elapsed());
    let ids = ids.lock().unwrap().clone();
    assert!(!ids.is_empty() && ids.iter().all(|i| i == "job-7"), "{ids:?}");
    assert_eq!(lease_count(&s).await, 0);

    // The pool fills while the claim waits: it gets a VM.
    let waiting = tokio::spawn({
        let c = c.clone();
        let opts = ClaimOptions { deadline: Duration::from_secs(60), ..opts.clone() };
        async move { c.claim_with(&pool("ci"), &opts).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.update_pool(&spec("ci", 1)).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(70), waiting).await.unwrap().unwrap().unwrap();
    assert!(got.attempts > 1, "{got:?}");
    assert_eq!(got.response.lease.request_id.as_deref(), Some("job-7"));
    assert_eq!(lease_count(&s).await, 1);

    // Nothing listens: connection failures are retried until the deadline, then reported.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let started = Instant::now();
    let opts = ClaimOptions { deadline: Duration::from_millis(800), ..opts };
    match client_a(&closed).claim_with(&pool("ci"), &opts).await {
        Err(Error::Transport { kind: TransportKind::Connect, message }) => {
            assert!(message.contains("cannot connect to"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(800));
    // Bad input is refused before anything is sent.
    let long = ClaimOptions { request_id: Some("r".repeat(256)), ..ClaimOptions::default() };
    assert!(matches!(client_a(&closed).claim_with(&pool("ci"), &long).await, Err(Error::InvalidInput(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_heartbeats_until_released_and_dropping_it_lets_the_lease_expire() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    let short = PoolSpec { heartbeat_interval_seconds: Some(1), heartbeat_expiry_seconds: Some(3), ..spec("ci", 3) };
    a.create_pool(&short).await.unwrap();
    wait_available(&a, &pool("ci"), 3).await;
    let c = client_a(&s.endpoint);

    // Kept alive: heartbeats move last_heartbeat_at and expires_at forward, past the first
    // expiry, while the reconciler sweeps expired leases every second.
    let first = c.claim(&pool("ci")).await.unwrap().lease;
    assert_eq!(first.expiry_window(), Duration::from_secs(3));
    let guard = c.keep_alive(&first);
    let until = Instant::now() + Duration::from_secs(30);
    while guard.heartbeats() < 4 {
        assert!(Instant::now() < until, "no heartbeats: {:?}", guard.state());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let now = c.get_lease(&first.lease_id).await.unwrap();
    assert!(now.last_heartbeat_at > first.claimed_at);
    assert!(now.expires_at > first.expires_at + chrono::Duration::seconds(2), "{now:?} vs {first:?}");
    match guard.state() {
        LeaseState::Alive { lease, .. } => assert_eq!(lease.lease_id, first.lease_id),
        other => panic!("{other:?}"),
    }
    guard.release(Duration::from_secs(10)).await.unwrap();
    api_error(c.get_lease(&first.lease_id).await, 404, Status::NotFound);

    // Dropped: the heartbeats stop and the lease expires.
    let second = c.claim(&pool("ci")).await.unwrap().lease;
    let guard = c.keep_alive(&second);
    while guard.heartbeats() < 1 {
        assert!(Instant::now() < until + Duration::from_secs(30), "no heartbeat: {:?}", guard.state());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(guard);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.get_lease(&second.lease_id).await {
            Err(Error::Api(e)) if e.status == Status::NotFound => break,
            Ok(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            other => panic!("the lease should have expired once its heartbeats stopped: {other:?}"),
        }
    }

    // A lease released elsewhere: the guard reports it lost.
    let third = c.claim(&pool("ci")).await.unwrap().lease;
    let mut guard = c.keep_alive_every(&third, Duration::from_millis(200));
    a.release(&third.lease_id).await.unwrap();
    let why = tokio::time::timeout(Duration::from_secs(10), guard.lost()).await.expect("the loss is noticed");
    assert_eq!(why.status(), Some(&Status::NotFound));
    assert!(matches!(guard.state(), LeaseState::Lost(_)));
}
