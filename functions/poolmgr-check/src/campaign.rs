//! The client load of a fault campaign (`scripts/chaos.sh --campaign`, issue 23): clients
//! that claim with request_ids, replay, heartbeat and release through several poolmgr-local
//! endpoints (a retry goes to the next one, as behind a load balancer), retrying the way
//! `poolmgr-client` does, and record every attempt in a [`crate::history`].
//!
//! Each client, until the load's time is up: claims a fresh request_id, retrying the *same*
//! id on every failure or unknown outcome until a lease comes back; replays it once (the same
//! lease must come back); heartbeats it a few times; releases it, retrying until 204 (or 404
//! after an attempt whose answer was lost). Once the campaign healed the network (`heal_file`
//! exists) a client still retrying gives up after `give_up`, which the checker then reports
//! as an unresolved outcome. Each fresh lease's VM is looked up on its flintlock host right
//! after the answer (a `verify` op): a VM the host does not have is a dead VM handed out.
//! Never injects a fault itself.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::history::{Kind, Op, Outcome};

/// What the load needs.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Base URLs of the poolmgr-local processes (`http://10.77.0.21:8080`).
    pub endpoints: Vec<String>,
    pub token: String,
    /// `namespace/name` of each pool the clients claim from (client i uses pool i mod n).
    pub pools: Vec<(String, String)>,
    pub clients: usize,
    /// New claims start for this long.
    pub duration: Duration,
    /// Exists once the campaign's faults are healed.
    pub heal_file: Option<PathBuf>,
    /// After the heal, an operation still failing this long is given up.
    pub give_up: Duration,
    /// Each attempt's own timeout (then: an unknown outcome).
    pub request_timeout: Duration,
    /// Heartbeats per lease, one a second.
    pub heartbeats: usize,
}

struct Recorder {
    t0: Instant,
    ops: Mutex<Vec<Op>>,
}

impl Recorder {
    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }
}

struct Client {
    idx: usize,
    http: reqwest::Client,
    opts: Arc<LoadOptions>,
    rec: Arc<Recorder>,
    next_endpoint: usize,
    healed_at: Option<Instant>,
    flintlock: poolmgr_core::flintlock::Flintlock,
}

/// One attempt's answer: outcome, status, body.
struct Answer {
    outcome: Outcome,
    status: Option<u16>,
    body: Value,
}

impl Client {
    fn endpoint(&mut self) -> String {
        let e = self.opts.endpoints[self.next_endpoint % self.opts.endpoints.len()].clone();
        self.next_endpoint += 1;
        e
    }

    /// Whether an operation that keeps failing should go on: always before the heal, for
    /// `give_up` after it.
    fn may_retry(&mut self) -> bool {
        if self.healed_at.is_none() && self.opts.heal_file.as_ref().is_some_and(|f| f.exists()) {
            self.healed_at = Some(Instant::now());
        }
        match (&self.opts.heal_file, self.healed_at) {
            (None, _) => self.rec.t0.elapsed() < self.opts.duration + self.opts.give_up,
            (Some(_), None) => self.rec.t0.elapsed() < self.opts.duration + Duration::from_secs(900),
            (Some(_), Some(h)) => h.elapsed() < self.opts.give_up,
        }
    }

    async fn send(&mut self, method: reqwest::Method, path: &str, body: Option<&Value>) -> (String, Answer) {
        let endpoint = self.endpoint();
        let mut req = self
            .http
            .request(method, format!("{endpoint}{path}"))
            .bearer_auth(&self.opts.token)
            .timeout(self.opts.request_timeout);
        if let Some(b) = body {
            req = req.json(b);
        }
        let answer = match req.send().await {
            Err(e) => {
                // Refused before it was sent: it did not happen. Anything else may have.
                let outcome = if e.is_connect() { Outcome::Failed } else { Outcome::Unknown };
                Answer { outcome, status: None, body: json!(e.to_string()) }
            }
            Ok(resp) => {
                let status = resp.status().as_u16();
                match resp.bytes().await {
                    Err(e) => Answer { outcome: Outcome::Unknown, status: Some(status), body: json!(e.to_string()) },
                    Ok(b) => {
                        let body =
                            if b.is_empty() { Value::Null } else { serde_json::from_slice(&b).unwrap_or(Value::Null) };
                        let outcome = if (200..300).contains(&status) { Outcome::Ok } else { Outcome::Failed };
                        Answer { outcome, status: Some(status), body }
                    }
                }
            }
        };
        (endpoint, answer)
    }

    fn record(&self, op: Op) {
        self.rec.ops.lock().expect("history").push(op);
    }

    /// One claim attempt of `rid`.
    async fn claim_once(&mut self, rid: &str, pool: &(String, String)) -> Option<(String, Value)> {
        let body = json!({"pool": {"namespace": pool.0, "name": pool.1}, "request_id": rid});
        let invoked = self.rec.now();
        let (endpoint, a) = self.send(reqwest::Method::POST, "/v1/claims", Some(&body)).await;
        let lease = a.body["lease"]["lease_id"].as_str().map(str::to_owned);
        let op = Op {
            client: self.idx,
            kind: Kind::Claim,
            request_id: Some(rid.to_owned()),
            lease_id: if a.outcome == Outcome::Ok { lease.clone() } else { None },
            vm_id: if a.outcome == Outcome::Ok { a.body["vm"]["id"].as_str().map(str::to_owned) } else { None },
            invoked,
            completed: self.rec.now(),
            outcome: a.outcome,
            status: a.status,
            replayed: a.body["replayed"].as_bool().unwrap_or(false),
            endpoint,
        };
        self.record(op);
        if a.outcome == Outcome::Ok { lease.map(|l| (l, a.body)) } else { None }
    }

