//! Talking to a running poolmgr for the demand benchmark: creating the pools, replaying a
//! trace's claims in scaled time (clients that hold each VM for its job's duration and retry
//! as `poolmgr-client` does), sending hints, polling the pools' status and reading their
//! events afterwards.
//!
//! Time: a trace second is `1/k` real seconds from the replay's start. Every wait a client
//! makes is scaled the same way: the backoff (`poolmgr_client::Backoff`'s 250 ms doubling to
//! 5 s, jittered), the server's `Retry-After` and the claim deadline (60 s) are divided by k.
//! Records keep real seconds since the replay's start; [`super::metrics`] scales them back.
//! Never asserts a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use poolmgr_client::Backoff;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::trace::Trace;

/// The claim deadline of `poolmgr-client` (`ClaimOptions::default().deadline`), unscaled.
pub const CLAIM_DEADLINE_S: f64 = 60.0;

/// One poolmgr endpoint with the benchmark's tokens.
pub struct Api {
    http: reqwest::Client,
    base: String,
    admin: String,
    client: String,
    /// The retry budget: when the next retry of any claim on this stack may go out.
    next_retry: Mutex<Instant>,
    /// Real time between two retries of the stack's claims (0: no budget).
    retry_gap: Duration,
}

/// What one claim attempt got.
enum Attempt {
    Ok {
        lease_id: String,
        vm_id: String,
        replayed: bool,
    },
    /// Worth another attempt with the same request_id (429, 503, 409 ABORTED, no answer: 0).
    Retry {
        status: u16,
        retry_after: Option<f64>,
    },
    Fail(String),
}

/// A pool's status at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Real seconds since the replay's start.
    pub t: f64,
    pub available: i64,
    pub claiming: i64,
    pub leased: i64,
    pub provisioning: i64,
    pub quarantined: i64,
    pub deleting: i64,
    pub desired: Option<i64>,
}

impl Sample {
    /// Every VM the autoscaling ceiling counts (all but DELETING ones, which are on their way out).
    pub fn total(&self) -> i64 {
        self.available + self.claiming + self.leased + self.provisioning + self.quarantined
    }

    /// The pool's idle part: AVAILABLE and on their way to it.
    pub fn warm(&self) -> i64 {
        self.available + self.provisioning
    }
}

/// An event of the feed, its time in real seconds since the replay's start.
#[derive(Debug, Clone)]
pub struct Event {
    pub kind: String,
    pub vm_id: Option<String>,
    pub t: f64,
    pub payload: Value,
}

