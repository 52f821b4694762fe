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
    let mut s =
        PoolSpec::new("default", name, size, Replenishment::new(Strategy::ReplaceOnDelete), poolmgr_tests::template());
    s.flintlock_hosts = vec!["sim".into()];
    s
}

/// `spec("x", 1)` changed by `f`.
fn spec_with(f: impl FnOnce(&mut PoolSpec)) -> PoolSpec {
    let mut s = spec("x", 1);
    f(&mut s);
    s
}

fn pool(name: &str) -> PoolRef {
    PoolRef::new("default", name).unwrap()
}

async fn register_sim(s: &LocalServer) -> Host {
    let host = HostSpec::new("sim", &s.sim_server.addr.to_string(), HostTls::insecure());
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

/// What the proxy does with one request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// Forward it and pass the answer on.
    Pass,
    /// Forward it, read the whole answer (so it committed), then reset the client's
    /// connection instead of passing it on.
    Lose,
    /// Never forward it and never answer (the connection stays open).
    Hold,
    /// Answer this (status, body) itself without forwarding: a proxy's own error.
    Answer(u16, &'static str),
    /// Forward it and pass the answer on with its body overwritten (same length, not JSON).
    Garble,
}

/// Picks what happens to a request, from its request line.
type Rule = Arc<dyn Fn(&str) -> Fault + Send + Sync>;

/// A TCP proxy in front of the server that forwards HTTP/1.1 exchanges one at a time and
/// applies a [`Fault`] to each: by default it loses the answers of the first `lose` claims
/// (`POST /v1/claims`; or other requests: [`Proxy::losing`]).
struct Proxy {
    addr: SocketAddr,
    /// The answers it swallowed, as the server sent them.
    swallowed: Arc<Mutex<Vec<String>>>,
    /// Claims forwarded so far.
    claims: Arc<AtomicUsize>,
    /// Answers still to lose ([`Proxy::losing`]).
    to_lose: Arc<AtomicUsize>,
}

impl Proxy {
    async fn start(upstream: &str, lose: usize) -> Proxy {
        Proxy::losing(upstream, "POST /v1/claims ", lose).await
    }

    /// Loses the answers of the first `lose` requests whose request line starts with `lost`.
    async fn losing(upstream: &str, lost: &'static str, lose: usize) -> Proxy {
        let to_lose = Arc::new(AtomicUsize::new(lose));
        let left = to_lose.clone();
        let rule: Rule = Arc::new(move |line: &str| {
            let lose = line.starts_with(lost)
                && left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
            if lose { Fault::Lose } else { Fault::Pass }
        });
        Proxy { to_lose, ..Proxy::with_rule(upstream, rule).await }
    }

    /// Applies `rule` to every request.
    async fn with_rule(upstream: &str, rule: Rule) -> Proxy {
        let upstream: SocketAddr = upstream.trim_start_matches("http://").parse().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let swallowed = Arc::new(Mutex::new(Vec::new()));
        let claims = Arc::new(AtomicUsize::new(0));
        let (sw, cl) = (swallowed.clone(), claims.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(relay(conn, upstream, rule.clone(), sw.clone(), cl.clone()));
            }
        });
        Proxy { addr, swallowed, claims, to_lose: Arc::new(AtomicUsize::new(0)) }
    }

    /// Loses the answers of the next `n` requests its [`Proxy::losing`] rule names.
    fn lose(&self, n: usize) {
        self.to_lose.store(n, Ordering::SeqCst);
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
    rule: Rule,
    swallowed: Arc<Mutex<Vec<String>>>,
    claims: Arc<AtomicUsize>,
) {
    let Ok(up) = TcpStream::connect(upstream).await else { return };
    let (cr, mut cw) = conn.into_split();
    let (ur, mut uw) = up.into_split();
    let (mut cr, mut ur) = (BufReader::new(cr), BufReader::new(ur));
    while let Some((request_line, request)) = read_message(&mut cr).await {
        let fault = rule(&request_line);
        match fault {
            Fault::Hold => {
                tokio::time::sleep(Duration::from_secs(600)).await;
                return;
            }
            Fault::Answer(status, body) => {
                let msg = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if cw.write_all(msg.as_bytes()).await.is_err() {
                    return;
                }
                continue;
            }
            Fault::Pass | Fault::Lose | Fault::Garble => {}
        }
        if uw.write_all(&request).await.is_err() {
            return;
        }
        let Some((_, mut answer)) = read_message(&mut ur).await else { return };
        if request_line.starts_with("POST /v1/claims ") {
            claims.fetch_add(1, Ordering::SeqCst);
        }
        if fault == Fault::Lose {
            swallowed.lock().unwrap().push(String::from_utf8_lossy(&answer).into_owned());
            // RST instead of the answer: the client sees a connection reset.
            let conn = cr.into_inner().reunite(cw).unwrap();
            let _ = conn.set_zero_linger();
            return;
        }
        if fault == Fault::Garble {
            let head = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
            swallowed.lock().unwrap().push(String::from_utf8_lossy(&answer).into_owned());
            answer[head..].fill(b'~');
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
    let opts = ClaimOptions::default().with_on_retry(move |n: &RetryNotice<'_>| {
        seen.lock().unwrap().push((n.attempt, n.request_id.to_owned(), n.error.to_string()))
    });
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
async fn a_claim_answer_that_cannot_be_read_names_the_id_that_recovers_its_lease() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 2)).await.unwrap();
    wait_available(&a, &pool("ci"), 2).await;

    // The first claim's answer arrives with a body that is not JSON.
    let garble = Arc::new(AtomicUsize::new(1));
    let left = garble.clone();
    let rule: Rule = Arc::new(move |line: &str| {
        let hit = line.starts_with("POST /v1/claims ")
            && left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if hit { Fault::Garble } else { Fault::Pass }
    });
    let proxy = Proxy::with_rule(&s.endpoint, rule).await;
    let c = client_a(&proxy.endpoint());
    let opts = ClaimOptions::default().with_request_id("job-garbled");
    let e = c.claim_with(&pool("ci"), &opts).await.unwrap_err();
    assert!(matches!(&e, Error::Decode(_)), "{e:?}");
    assert!(e.to_string().contains("request_id job-garbled"), "{e}");
    assert_eq!(proxy.claims.load(Ordering::SeqCst), 1, "a garbled answer is not retried");
    // The claim committed, and the id the error names gets its lease back.
    let committed = body_of(&proxy.swallowed.lock().unwrap()[0]);
    assert_eq!(lease_count(&s).await, 1);
    let again = c.claim_with(&pool("ci"), &opts).await.unwrap();
    assert!(again.response.replayed);
    assert_eq!(json!(again.response.lease.lease_id), committed["lease"]["lease_id"]);
    assert_eq!(lease_count(&s).await, 1);

    // claim_once says the same when it was given an id.
    garble.store(1, Ordering::SeqCst);
    let req = ClaimRequest::new(pool("ci"), Some("job-once".into()));
    let e = c.claim_once(&req).await.unwrap_err();
    assert!(e.to_string().contains("request_id job-once"), "{e}");
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
    let once = c.claim_once(&ClaimRequest::new(pool("ci"), Some("r-once".into()))).await;
    match &once {
        Err(e @ Error::Transport { kind: TransportKind::Interrupted, .. }) => assert!(e.outcome_unknown()),
        other => panic!("the answer should have been lost: {other:?}"),
    }
    assert_eq!(lease_count(&s).await, 1);
    // Its retry with the same id is a replay, whose answer is never lost.
    let again = c.claim_once(&ClaimRequest::new(pool("ci"), Some("r-once".into()))).await.unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_answer_is_lost_is_released_by_every_release_path() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 3)).await.unwrap();
    wait_available(&a, &pool("ci"), 3).await;
    let direct = client_a(&s.endpoint);
    let proxy = Proxy::losing(&s.endpoint, "DELETE /v1/leases/", 0).await;
    let c = client_a(&proxy.endpoint());

    // The library's raw send: the first attempt released the lease (its 204 was lost), the
    // retry found it gone: released, not NOT_FOUND.
    let first = direct.claim(&pool("ci")).await.unwrap().lease;
    proxy.lose(1);
    let reply = c.send(Call::release(&first.lease_id)).await.unwrap();
    assert_eq!((reply.status, reply.body.len()), (204, 0));
    assert!(proxy.swallowed.lock().unwrap()[0].starts_with("HTTP/1.1 204"), "{:?}", proxy.swallowed);
    api_error(direct.get_lease(&first.lease_id).await, 404, Status::NotFound);

    // Client::release and a guard's release: the same.
    let second = direct.claim(&pool("ci")).await.unwrap().lease;
    proxy.lose(1);
    c.release(&second.lease_id).await.unwrap();
    let third = direct.claim(&pool("ci")).await.unwrap().lease;
    proxy.lose(1);
    c.keep_alive(&third).release(Duration::from_secs(10)).await.unwrap();
    assert_eq!(proxy.swallowed.lock().unwrap().len(), 3);
    assert_eq!(lease_count(&s).await, 0);

    // A lease that never existed is still NOT_FOUND (nothing was lost on the way).
    api_error(c.send(Call::release(&first.lease_id)).await, 404, Status::NotFound);
    api_error(c.release(&first.lease_id).await, 404, Status::NotFound);
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
    let mut spare = HostSpec::new("spare", "127.0.0.1:9", HostTls::insecure());
    spare.basic_auth_token = Some("s3cret".into());
    spare.exec = Some(HostExec::Disabled);
    let h = a.create_host(&spare).await.unwrap();
    assert_eq!((h.exec, h.basic_auth_token), (HostExec::Disabled, None));
    api_error(a.create_host(&spare).await, 409, Status::AlreadyExists);
    let h = exact::<Host>(&a.send(Call::cordon_host("spare", Some("disk"))).await.unwrap());
    assert_eq!((h.cordoned, h.cordoned_reason.as_deref()), (true, Some("disk")));
    assert!(h.cordoned_at.is_some());
    assert!(!a.uncordon_host("spare").await.unwrap().cordoned);
    let mut moved = spare.clone();
    (moved.address, moved.exec) = ("127.0.0.1:10".into(), None);
    let h = a.update_host(&moved).await.unwrap();
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
    let req = ClaimRequest::new(pool("ci"), Some("r-1".into()));
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
    let page = exact::<LeaseList>(&c.send(Call::list_leases(&LeaseQuery::default().with_page_size(1))).await.unwrap());
    assert_eq!(page.leases.len(), 1);
    assert!(!page.next_page_token.is_empty());
    let rest = c
        .list_leases(&LeaseQuery::pool(Some(pool("ci"))).with_page_size(1).with_page_token(page.next_page_token))
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
    let leased = a.list_vms(&VmQuery::default().with_phase(Phase::Leased)).await.unwrap();
    assert_eq!(leased.len(), 2);
    let vm = exact::<Vm>(&a.send(Call::get_vm(&first.vm.id)).await.unwrap());
    assert_eq!((vm.phase, vm.lease_id.as_deref()), (Phase::Leased, Some(first.lease.lease_id.as_str())));
    assert_eq!(vm.network_interfaces, first.vm.network_interfaces);
    api_error(a.delete_vm(&vm.id).await, 400, Status::FailedPrecondition);

    // The last VM, without a request id; the pool is empty then: 429 with Retry-After, at
    // once when not waiting for a VM.
    let last = c.claim_once(&ClaimRequest::new(pool("ci"), None)).await.unwrap();
    assert_eq!(last.lease.request_id, None);
    let no_wait = ClaimOptions::default().with_wait_for_vm(false);
    let e = api_error(c.claim_with(&pool("ci"), &no_wait).await, 429, Status::ResourceExhausted);
    assert_eq!(e.retry_after, Some(Duration::from_secs(1)));
    assert_eq!(e.reason.as_deref(), Some("POOL_EXHAUSTED"));
    assert!(e.request_id.as_deref().is_some_and(|id| !id.is_empty()), "{e:?}");

    // Release, then the events of all this.
    c.release(&first.lease.lease_id).await.unwrap();
    api_error(c.release(&first.lease.lease_id).await, 404, Status::NotFound);
    api_error(c.heartbeat(&first.lease.lease_id).await, 404, Status::NotFound);
    let q = EventQuery::after(0).with_pool(Some(pool("ci"))).with_limit(1000);
    let events = exact::<EventList>(&a.send(Call::events(&q)).await.unwrap());
    assert!(events.events.iter().any(|e| e.kind == "VM_CLAIMED" && e.lease_id == Some(first.lease.lease_id.clone())));
    // A long-poll from the end returns when the next event commits.
    let q = EventQuery::after(events.next_after).with_pool(Some(pool("ci"))).with_limit(10).with_wait_seconds(Some(20));
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
        ("name", spec_with(|s| s.name = "CI".into())),
        ("namespace", spec_with(|s| s.namespace = Some("a_b".into()))),
        ("size", spec_with(|s| s.size = -1)),
        ("size", spec_with(|s| s.size = MAX_POOL_SIZE + 1)),
        ("flintlock_hosts", spec_with(|s| s.flintlock_hosts = vec!["Sim".into()])),
        ("min_size", spec_with(|s| s.replenishment = Replenishment::new(Strategy::MinSizeThreshold))),
        ("min_size", spec_with(|s| s.replenishment = Replenishment::min_size_threshold(2))),
        ("heartbeat_interval_seconds", spec_with(|s| s.heartbeat_interval_seconds = Some(0))),
        (
            "heartbeat_expiry_seconds",
            spec_with(|s| (s.heartbeat_interval_seconds, s.heartbeat_expiry_seconds) = (Some(60), Some(30))),
        ),
        ("microvm_template", spec_with(|s| s.microvm_template = json!("kernel"))),
    ];
    for (field, spec) in bad {
        let local = spec.validate().expect_err(field);
        assert!(local.message().contains(field), "{field}: {local}");
        assert!(matches!(a.create_pool(&spec).await, Err(Error::InvalidInput(_))), "{field}: sent anyway");
        // Sent without the local check, the server refuses it too.
        api_error(a.send(Call::create_pool(&spec)).await, 400, Status::InvalidArgument);
    }
    // And what passes locally, the server takes.
    let mut ok = spec("fine", 1);
    ok.replenishment = Replenishment::min_size_threshold(1);
    (ok.heartbeat_interval_seconds, ok.heartbeat_expiry_seconds) = (Some(5), Some(5));
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
    let opts = ClaimOptions::default()
        .with_request_id("job-7")
        .with_deadline(Duration::from_millis(1500))
        .with_backoff(Backoff { first: Duration::from_millis(50), max: Duration::from_millis(200) })
        .with_on_retry(move |n: &RetryNotice<'_>| seen.lock().unwrap().push(n.request_id.to_owned()));
    let started = Instant::now();
    api_error(c.claim_with(&pool("ci"), &opts).await, 429, Status::ResourceExhausted);
    assert!(started.elapsed() >= Duration::from_millis(1500), "gave up early: {:?}", started.elapsed());
    let ids = ids.lock().unwrap().clone();
    assert!(!ids.is_empty() && ids.iter().all(|i| i == "job-7"), "{ids:?}");
    assert_eq!(lease_count(&s).await, 0);

    // The pool fills while the claim waits: it gets a VM.
    let waiting = tokio::spawn({
        let c = c.clone();
        let opts = opts.clone().with_deadline(Duration::from_secs(60));
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
    let opts = opts.with_deadline(Duration::from_millis(800));
    match client_a(&closed).claim_with(&pool("ci"), &opts).await {
        Err(Error::Transport { kind: TransportKind::Connect, message, .. }) => {
            assert!(message.contains("cannot connect to"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(800));
    // Bad input is refused before anything is sent.
    let long = ClaimOptions::default().with_request_id("r".repeat(256));
    assert!(matches!(client_a(&closed).claim_with(&pool("ci"), &long).await, Err(Error::InvalidInput(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_heartbeats_until_released_and_dropping_it_lets_the_lease_expire() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    let mut short = spec("ci", 3);
    (short.heartbeat_interval_seconds, short.heartbeat_expiry_seconds) = (Some(1), Some(3));
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

// ---------------------------------------------------------------------------------------
// Issue 26: leased runs, private CAs, deadlines and retries, errors a program can act on
// ---------------------------------------------------------------------------------------

/// A server that answers request n with `answers[n]` (the last one repeats) and records each
/// request line; `None` reads the request and never answers.
struct Scripted {
    endpoint: String,
    requests: Arc<Mutex<Vec<String>>>,
}

impl Scripted {
    async fn start(answers: Vec<Option<(u16, &'static str)>>) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (r, mut w) = conn.into_split();
                let Some((line, _)) = read_message(&mut BufReader::new(r)).await else { continue };
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(line);
                    seen.len() - 1
                };
                let answer = answers[n.min(answers.len() - 1)];
                tokio::spawn(async move {
                    let Some((status, body)) = answer else {
                        // Hold the connection open, answer nothing.
                        tokio::time::sleep(Duration::from_secs(600)).await;
                        drop(w);
                        return;
                    };
                    let msg = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = w.write_all(msg.as_bytes()).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        Scripted { endpoint, requests }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

const UNAVAILABLE: (u16, &str) =
    (503, r#"{"error":{"code":503,"status":"UNAVAILABLE","reason":"DATABASE","message":"retry","request_id":"q"}}"#);
const GONE: (u16, &str) =
    (404, r#"{"error":{"code":404,"status":"NOT_FOUND","message":"no lease l-1","request_id":"q"}}"#);
const HEALTHY: (u16, &str) = (200, r#"{"status":"ok"}"#);

fn quick(endpoint: &str) -> Client {
    let fast = RetryPolicy::new(3, Backoff::new(Duration::from_millis(10), Duration::from_millis(20)));
    Client::builder(endpoint).token(CLIENT_A).retry(fast).build().unwrap()
}

#[tokio::test]
async fn safe_calls_are_retried_on_transient_failures_and_other_writes_never_are() {
    // A GET: two 503s, then the answer.
    let s = Scripted::start(vec![Some(UNAVAILABLE), Some(UNAVAILABLE), Some(HEALTHY)]).await;
    assert_eq!(quick(&s.endpoint).health().await.unwrap().status, "ok");
    assert_eq!(s.requests().len(), 3);
    // Bounded: 3 attempts, then the last error.
    let s = Scripted::start(vec![Some(UNAVAILABLE)]).await;
    let e = quick(&s.endpoint).health().await.unwrap_err();
    assert_eq!((e.status(), e.reason()), (Some(&Status::Unavailable), Some("DATABASE")));
    assert_eq!(s.requests().len(), 3);
    // A heartbeat is safe to repeat.
    let s = Scripted::start(vec![Some(UNAVAILABLE), Some(GONE)]).await;
    assert_eq!(quick(&s.endpoint).heartbeat("l-1").await.unwrap_err().status(), Some(&Status::NotFound));
    assert_eq!(s.requests(), ["POST /v1/leases/l-1/heartbeat HTTP/1.1"; 2]);
    // A release: NOT_FOUND after a failed attempt means that attempt released it.
    let s = Scripted::start(vec![Some(UNAVAILABLE), Some(GONE)]).await;
    quick(&s.endpoint).release("l-1").await.unwrap();
    assert_eq!(s.requests(), ["DELETE /v1/leases/l-1 HTTP/1.1"; 2]);
    // ... but NOT_FOUND at once is an unknown lease.
    let s = Scripted::start(vec![Some(GONE)]).await;
    assert_eq!(quick(&s.endpoint).release("l-1").await.unwrap_err().status(), Some(&Status::NotFound));
    // Writes that are not idempotent: one attempt each.
    let s = Scripted::start(vec![Some(UNAVAILABLE)]).await;
    let e = quick(&s.endpoint).create_host(&HostSpec::new("h", "127.0.0.1:1", HostTls::insecure())).await;
    assert_eq!(e.unwrap_err().status(), Some(&Status::Unavailable));
    let e = quick(&s.endpoint).delete_pool(&pool("ci"), false).await;
    assert_eq!(e.unwrap_err().status(), Some(&Status::Unavailable));
    assert_eq!(s.requests(), ["POST /v1/hosts HTTP/1.1", "DELETE /v1/pools/default/ci HTTP/1.1"]);
    // RetryPolicy::none: one attempt even for a GET.
    let s = Scripted::start(vec![Some(UNAVAILABLE), Some(HEALTHY)]).await;
    let once = Client::builder(&s.endpoint).retry(RetryPolicy::none()).build().unwrap();
    assert!(once.health().await.is_err());
    assert_eq!(s.requests().len(), 1);
}

const EXHAUSTED: (u16, &str) = (
    429,
    r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","reason":"NO_AVAILABLE_VM","message":"empty","request_id":"q"}}"#,
);

#[tokio::test]
async fn a_zero_backoff_waits_the_floor_between_claim_attempts_instead_of_spinning() {
    let s = Scripted::start(vec![Some(EXHAUSTED)]).await;
    let c = Client::builder(&s.endpoint).token(CLIENT_A).build().unwrap();
    let opts = ClaimOptions::default()
        .with_backoff(Backoff::new(Duration::ZERO, Duration::ZERO))
        .with_deadline(Duration::from_millis(300));
    let e = c.claim_with(&pool("ci"), &opts).await.unwrap_err();
    assert_eq!(e.status(), Some(&Status::ResourceExhausted));
    // 300 ms at no less than MIN_BACKOFF apart: at most 31 attempts (a spinning loop makes
    // hundreds or thousands).
    let n = s.requests().len();
    let most = (300 / MIN_BACKOFF.as_millis() + 1) as usize;
    assert!(n >= 2 && n <= most, "{n} attempts in 300 ms");
}

#[tokio::test]
async fn a_server_whose_page_tokens_go_round_in_a_circle_is_an_error_not_an_endless_list() {
    use futures_util::StreamExt;
    // A, B, A, B, …: every token is new to the page that gives it, none to the paginator.
    let pages = vec![
        Some((200, r#"{"pools":[],"next_page_token":"A"}"#)),
        Some((200, r#"{"pools":[],"next_page_token":"B"}"#)),
        Some((200, r#"{"pools":[],"next_page_token":"A"}"#)),
        Some((200, r#"{"pools":[],"next_page_token":"B"}"#)),
    ];
    let s = Scripted::start(pages.clone()).await;
    let all = tokio::time::timeout(Duration::from_secs(10), quick(&s.endpoint).list_pools(None)).await;
    let e = all.expect("the paginator stops by itself").unwrap_err();
    assert!(matches!(&e, Error::Decode(m) if m.contains("GET /v1/pools") && m.contains("\"A\"")), "{e:?}");
    let asked = s.requests();
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert!(asked[2].contains("page_token=B"), "{asked:?}");
    // The stream ends with the same error.
    let s = Scripted::start(pages).await;
    let items: Vec<_> = quick(&s.endpoint).pools(None).collect().await;
    assert!(matches!(items.as_slice(), [Err(Error::Decode(m))] if m.contains("GET /v1/pools")), "{items:?}");
}

#[tokio::test]
async fn an_active_lease_for_a_test_is_built_from_a_claim_answer_and_a_fixed_watch() {
    let claim: ClaimResponse = serde_json::from_value(json!({
        "lease": {
            "lease_id": "l-1", "vm_uid": "u-1", "pool": {"namespace": "default", "name": "ci"},
            "claimed_at": "2025-01-01T00:00:00Z", "last_heartbeat_at": "2025-01-01T00:00:00Z",
            "expires_at": "2025-01-01T00:02:00Z", "request_id": "r-1"
        },
        "vm": {"id": "vm-1", "uid": "u-1", "flintlock_host": {"name": "sim", "address": "127.0.0.1:1"},
               "network_interfaces": {}},
        "replayed": false
    }))
    .unwrap();
    let active = ActiveLease::new(claim.clone(), LeaseWatch::alive(claim.lease.clone()));
    assert_eq!((active.lease().lease_id.as_str(), active.vm().id.as_str()), ("l-1", "vm-1"));
    assert!(matches!(active.watch.state(), LeaseState::Alive { lease, .. } if lease == claim.lease));
    assert!(active.watch.lost_now().is_none());
    let mut w = active.watch.clone();
    assert!(w.next_change().await.is_none(), "nothing beats behind it");
    assert!(tokio::time::timeout(Duration::from_millis(50), w.lost()).await.is_err(), "never lost");

    let gone = Error::Api(ApiError::new(404, Status::NotFound, "no lease l-1"));
    let mut w = LeaseWatch::lost_with(gone);
    assert_eq!(w.lost().await.status(), Some(&Status::NotFound));
    assert!(w.lost_now().is_some());
}

#[tokio::test]
async fn a_claims_deadline_cuts_the_attempt_in_flight_and_names_the_id_that_recovers_it() {
    let s = Scripted::start(vec![None]).await;
    // The client's own time-out is 30 s: only the deadline can end this attempt early.
    let c = Client::builder(&s.endpoint).timeout(Duration::from_secs(30)).build().unwrap();
    let opts = ClaimOptions::default().with_request_id("job-cut").with_deadline(Duration::from_millis(1500));
    let started = Instant::now();
    let e = c.claim_with(&pool("ci"), &opts).await.unwrap_err();
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(1400) && took < Duration::from_secs(5), "{took:?}");
    assert!(matches!(e, Error::Transport { kind: TransportKind::Timeout, .. }), "{e:?}");
    assert!(e.outcome_unknown());
    assert!(e.to_string().contains("request_id job-cut"), "{e}");
    assert_eq!(s.requests(), ["POST /v1/claims HTTP/1.1"], "one attempt, cut at the deadline");
}

#[tokio::test]
async fn a_transport_error_keeps_the_http_librarys_error_as_its_source() {
    let closed = format!("http://127.0.0.1:{}", poolmgr_tests::unused_port());
    let e = quick(&closed).health().await.unwrap_err();
    assert!(matches!(e, Error::Transport { kind: TransportKind::Connect, .. }), "{e:?}");
    let src = std::error::Error::source(&e).expect("the cause is kept");
    let http = src.downcast_ref::<reqwest::Error>().expect("it is the HTTP library's error");
    assert!(http.is_connect(), "{http:?}");
    // Its own chain goes down to the operating system's refusal.
    let mut cur: &dyn std::error::Error = src;
    let mut io = None;
    while let Some(next) = cur.source() {
        if let Some(e) = next.downcast_ref::<std::io::Error>() {
            io = Some(e.kind());
        }
        cur = next;
    }
    assert_eq!(io, Some(std::io::ErrorKind::ConnectionRefused));
    // Clone keeps it.
    assert!(std::error::Error::source(&e.clone()).is_some());
}

// Needs a TLS backend: without one the client refuses https:// endpoints.
#[cfg(any(feature = "rustls-native-roots", feature = "rustls-webpki-roots", feature = "native-tls"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_endpoint_signed_by_a_private_ca_needs_that_ca() {
    let s = LocalServer::start().await;
    let front = poolmgr_tests::https::HttpsFront::start(&s.endpoint).await;
    let dir = std::env::temp_dir().join(format!("poolmgr-client-ca-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &front.ca_pem).unwrap();

    // Without the CA: the certificate is refused, and the error says so through its chain.
    let e = quick(&front.endpoint).health().await.unwrap_err();
    assert!(matches!(e, Error::Transport { kind: TransportKind::Connect, .. }), "{e:?}");
    let mut chain = e.to_string();
    let mut cur = std::error::Error::source(&e);
    while let Some(c) = cur {
        chain.push_str(&format!(" / {c}"));
        cur = c.source();
    }
    assert!(chain.to_lowercase().contains("certificate"), "{chain}");

    // With it, from a file or as PEM text, by name or by address.
    let with_file = Client::builder(&front.endpoint).ca_file(&ca_file).token(ADMIN).build().unwrap();
    assert_eq!(with_file.health().await.unwrap().status, "ok");
    assert!(with_file.list_pools(None).await.unwrap().is_empty());
    let by_ip = format!("https://127.0.0.1:{}", front.addr.port());
    let with_pem = Client::builder(&by_ip).add_root_certificate(&front.ca_pem).build().unwrap();
    assert_eq!(with_pem.health().await.unwrap().status, "ok");

    // A CA file that is missing or holds no certificate is refused when the client is built.
    let e = Client::builder(&front.endpoint).ca_file(dir.join("missing.pem")).build().unwrap_err();
    assert!(matches!(&e, Error::InvalidInput(m) if m.contains("missing.pem")), "{e:?}");
    std::fs::write(dir.join("junk.pem"), "not a certificate").unwrap();
    let e = Client::builder(&front.endpoint).ca_file(dir.join("junk.pem")).build().unwrap_err();
    assert!(matches!(&e, Error::InvalidInput(m) if m.contains("junk.pem")), "{e:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_of_every_list_is_followed_by_the_paginators() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    for name in ["p1", "p2", "p3"] {
        a.create_pool(&spec(name, if name == "p1" { 3 } else { 0 })).await.unwrap();
    }
    wait_available(&a, &pool("p1"), 3).await;
    let c = client_a(&s.endpoint);
    let mut claimed = Vec::new();
    for _ in 0..3 {
        claimed.push(c.claim(&pool("p1")).await.unwrap().lease.lease_id);
    }
    claimed.sort();

    // Pages of one: three pages, each asked with the token the last gave.
    let mut pages = a.pages::<PoolList>(Call::list_pools(None).with_query("page_size", 1));
    let mut names = Vec::new();
    while let Some(p) = pages.next_page().await.unwrap() {
        assert_eq!(p.pools.len(), 1);
        names.push(p.pools[0].spec.name.clone());
    }
    assert_eq!(names, ["p1", "p2", "p3"]);
    // The streams and the Vec forms read every page too.
    use futures_util::TryStreamExt;
    let pools: Vec<Pool> = a.pools(None).try_collect().await.unwrap();
    assert_eq!(pools.len(), 3);
    let by_one = LeaseQuery::default().with_page_size(1);
    let leases: Vec<String> = c.list_leases_all(&by_one).await.unwrap().into_iter().map(|l| l.lease_id).collect();
    assert_eq!(leases, claimed, "ordered by lease_id, every page");
    let streamed: Vec<Lease> = c.leases(&by_one).try_collect().await.unwrap();
    assert_eq!(streamed.len(), 3);
    let vms: Vec<Vm> = a.vms(&VmQuery::pool(&pool("p1"))).try_collect().await.unwrap();
    assert_eq!(vms.len(), 3);
    let hosts: Vec<Host> = a.hosts().try_collect().await.unwrap();
    assert_eq!(hosts.len(), 1);
    // A stream ends after its first error.
    let denied: Vec<Result<Pool, Error>> = c.pools(None).collect_all().await;
    assert_eq!(denied.len(), 1);
    assert_eq!(denied[0].as_ref().unwrap_err().status(), Some(&Status::PermissionDenied));

    // The event feed: the cursor moves past what it returned, and following waits for more.
    let mut feed = a.event_feed::<Event>(EventQuery::after(0).with_pool(Some(pool("p1"))));
    let first = feed.next_batch().await.unwrap();
    assert!(first.iter().filter(|e| e.kind == "VM_CLAIMED").count() == 3, "{first:?}");
    assert_eq!(feed.cursor(), first.last().unwrap().id);
    let cursor = feed.cursor();
    let mut follow = Box::pin(feed.follow(Backoff::default()));
    c.release(&claimed[0]).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(25), follow.try_next()).await.unwrap().unwrap().unwrap();
    assert!(next.id > cursor, "{next:?}");
    assert_eq!(next.lease_id.as_deref(), Some(claimed[0].as_str()));
}

/// Collects a stream of results, errors included.
trait CollectAll<T> {
    async fn collect_all(self) -> Vec<T>;
}

impl<T, S: futures_util::Stream<Item = T>> CollectAll<T> for S {
    async fn collect_all(self) -> Vec<T> {
        use futures_util::StreamExt;
        self.collect().await
    }
}

/// Waits until `pool` has no lease (at most `within`).
async fn no_lease_within(s: &LocalServer, within: Duration, why: &str) {
    let deadline = Instant::now() + within;
    while lease_count(s).await != 0 {
        assert!(Instant::now() < deadline, "{why}: a lease is left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_run_heartbeats_while_the_job_runs_and_releases_whatever_happens() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    // A short expiry: the job outlives three expiry windows, so only heartbeats keep it.
    let mut short = spec("short", 1);
    (short.heartbeat_interval_seconds, short.heartbeat_expiry_seconds) = (Some(1), Some(2));
    a.create_pool(&short).await.unwrap();
    // The default expiry (120 s): a lease gone within seconds was released, not expired.
    a.create_pool(&spec("long", 3)).await.unwrap();
    wait_available(&a, &pool("short"), 1).await;
    wait_available(&a, &pool("long"), 3).await;
    let c = client_a(&s.endpoint);
    let opts = ClaimOptions::default().with_deadline(Duration::from_secs(30));

    // The job returns: its output comes back, the lease lived through it and is gone after.
    let run = c
        .run_leased(&pool("short"), &opts, |lease| {
            let c = c.clone();
            async move {
                tokio::time::sleep(Duration::from_secs(6)).await;
                let now = c.get_lease(&lease.lease().lease_id).await.expect("alive after 3 expiry windows");
                assert!(now.last_heartbeat_at > lease.lease().claimed_at);
                assert!(lease.watch.lost_now().is_none());
                (lease.lease().lease_id.clone(), lease.vm().id.clone())
            }
        })
        .await
        .unwrap();
    let (lease_id, vm_id) = run.output.clone();
    assert_eq!((lease_id.as_str(), vm_id.as_str()), (run.claim.lease.lease_id.as_str(), run.claim.vm.id.as_str()));
    assert!(run.lost.is_none() && run.release.is_ok(), "{run:?}");
    api_error(c.get_lease(&lease_id).await, 404, Status::NotFound);
    assert_eq!(lease_count(&s).await, 0);

    // The job fails (an error value): released all the same.
    let run = c.run_leased(&pool("long"), &opts, |_| async { Err::<(), _>("job failed") }).await.unwrap();
    assert_eq!(run.output, Err("job failed"));
    run.release.unwrap();
    assert_eq!(lease_count(&s).await, 0);

    // The job panics: released, then the panic goes on.
    let panicked = tokio::spawn({
        let c = c.clone();
        let opts = opts.clone();
        async move { c.run_leased(&pool("long"), &opts, |_| async { panic!("job panicked") }).await.map(|r| r.output) }
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    no_lease_within(&s, Duration::from_secs(10), "after a panic").await;

    // The run is dropped midway (its task aborted): the release is spawned.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn({
        let c = c.clone();
        let opts = opts.clone();
        async move {
            c.run_leased(&pool("long"), &opts, |lease| async move {
                let _ = started_tx.send(lease.lease().lease_id.clone());
                std::future::pending::<()>().await
            })
            .await
        }
    });
    let dropped = started_rx.await.unwrap();
    assert_eq!(lease_count(&s).await, 1);
    task.abort();
    no_lease_within(&s, Duration::from_secs(10), "after the run was dropped").await;
    api_error(c.get_lease(&dropped).await, 404, Status::NotFound);

    // The lease is lost while the job runs (released elsewhere): the job can notice, and the
    // run reports it.
    let run = c
        .run_leased(&pool("long"), &opts, |mut lease| {
            let a = a.clone();
            async move {
                a.release(&lease.lease().lease_id).await.unwrap();
                tokio::time::timeout(Duration::from_secs(120), lease.watch.lost()).await.expect("the loss is noticed")
            }
        })
        .await
        .unwrap();
    assert_eq!(run.output.status(), Some(&Status::NotFound));
    assert_eq!(run.lost.as_ref().and_then(Error::status), Some(&Status::NotFound));
    run.release.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_that_releases_on_drop_releases_and_a_plain_one_does_not() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 2)).await.unwrap();
    wait_available(&a, &pool("ci"), 2).await;
    let c = client_a(&s.endpoint);

    let kept = c.claim(&pool("ci")).await.unwrap().lease;
    drop(c.keep_alive(&kept));
    let released = c.claim(&pool("ci")).await.unwrap().lease;
    drop(c.keep_alive(&released).release_on_drop());
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.get_lease(&released.lease_id).await.is_ok() {
        assert!(Instant::now() < deadline, "the dropped guard did not release its lease");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The plain guard's lease is still there (it expires in 120 s).
    assert_eq!(c.get_lease(&kept.lease_id).await.unwrap().lease_id, kept.lease_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_pre_lease_hook_is_retried_with_the_same_id_only_when_asked() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    let mut hooked = spec("hooked", 2);
    hooked.pre_lease_commands = vec!["reset-state".into()];
    hooked.hook_failure_policy = Some(HookFailurePolicy::DeleteAndReplace);
    a.create_pool(&hooked).await.unwrap();
    wait_available(&a, &pool("hooked"), 2).await;
    let c = client_a(&s.endpoint);
    s.sim.set_exec_exit_code("reset-state", 1);

    // Off by default: the hook's failure is the answer, with its reason.
    let retries = Arc::new(AtomicUsize::new(0));
    let counted = retries.clone();
    let opts = ClaimOptions::default()
        .with_request_id("hook-job")
        .with_deadline(Duration::from_secs(30))
        .with_on_retry(move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
    let e = api_error(c.claim_with(&pool("hooked"), &opts).await, 500, Status::Internal);
    assert_eq!(e.reason.as_deref(), Some(REASON_HOOK_FAILED));
    assert!(e.is_hook_failure());
    assert_eq!(retries.load(Ordering::SeqCst), 0);
    assert_eq!(lease_count(&s).await, 0);
    wait_available(&a, &pool("hooked"), 2).await;

    // Asked for: the hook is fixed before the retry, which claims with the same id.
    let sim = s.sim.clone();
    let ids = Arc::new(Mutex::new(Vec::new()));
    let seen = ids.clone();
    let opts = opts.with_retry_hook_failure(true).with_on_retry(move |n| {
        seen.lock().unwrap().push((n.request_id.to_owned(), n.error.reason().map(str::to_owned)));
        sim.clear_exec_rules();
    });
    let got = c.claim_with(&pool("hooked"), &opts).await.unwrap();
    assert_eq!(got.attempts, 2);
    assert_eq!(*ids.lock().unwrap(), [("hook-job".to_owned(), Some("HOOK_FAILED".to_owned()))]);
    assert_eq!(got.response.lease.request_id.as_deref(), Some("hook-job"));
    assert!(!got.response.replayed, "the failed attempt had left no lease: the retry is a fresh claim");
    assert_eq!(lease_count(&s).await, 1);
}

// ---------------------------------------------------------------------------------------
// Keep-alive review: refused heartbeats, expiry, replayed claims, a release cut short
// ---------------------------------------------------------------------------------------

/// Whether `line` is a heartbeat's request line.
fn is_heartbeat(line: &str) -> bool {
    line.starts_with("POST /v1/leases/") && line.contains("/heartbeat ")
}

const THROTTLED: (u16, &str) = (
    429,
    r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","reason":"RESOURCE_EXHAUSTED","message":"slow down","request_id":"q"}}"#,
);
const ROTATED: (u16, &str) = (
    401,
    r#"{"error":{"code":401,"status":"UNAUTHENTICATED","reason":"TOKEN_MISSING_OR_UNKNOWN","message":"unknown token","request_id":"q"}}"#,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_rides_out_refused_heartbeats_and_reports_an_expiry_it_could_not_prevent() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    let mut short = spec("ci", 1);
    (short.heartbeat_interval_seconds, short.heartbeat_expiry_seconds) = (Some(1), Some(3));
    a.create_pool(&short).await.unwrap();
    wait_available(&a, &pool("ci"), 1).await;

    // Heartbeats: 0 pass, 1 refused in turn (429, a proxy's bare 500, 401), 2 never answered.
    let mode = Arc::new(AtomicUsize::new(1));
    let (seen, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let rule: Rule = {
        let (mode, seen, refused) = (mode.clone(), seen.clone(), refused.clone());
        Arc::new(move |line: &str| {
            if !is_heartbeat(line) {
                return Fault::Pass;
            }
            let n = seen.fetch_add(1, Ordering::SeqCst);
            match mode.load(Ordering::SeqCst) {
                1 => {
                    let fault = [
                        Fault::Answer(THROTTLED.0, THROTTLED.1),
                        Fault::Answer(500, "proxy error"),
                        Fault::Answer(ROTATED.0, ROTATED.1),
                        Fault::Pass,
                    ][n % 4];
                    if fault != Fault::Pass {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                    fault
                }
                2 => Fault::Hold,
                _ => Fault::Pass,
            }
        })
    };
    let proxy = Proxy::with_rule(&s.endpoint, rule).await;
    let c = client_a(&proxy.endpoint());
    let lease = c.claim(&pool("ci")).await.unwrap().lease;
    let mut guard = c.keep_alive(&lease);
    let mut watch = guard.watch();

    // Three of every four heartbeats refused, none of those ends the lease: it lives through
    // several expiry windows, and the failures are visible while they last.
    let until = Instant::now() + Duration::from_secs(40);
    let mut saw_failure = None;
    while guard.heartbeats() < 4 {
        assert!(Instant::now() < until, "too few heartbeats: {:?}", guard.state());
        if let Ok(Some(LeaseState::Alive { failures, last_error: Some(e), .. })) =
            tokio::time::timeout(Duration::from_millis(200), watch.next_change()).await
        {
            assert!(failures > 0);
            saw_failure = Some(e);
        }
    }
    assert!(refused.load(Ordering::SeqCst) >= 9, "{} refused", refused.load(Ordering::SeqCst));
    assert!(saw_failure.is_some());
    assert!(matches!(guard.state(), LeaseState::Alive { .. }), "{:?}", guard.state());
    assert_eq!(c.get_lease(&lease.lease_id).await.unwrap().lease_id, lease.lease_id);

    // Heartbeats that are never answered (the client's time-out is 30 s): the lease is lost
    // at its expires_at, not minutes later.
    mode.store(2, Ordering::SeqCst);
    let started = Instant::now();
    let why = tokio::time::timeout(Duration::from_secs(15), guard.lost()).await.expect("the expiry is noticed");
    assert!(started.elapsed() < Duration::from_secs(6), "{:?}", started.elapsed());
    match &why {
        Error::LeaseExpired { lease_id, .. } => assert_eq!(lease_id, &lease.lease_id),
        other => panic!("expected LeaseExpired, got {other:?}"),
    }
    // Released afterwards: gone already (NOT_FOUND) or released, never an error.
    mode.store(0, Ordering::SeqCst);
    guard.release(Duration::from_secs(10)).await.unwrap();
    no_lease_within(&s, Duration::from_secs(10), "after the expiry").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_claim_with_little_time_left_is_heartbeated_before_it_expires() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    let mut long = spec("ci", 1);
    (long.heartbeat_interval_seconds, long.heartbeat_expiry_seconds) = (Some(20), Some(60));
    a.create_pool(&long).await.unwrap();
    wait_available(&a, &pool("ci"), 1).await;
    let c = client_a(&s.endpoint);
    let opts = ClaimOptions::default().with_request_id("replayed-late");
    let first = c.claim_with(&pool("ci"), &opts).await.unwrap().response.lease;
    // The lease has been alive 57 s of its 60 s window: 3 s left.
    let db = s.db.client().await;
    db.execute(
        "UPDATE leases SET last_heartbeat_at = now() - interval '57 seconds', expires_at = now() + interval '3 seconds' \
         WHERE lease_id::text = $1",
        &[&first.lease_id],
    )
    .await
    .unwrap();
    let replay = c.claim_with(&pool("ci"), &opts).await.unwrap().response;
    assert!(replay.replayed);
    assert_eq!(replay.lease.expiry_window(), Duration::from_secs(60));
    let guard = c.keep_alive(&replay.lease);
    // The first beat comes when a third of those 3 s is left, not 20 s from now.
    let until = Instant::now() + Duration::from_secs(10);
    while guard.heartbeats() < 1 {
        assert!(Instant::now() < until, "no heartbeat before the replayed lease expired: {:?}", guard.state());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let now = c.get_lease(&first.lease_id).await.unwrap();
    assert!(now.expires_at > chrono::Utc::now() + chrono::Duration::seconds(30), "{now:?}");
    guard.release(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_run_dropped_while_it_releases_still_releases() {
    let s = LocalServer::start().await;
    register_sim(&s).await;
    let a = admin(&s);
    a.create_pool(&spec("ci", 1)).await.unwrap();
    wait_available(&a, &pool("ci"), 1).await;
    // The run's release is held (never forwarded, never answered); later ones pass.
    let held = Arc::new(AtomicUsize::new(0));
    let rule: Rule = {
        let held = held.clone();
        Arc::new(move |line: &str| {
            let release = line.starts_with("DELETE /v1/leases/");
            if release && held.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n == 0).then_some(1)).is_ok() {
                Fault::Hold
            } else {
                Fault::Pass
            }
        })
    };
    let proxy = Proxy::with_rule(&s.endpoint, rule).await;
    let c = client_a(&proxy.endpoint());
    let task = tokio::spawn(async move { c.run_leased(&pool("ci"), &ClaimOptions::default(), |_| async {}).await });
    let until = Instant::now() + Duration::from_secs(30);
    while held.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < until, "the run never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(lease_count(&s).await, 1, "the held release never reached the server");
    // Dropped in the middle of its release: the release is handed to the runtime.
    task.abort();
    no_lease_within(&s, Duration::from_secs(10), "after the run was dropped while releasing").await;
}