    /// Asks the claimed VM's host for it (issue 23 finding 1: a dead VM handed out), and
    /// records the answer: 200 it exists, 404 flintlock does not have it (or is deleting it),
    /// unknown when the host could not be asked.
    async fn verify(&mut self, lease: &str, answer: &Value) {
        let vm = &answer["vm"];
        let (Some(id), Some(uid), Some(host), Some(addr)) = (
            vm["id"].as_str(),
            vm["uid"].as_str(),
            vm["flintlock_host"]["name"].as_str(),
            vm["flintlock_host"]["address"].as_str(),
        ) else {
            return;
        };
        let endpoint = poolmgr_core::flintlock::Endpoint {
            name: host.to_owned(),
            address: addr.to_owned(),
            tls_insecure: true,
            ca_pem: None,
            cert_pem: None,
            key_pem: None,
            basic_auth_token: None,
            credentials_key_id: None,
            credentials_dek: None,
        };
        let invoked = self.rec.now();
        let got = self.flintlock.get(&endpoint, uid).await;
        let deleting = flintlock_proto::types::micro_vm_status::MicroVmState::Deleting as i32;
        let (outcome, status) = match got {
            Ok(Some(m)) if m.status.as_ref().is_none_or(|s| s.state != deleting) => (Outcome::Ok, Some(200)),
            Ok(_) => (Outcome::Failed, Some(404)),
            Err(_) => (Outcome::Unknown, None),
        };
        self.record(Op {
            client: self.idx,
            kind: Kind::Verify,
            request_id: None,
            lease_id: Some(lease.to_owned()),
            vm_id: Some(id.to_owned()),
            invoked,
            completed: self.rec.now(),
            outcome,
            status,
            replayed: false,
            endpoint: addr.to_owned(),
        });
    }

    /// One heartbeat or release attempt on `lease`; its status.
    async fn on_lease(&mut self, kind: Kind, lease: &str) -> (Outcome, Option<u16>) {
        let (method, path) = match kind {
            Kind::Heartbeat => (reqwest::Method::POST, format!("/v1/leases/{lease}/heartbeat")),
            _ => (reqwest::Method::DELETE, format!("/v1/leases/{lease}")),
        };
        let invoked = self.rec.now();
        let (endpoint, a) = self.send(method, &path, None).await;
        self.record(Op {
            client: self.idx,
            kind,
            request_id: None,
            lease_id: Some(lease.to_owned()),
            vm_id: None,
            invoked,
            completed: self.rec.now(),
            outcome: a.outcome,
            status: a.status,
            replayed: false,
            endpoint,
        });
        (a.outcome, a.status)
    }

    async fn pause(attempt: u32) {
        let ms = (100u64 << attempt.min(4)).min(1000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    async fn run(mut self) {
        let pool = self.opts.pools[self.idx % self.opts.pools.len()].clone();
        let mut k = 0;
        while self.rec.t0.elapsed() < self.opts.duration {
            let rid = format!("campaign-c{}-{k}", self.idx);
            k += 1;
            let mut attempt = 0;
            let lease = loop {
                if let Some(l) = self.claim_once(&rid, &pool).await {
                    break Some(l);
                }
                if !self.may_retry() {
                    break None;
                }
                Self::pause(attempt).await;
                attempt += 1;
            };
            let Some((lease, answer)) = lease else { return };
            self.verify(&lease, &answer).await;
            // The answer was seen: one replay, which must name the same lease.
            self.claim_once(&rid, &pool).await;
            for _ in 0..self.opts.heartbeats {
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.on_lease(Kind::Heartbeat, &lease).await;
            }
            let mut attempt = 0;
            loop {
                let (outcome, status) = self.on_lease(Kind::Release, &lease).await;
                if outcome == Outcome::Ok || status == Some(404) || !self.may_retry() {
                    break;
                }
                Self::pause(attempt).await;
                attempt += 1;
            }
        }
    }
}

/// Runs the load; returns the history (every attempt, in completion order).
pub async fn run_load(opts: LoadOptions) -> anyhow::Result<Vec<Op>> {
    anyhow::ensure!(!opts.endpoints.is_empty() && !opts.pools.is_empty(), "endpoints and pools are required");
    let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(2)).pool_max_idle_per_host(0).build()?;
    let rec = Arc::new(Recorder { t0: Instant::now(), ops: Mutex::default() });
    let opts = Arc::new(opts);
    let flintlock = poolmgr_core::flintlock::Flintlock::new(Duration::from_secs(2));
    let clients = (0..opts.clients).map(|idx| {
        let c = Client {
            idx,
            http: http.clone(),
            opts: opts.clone(),
            rec: rec.clone(),
            next_endpoint: idx,
            healed_at: None,
            flintlock: flintlock.clone(),
        };
        tokio::spawn(c.run())
    });
    for c in futures::future::join_all(clients).await {
        c?;
    }
    let ops = std::mem::take(&mut *rec.ops.lock().expect("history"));
    Ok(ops)
}