impl Api {
    pub fn new(base: &str, admin: &str, client: &str) -> anyhow::Result<Api> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        Ok(Api {
            http,
            base: base.trim_end_matches('/').to_owned(),
            admin: admin.to_owned(),
            client: client.to_owned(),
            next_retry: Mutex::new(Instant::now()),
            retry_gap: Duration::ZERO,
        })
    }

    /// At most `per_second` retries of claims per second of wall clock on this stack: a
    /// retry's wait is scaled by k, the server's cost is not, so without a budget a burst's
    /// waiting clients would load the stack k times as much as they would unscaled.
    pub fn with_retry_budget(mut self, per_second: f64) -> Api {
        self.retry_gap = if per_second > 0.0 { Duration::from_secs_f64(1.0 / per_second) } else { Duration::ZERO };
        self
    }

    /// Waits for the retry budget's next slot, no earlier than `earliest`.
    async fn retry_slot(&self, earliest: Instant) {
        let slot = {
            let mut next = self.next_retry.lock().unwrap();
            let slot = (*next).max(earliest);
            *next = slot + self.retry_gap;
            slot
        };
        tokio::time::sleep_until(slot.into()).await;
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// Creates the pool `spec` (PUT when it exists: a rerun on the same database).
    pub async fn put_pool(&self, spec: &Value) -> anyhow::Result<()> {
        let resp = self.http.post(format!("{}/v1/pools", self.base)).bearer_auth(&self.admin).json(spec).send().await?;
        let status = resp.status();
        if status.as_u16() == 409 {
            let (ns, name) = (spec["namespace"].as_str().unwrap_or(""), spec["name"].as_str().unwrap_or(""));
            let resp = self
                .http
                .put(format!("{}/v1/pools/{ns}/{name}", self.base))
                .bearer_auth(&self.admin)
                .json(spec)
                .send()
                .await?;
            if !resp.status().is_success() {
                let s = resp.status();
                bail!("PUT pool {ns}/{name} answered {s}: {}", resp.text().await.unwrap_or_default());
            }
            return Ok(());
        }
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            if body.contains("autoscaling") {
                bail!(
                    "creating pool {} answered {status}: {body}\n(this poolmgr does not know the autoscaling block yet: \
                     run the static policies only, --policies static-peak,static-mean)",
                    spec["name"]
                );
            }
            bail!("creating pool {} answered {status}: {body}", spec["name"]);
        }
        Ok(())
    }

    /// Every pool of `namespace` with its status, by name.
    pub async fn pools(&self, namespace: &str) -> anyhow::Result<HashMap<String, Value>> {
        // Not paginated (whatever the contract says): every pool of the namespace at once.
        let url = format!("{}/v1/pools?namespace={namespace}", self.base);
        let resp = self.http.get(url).bearer_auth(&self.admin).send().await?;
        if !resp.status().is_success() {
            bail!("GET /v1/pools answered {}", resp.status());
        }
        let body: Value = resp.json().await?;
        let mut out = HashMap::new();
        for p in body["pools"].as_array().cloned().unwrap_or_default() {
            if let Some(name) = p["spec"]["name"].as_str() {
                out.insert(name.to_owned(), p.clone());
            }
        }
        Ok(out)
    }

    async fn claim(&self, namespace: &str, pool: &str, request_id: &str) -> Attempt {
        let body = json!({"pool": {"namespace": namespace, "name": pool}, "request_id": request_id});
        let resp =
            match self.http.post(format!("{}/v1/claims", self.base)).bearer_auth(&self.client).json(&body).send().await
            {
                Ok(r) => r,
                Err(_) => return Attempt::Retry { status: 0, retry_after: None },
            };
        let status = resp.status().as_u16();
        let retry_after =
            resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok());
        let text = match resp.text().await {
            Ok(t) => t,
            Err(_) => return Attempt::Retry { status: 0, retry_after: None },
        };
        match status {
            200 => {
                let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                match (v["lease"]["lease_id"].as_str(), v["vm"]["id"].as_str()) {
                    (Some(l), Some(vm)) => Attempt::Ok {
                        lease_id: l.to_owned(),
                        vm_id: vm.to_owned(),
                        replayed: v["replayed"].as_bool().unwrap_or(false),
                    },
                    _ => Attempt::Fail(format!("200 without a lease: {text}")),
                }
            }
            429 | 503 | 502 | 504 => Attempt::Retry { status, retry_after },
            409 if text.contains("ABORTED") => Attempt::Retry { status, retry_after },
            _ => Attempt::Fail(format!("{status}: {}", text.chars().take(300).collect::<String>())),
        }
    }

    /// Releases a lease, retrying a 503 or a lost answer (for about a minute): the final
    /// status. A 404 after such a retry is a release that had happened (the answer was lost,
    /// or the reconciler finished the delete a 503 left), so it counts as 204.
    async fn release(&self, lease_id: &str) -> u16 {
        let mut status = 0;
        for i in 0..10 {
            match self.http.delete(format!("{}/v1/leases/{lease_id}", self.base)).bearer_auth(&self.client).send().await
            {
                Ok(r) => match r.status().as_u16() {
                    404 if i > 0 => return 204,
                    503 => status = 503,
                    s => return s,
                },
                Err(_) => status = 0,
            }
            tokio::time::sleep(Duration::from_millis((50 << i).min(10_000))).await;
        }
        status
    }

    /// `POST /v1/pools/{ns}/{name}/expect`; the status and the answer.
    pub async fn expect(&self, namespace: &str, pool: &str, claims: u32, within: u64) -> (u16, Value) {
        let url = format!("{}/v1/pools/{namespace}/{pool}/expect", self.base);
        let body = json!({"claims": claims, "within_seconds": within});
        match self.http.post(url).bearer_auth(&self.client).json(&body).send().await {
            Ok(r) => {
                let s = r.status().as_u16();
                (s, r.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!({"error": e.to_string()})),
        }
    }

    /// Every event of the pool, in id order, with times relative to `t0`.
    pub async fn events(&self, namespace: &str, pool: &str, t0: SystemTime) -> anyhow::Result<Vec<Event>> {
        let t0: DateTime<Utc> = t0.into();
        let mut after = 0i64;
        let mut out = vec![];
        loop {
            let url = format!("{}/v1/events?namespace={namespace}&pool={pool}&after={after}&limit=1000", self.base);
            let resp = self.http.get(url).bearer_auth(&self.admin).send().await?;
            if !resp.status().is_success() {
                bail!("GET /v1/events answered {}", resp.status());
            }
            let body: Value = resp.json().await?;
            let events = body["events"].as_array().cloned().unwrap_or_default();
            for e in &events {
                let at: DateTime<Utc> = e["created_at"]
                    .as_str()
                    .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
                    .map(|d| d.with_timezone(&Utc))
                    .context("an event without created_at")?;
                out.push(Event {
                    kind: e["type"].as_str().unwrap_or("").to_owned(),
                    vm_id: e["vm_id"].as_str().map(str::to_owned),
                    t: (at - t0).num_microseconds().unwrap_or(0) as f64 / 1e6,
                    payload: e["payload"].clone(),
                });
            }
            let next = body["next_after"].as_i64().unwrap_or(after);
            if events.is_empty() || next <= after {
                return Ok(out);
            }
            after = next;
        }
    }
}

/// A pool's status counts out of a Pool object.
pub fn sample(t: f64, pool: &Value) -> Sample {
    let s = &pool["status"];
    let n = |k: &str| s[k].as_i64().unwrap_or(0);
    Sample {
        t,
        available: n("available"),
        claiming: n("claiming"),
        leased: n("leased"),
        provisioning: n("provisioning"),
        quarantined: n("quarantined"),
        deleting: n("deleting"),
        desired: s["desired_size"].as_i64(),
    }
}

/// What happened to one logical claim (one request_id), in real seconds since the start.
#[derive(Debug, Clone, Default)]
pub struct ClaimRecord {
    /// The arrival in trace seconds (unscaled).
    pub arrival: f64,
    pub first_at: f64,
    pub done_at: Option<f64>,
    pub attempts: u32,
    pub lease_id: Option<String>,
    pub vm_id: Option<String>,
    /// Answers marked replayed: a retry found the lease an earlier attempt created.
    pub replayed: bool,
    /// Why it failed: the deadline passed, or an answer not worth retrying.
    pub failure: Option<String>,
    /// Real seconds the first attempt took (the stack's own latency, unscaled by nothing).
    pub first_latency: f64,
    /// What the failed attempts answered: status (0 = no answer), counted.
    pub retried: Vec<u16>,
    /// The release's status (204 expected).
    pub release_status: Option<u16>,
}

/// A hint that was sent and what it got.
#[derive(Debug, Clone, Serialize)]
pub struct HintRecord {
    pub at: f64,
    pub claims: u32,
    pub within_seconds: u64,
    pub status: u16,
    pub answer: Value,
}

/// What one row's replay produced.
#[derive(Debug, Default)]
pub struct Replayed {
    pub claims: Vec<ClaimRecord>,
    pub hints: Vec<HintRecord>,
}

/// Scaled time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub start: Instant,
    pub k: f64,
    /// The shortest real wait between two attempts of a claim: the stack's own costs are not
    /// scaled, and k clients retrying every Retry-After/k would be k times the load.
    pub min_retry: Duration,
}

impl Clock {
    /// Real seconds since the start.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// The real instant of trace second `t`.
    pub fn at(&self, t: f64) -> Instant {
        self.start + Duration::from_secs_f64((t / self.k).max(0.0))
    }

    /// A trace duration as a real one.
    pub fn real(&self, d: f64) -> Duration {
        Duration::from_secs_f64((d / self.k).max(0.0))
    }
}

/// Live counts of a row's replay, for progress lines.
#[derive(Debug, Default)]
pub struct Progress {
    pub started: AtomicUsize,
    pub served: AtomicUsize,
    pub warm: AtomicUsize,
    pub failed: AtomicUsize,
}

/// One logical claim, as `poolmgr_client::Client::claim_with` makes it, in scaled time; then
/// the job's hold and the release.
pub(crate) async fn one_claim(
    api: Arc<Api>,
    namespace: String,
    pool: String,
    arrival: f64,
    job: f64,
    clock: Clock,
    progress: Arc<Progress>,
) -> ClaimRecord {
    progress.started.fetch_add(1, Ordering::Relaxed);
    let backoff =
        Backoff { first: Duration::from_secs_f64(0.25 / clock.k), max: Duration::from_secs_f64(5.0 / clock.k) };
    let request_id = format!("bench-{}", ulid::Ulid::generate());
    let mut rec = ClaimRecord { arrival, first_at: clock.now(), ..ClaimRecord::default() };
    let deadline = Instant::now() + clock.real(CLAIM_DEADLINE_S);
    loop {
        rec.attempts += 1;
        let sent = Instant::now();
        let attempt = api.claim(&namespace, &pool, &request_id).await;
        if rec.attempts == 1 {
            rec.first_latency = sent.elapsed().as_secs_f64();
        }
        match attempt {
            Attempt::Ok { lease_id, vm_id, replayed } => {
                rec.done_at = Some(clock.now());
                rec.lease_id = Some(lease_id);
                rec.vm_id = Some(vm_id);
                rec.replayed = replayed;
                progress.served.fetch_add(1, Ordering::Relaxed);
                if rec.attempts == 1 {
                    progress.warm.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
            Attempt::Fail(why) => {
                progress.failed.fetch_add(1, Ordering::Relaxed);
                rec.failure = Some(why);
                return rec;
            }
            Attempt::Retry { status, retry_after } => {
                rec.retried.push(status);
                let now = Instant::now();
                if now >= deadline {
                    progress.failed.fetch_add(1, Ordering::Relaxed);
                    rec.failure = Some("deadline".into());
                    return rec;
                }
                let ra = retry_after.map(|s| Duration::from_secs_f64(s / clock.k));
                let delay = backoff.delay(rec.attempts, ra, &mut rand::rng()).max(clock.min_retry).min(deadline - now);
                api.retry_slot(now + delay).await;
                if Instant::now() >= deadline {
                    progress.failed.fetch_add(1, Ordering::Relaxed);
                    rec.failure = Some("deadline".into());
                    return rec;
                }
            }
        }
    }
    tokio::time::sleep(clock.real(job)).await;
    if let Some(l) = &rec.lease_id {
        rec.release_status = Some(api.release(l).await);
    }
    rec
}

/// Replays `trace` on pool `namespace/pool` from `clock.start`: every arrival at its scaled
/// time, hints too when `hints` is set. Returns when every job has released its VM.
pub async fn replay(
    api: Arc<Api>,
    namespace: &str,
    pool: &str,
    trace: Arc<Trace>,
    hints: bool,
    clock: Clock,
    progress: Arc<Progress>,
) -> Replayed {
    let hint_task = {
        let (api, namespace, pool, trace) = (api.clone(), namespace.to_owned(), pool.to_owned(), trace.clone());
        tokio::spawn(async move {
            let mut out = vec![];
            if !hints {
                return out;
            }
            for h in &trace.hints {
                tokio::time::sleep_until(clock.at(h.t).into()).await;
                // within_seconds is whole seconds: at least one, rounded up.
                let within = (h.within / clock.k).ceil().max(1.0) as u64;
                let at = clock.now();
                let (status, answer) = api.expect(&namespace, &pool, h.claims, within).await;
                out.push(HintRecord { at, claims: h.claims, within_seconds: within, status, answer });
            }
            out
        })
    };
    let mut tasks = Vec::with_capacity(trace.arrivals.len());
    for a in &trace.arrivals {
        tokio::time::sleep_until(clock.at(a.t).into()).await;
        let claim = one_claim(api.clone(), namespace.to_owned(), pool.to_owned(), a.t, a.job, clock, progress.clone());
        tasks.push(tokio::spawn(claim));
    }
    let mut claims = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(r) = t.await {
            claims.push(r);
        }
    }
    Replayed { claims, hints: hint_task.await.unwrap_or_default() }
}

/// Polls `namespace`'s pools every `every` until `stop` is set; the samples by pool.
pub async fn poll(
    api: Arc<Api>,
    namespace: String,
    every: Duration,
    clock: Clock,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> HashMap<String, Vec<Sample>> {
    let samples: Arc<Mutex<HashMap<String, Vec<Sample>>>> = Arc::default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let t = clock.now();
        if let Ok(pools) = api.pools(&namespace).await {
            let mut s = samples.lock().unwrap();
            for (name, p) in pools {
                s.entry(name).or_default().push(sample(t, &p));
            }
        }
    }
    std::mem::take(&mut *samples.lock().unwrap())
}
