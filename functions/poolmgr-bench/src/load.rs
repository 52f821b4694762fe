//! Concurrent claim load through the HTTP stack for a fixed duration (`claims-load`), the
//! pgbench side of the same measurement (`pgbench-script`, `pgbench-summary`), and the
//! database chores between runs (`claims-seed`, `claims-verify`).

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// What one run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Fresh claims, each with a new request_id.
    Claim,
    /// One claim per client, then the same request_id again and again (replays).
    Replay,
    /// Claim (untimed) then release (timed), repeatedly. HTTP only: release calls flintlock.
    Release,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Claim => "claim",
            Mode::Replay => "replay",
            Mode::Release => "release",
        }
    }
}

/// One line of the results file: one path × mode × concurrency (× round of a reseed run).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    pub label: String,
    /// `http` (one poolmgr-local, its own connection pool: the in-process path), `deployed`
    /// (several poolmgr-local with one connection each behind PgBouncer: the Lambda shape) or
    /// `pgbench` (the claim statement straight on PostgreSQL).
    pub path: String,
    /// Which of the back-to-back runs of a "table emptied" series this is (1, 2, 3: the
    /// table reseeded before each, the processes kept); `None` for the main runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    pub mode: Mode,
    pub concurrency: usize,
    pub duration_s: f64,
    /// Timed operations that succeeded.
    pub ok: u64,
    /// Failed operations by cause (HTTP status, `transport`, `pgbench-failed`, ...).
    pub errors: BTreeMap<String, u64>,
    pub throughput: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Leases this run created in total (warm-up included), for the after-run check.
    pub leases_created: u64,
    /// Where the CPU went during the timed window, per successful operation.
    #[serde(default)]
    pub cpu: Option<CpuPerOp>,
}

/// CPU microseconds per operation: the whole machine's busy time, the client's (load
/// generator or pgbench), the server's (every poolmgr-local; none for pgbench) and the
/// pooler's (PgBouncer, deployed shape only). What is left is PostgreSQL's (and, on a shared
/// machine, everything else's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CpuPerOp {
    pub total_us: f64,
    pub client_us: f64,
    pub server_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooler_us: Option<f64>,
    /// Every `postgres` process, exited backends included (their time is in the
    /// postmaster's children's time).
    #[serde(default)]
    pub postgres_us: Option<f64>,
}

impl CpuPerOp {
    pub fn new(
        ops: u64,
        total_ms: f64,
        client_ms: f64,
        server_ms: Option<f64>,
        postgres_ms: Option<f64>,
    ) -> Option<CpuPerOp> {
        (ops > 0).then(|| {
            let per = |ms: f64| ms * 1000.0 / ops as f64;
            CpuPerOp {
                total_us: per(total_ms),
                client_us: per(client_ms),
                server_us: server_ms.map(per),
                pooler_us: None,
                postgres_us: postgres_ms.map(per),
            }
        })
    }
}

/// Jiffies are 1/100 s on Linux (USER_HZ).
const MS_PER_TICK: f64 = 10.0;

/// Busy CPU time of the whole machine since boot (`/proc/stat`), in ms.
pub fn machine_busy_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)? + f.get(7).unwrap_or(&0.0);
    Some(busy * MS_PER_TICK)
}

/// User + system CPU time of process `pid` (or `self`), in ms.
pub fn process_cpu_ms(pid: &str) -> Option<f64> {
    proc_stat_ticks(pid, false).map(|(_, _, t)| t * MS_PER_TICK)
}

/// User + system CPU time of process `pid` and every process below it (live ones), in ms.
pub fn tree_cpu_ms(pid: &str) -> Option<f64> {
    let mut parent: Vec<(String, String, f64)> = vec![];
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.bytes().all(|b| b.is_ascii_digit())
            && let Some((_, ppid, ticks)) = proc_stat_ticks(&name, false)
        {
            parent.push((name, ppid, ticks));
        }
    }
    let mut tree = vec![pid.to_owned()];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i].clone();
        tree.extend(parent.iter().filter(|(_, pp, _)| *pp == p).map(|(n, _, _)| n.clone()));
        i += 1;
    }
    // None when the process itself is gone.
    parent.iter().find(|(n, _, _)| n == pid)?;
    let sum: f64 = parent.iter().filter(|(n, _, _)| tree.contains(n)).map(|(_, _, t)| t).sum();
    Some(sum * MS_PER_TICK)
}

/// (command name, parent pid, utime + stime [+ cutime + cstime]) of `/proc/PID/stat`, in
/// ticks.
fn proc_stat_ticks(pid: &str, with_children: bool) -> Option<(String, String, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let comm = stat[stat.find('(')? + 1..stat.rfind(')')?].to_string();
    // Fields after the command name's closing parenthesis: the parent pid is field 4 of the
    // line; utime, stime, cutime, cstime are fields 14 to 17.
    let rest: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
    let ppid = rest.get(1)?.to_string();
    let f: Vec<f64> = rest.iter().skip(11).take(4).filter_map(|x| x.parse().ok()).collect();
    let own = f.first()? + f.get(1)?;
    Some((comm, ppid, if with_children { own + f.get(2)? + f.get(3)? } else { own }))
}

/// CPU time of the `postgres` processes, with the time of the backends that already exited
/// (the postmaster's waited-for children), in ms: of one cluster when `postmaster` (its pid)
/// is given — the postmaster and its children, so other clusters on a shared machine do not
/// count — else of every `postgres` process.
pub fn postgres_cpu_ms(postmaster: Option<&str>) -> Option<f64> {
    let mut total = 0.0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Some((comm, ppid, ticks)) = proc_stat_ticks(&name, true)
            && comm == "postgres"
            && postmaster.is_none_or(|pm| name == pm || ppid == pm)
        {
            total += ticks;
        }
    }
    Some(total * MS_PER_TICK)
}

struct CpuMark {
    machine: Option<f64>,
    client: Option<f64>,
    server: Option<f64>,
    pooler: Option<f64>,
    postgres: Option<f64>,
}

impl CpuMark {
    fn now(server_pids: &[String], pooler_pid: Option<&str>, postmaster: Option<&str>) -> CpuMark {
        let server = (!server_pids.is_empty())
            .then(|| server_pids.iter().map(|p| process_cpu_ms(p)).sum::<Option<f64>>())
            .flatten();
        CpuMark {
            machine: machine_busy_ms(),
            client: process_cpu_ms("self"),
            server,
            pooler: pooler_pid.and_then(process_cpu_ms),
            postgres: postgres_cpu_ms(postmaster),
        }
    }

    fn per_op(&self, later: &CpuMark, ops: u64) -> Option<CpuPerOp> {
        let d = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
        let server = d(self.server, later.server);
        let postgres = d(self.postgres, later.postgres);
        let mut cpu =
            CpuPerOp::new(ops, d(self.machine, later.machine)?, d(self.client, later.client)?, server, postgres)?;
        cpu.pooler_us = d(self.pooler, later.pooler).map(|ms| ms * 1000.0 / ops as f64);
        Some(cpu)
    }
}

pub fn percentile_us(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Which run a result belongs to.
struct RunKey<'a> {
    label: &'a str,
    path: &'a str,
    mode: Mode,
    concurrency: usize,
    round: Option<u32>,
}

fn summarize(
    RunKey { label, path, mode, concurrency, round }: RunKey,
    wall: Duration,
    mut lat_us: Vec<u64>,
    errors: BTreeMap<String, u64>,
    leases_created: u64,
) -> RunResult {
    lat_us.sort_unstable();
    let ms = |us: u64| us as f64 / 1000.0;
    RunResult {
        label: label.to_string(),
        path: path.to_string(),
        round,
        mode,
        concurrency,
        duration_s: wall.as_secs_f64(),
        ok: lat_us.len() as u64,
        errors,
        throughput: lat_us.len() as f64 / wall.as_secs_f64(),
        p50_ms: ms(percentile_us(&lat_us, 0.50)),
        p95_ms: ms(percentile_us(&lat_us, 0.95)),
        p99_ms: ms(percentile_us(&lat_us, 0.99)),
        max_ms: ms(lat_us.last().copied().unwrap_or(0)),
        leases_created,
        cpu: None,
    }
}

pub fn append_result(out: &Path, r: &RunResult) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .with_context(|| format!("opening {}", out.display()))?;
    writeln!(f, "{}", serde_json::to_string(r)?)?;
    Ok(())
}

pub struct HttpLoad {
    /// Client i sends every request to `endpoints[i % len]`: one poolmgr, or the load spread
    /// over the processes of the deployed shape.
    pub endpoints: Vec<String>,
    pub token: String,
    pub namespace: String,
    pub pool: String,
    pub concurrency: usize,
    pub duration: Duration,
    pub warmup: Duration,
    pub mode: Mode,
    pub label: String,
    /// The result's `path`: `http` or `deployed`.
    pub path: String,
    pub round: Option<u32>,
    /// The poolmgr-local pids, to account their CPU time.
    pub server_pids: Vec<String>,
    /// PgBouncer's pid, to account its CPU time.
    pub pooler_pid: Option<String>,
    /// The postmaster's pid: only its cluster's CPU time counts as PostgreSQL's.
    pub postmaster_pid: Option<String>,
}

#[derive(Default)]
struct WorkerOut {
    lat_us: Vec<u64>,
    errors: BTreeMap<String, u64>,
    /// VM ids handed out to this worker (claim mode), for the "never twice" check.
    vms: Vec<String>,
    leases_created: u64,
    violations: Vec<String>,
}

#[derive(Deserialize)]
struct ClaimBody {
    lease: LeaseBody,
    vm: VmBody,
    replayed: bool,
}
#[derive(Deserialize)]
struct LeaseBody {
    lease_id: String,
}
#[derive(Deserialize)]
struct VmBody {
    id: String,
}

enum Outcome {
    Ok(ClaimBody),
    Err(String),
}

/// One poolmgr: where to send the load.
struct Target {
    /// `host:port` of the endpoint (plain HTTP on loopback).
    authority: String,
    /// The request's header lines after the request line, up to the body's length:
    /// `Host`, `Authorization`, `Content-Type` and `Content-Length: ` (the length follows).
    headers: String,
    /// The claim body up to the request_id's value: `{"pool": {...}, "request_id": "`.
    body_head: String,
}

/// One client's keep-alive HTTP/1.1 connection, written by hand: the load generator shares
/// the machine with what it measures, so it costs per request as little as pgbench's client
/// does — one `write` of the whole request and, most of the time, one `read` of the whole
/// response on this task, with no connection task, channel or pool between them. It speaks
/// the little HTTP/1.1 the load needs: a `Content-Length` body (poolmgr answers nothing
/// else), `Connection: close` honoured. A connection that failed is opened again on the next
/// request.
struct Http {
    target: Arc<Target>,
    stream: Option<tokio::net::TcpStream>,
    /// The request being written, then the response being read; reused across requests.
    buf: Vec<u8>,
}

/// The parsed head of a response: status, where the body starts, its length, and whether
/// the server closes the connection after it.
#[derive(Clone, Copy)]
struct Head {
    status: u16,
    body_at: usize,
    len: usize,
    close: bool,
}

/// `None`: the head is not complete yet.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let body_at = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err("bad-response".into()),
    };
    let mut len = None;
    let mut close = resp.version == Some(0);
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            len = std::str::from_utf8(h.value).ok().and_then(|v| v.trim().parse::<usize>().ok());
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // Not a body this client reads: poolmgr answers with a length.
            return Err("chunked-response".into());
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = h.value.eq_ignore_ascii_case(b"close");
        }
    }
    let status = resp.code.ok_or("bad-response")?;
    // A 204 (a release's answer) or 304 has no body, and so no length (RFC 9110, 8.6).
    let len = if matches!(status, 204 | 304) { 0 } else { len.ok_or("no-content-length")? };
    Ok(Some(Head { status, body_at, len, close }))
}

/// Reads one answer into `buf` (cleared first): its head, then its whole body. Anything
/// after the body is an error: this client never sends a request before the last answer.
async fn read_response<R: tokio::io::AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> Result<Head, String> {
    use tokio::io::AsyncReadExt as _;
    buf.clear();
    let mut head = None;
    loop {
        if head.is_none() {
            head = parse_head(buf)?;
        }
        if let Some(h) = head {
            match buf.len().cmp(&(h.body_at + h.len)) {
                std::cmp::Ordering::Equal => return Ok(h),
                std::cmp::Ordering::Greater => return Err("bad-response".into()),
                std::cmp::Ordering::Less => {}
            }
        }
        if r.read_buf(buf).await.map_err(|_| "transport")? == 0 {
            return Err("transport".into());
        }
    }
}

impl Http {
    fn new(target: Arc<Target>) -> Http {
        Http { target, stream: None, buf: Vec::with_capacity(4096) }
    }

    /// One request and its answer: the status and the body, which lives in `self.buf` until
    /// the next request. Any failure drops the connection.
    async fn send(&mut self, method: &str, path: &str, body: &str) -> Result<(u16, &[u8]), String> {
        match self.exchange(method, path, body).await {
            Ok((status, body)) => Ok((status, &self.buf[body])),
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    async fn exchange(&mut self, method: &str, path: &str, body: &str) -> Result<(u16, Range<usize>), String> {
        use std::io::Write as _;
        use tokio::io::AsyncWriteExt as _;
        if self.stream.is_none() {
            let stream = tokio::net::TcpStream::connect(&self.target.authority).await.map_err(|_| "transport")?;
            let _ = stream.set_nodelay(true);
            self.stream = Some(stream);
        }
        let stream = self.stream.as_mut().expect("opened above");
        self.buf.clear();
        write!(self.buf, "{method} {path} HTTP/1.1\r\n{}{}\r\n\r\n", self.target.headers, body.len())
            .map_err(|_| "bad-request")?;
        self.buf.extend_from_slice(body.as_bytes());
        stream.write_all(&self.buf).await.map_err(|_| "transport")?;
        let head = read_response(stream, &mut self.buf).await?;
        if head.close {
            self.stream = None;
        }
        Ok((head.status, head.body_at..head.body_at + head.len))
    }

    async fn claim(&mut self, request_id: &str) -> Outcome {
        let body = format!("{}{request_id}\"}}", self.target.body_head);
        let (status, bytes) = match self.send("POST", "/v1/claims", &body).await {
            Ok(r) => r,
            Err(e) => return Outcome::Err(e),
        };
        if !(200..300).contains(&status) {
            return Outcome::Err(status.to_string());
        }
        match serde_json::from_slice::<ClaimBody>(bytes) {
            Ok(b) => Outcome::Ok(b),
            Err(_) => Outcome::Err("bad-body".into()),
        }
    }

    async fn release(&mut self, lease_id: &str) -> Result<(), String> {
        let (status, _) = self.send("DELETE", &format!("/v1/leases/{lease_id}"), "").await?;
        if (200..300).contains(&status) { Ok(()) } else { Err(status.to_string()) }
    }
}

/// Random, like the UUIDs most clients send (and like pgbench's random ids): a time-ordered id
/// (a ULID) would put every insert on the rightmost page of the request_id index.
fn request_id() -> String {
    poolmgr_core::domain::random_uuid().to_string()
}

async fn worker(target: Arc<Target>, mode: Mode, start_timing: Instant, stop: Instant) -> WorkerOut {
    let mut out = WorkerOut::default();
    let mut http = Http::new(target);
    let bump = |errors: &mut BTreeMap<String, u64>, e: String| *errors.entry(e).or_default() += 1;
    // Replay: the one lease this client keeps asking for.
    let mut replay_of: Option<(String, String)> = None;
    if mode == Mode::Replay {
        let rid = request_id();
        match http.claim(&rid).await {
            Outcome::Ok(b) => {
                out.leases_created += 1;
                replay_of = Some((rid, b.lease.lease_id));
            }
            Outcome::Err(e) => {
                out.violations.push(format!("replay setup claim failed: {e}"));
                return out;
            }
        }
    }
    loop {
        let now = Instant::now();
        if now >= stop {
            break;
        }
        let timed = now >= start_timing;
        match mode {
            Mode::Claim => {
                let t = Instant::now();
                let r = http.claim(&request_id()).await;
                let us = t.elapsed().as_micros() as u64;
                match r {
                    Outcome::Ok(b) => {
                        out.leases_created += 1;
                        out.vms.push(b.vm.id);
                        if b.replayed {
                            out.violations
                                .push(format!("a fresh request_id was answered as a replay ({})", b.lease.lease_id));
                        }
                        if timed {
                            out.lat_us.push(us);
                        }
                    }
                    Outcome::Err(e) if timed => bump(&mut out.errors, e),
                    Outcome::Err(_) => {}
                }
            }
            Mode::Replay => {
                let (rid, lease_id) = replay_of.as_ref().expect("set up above");
                let t = Instant::now();
                let r = http.claim(rid).await;
                let us = t.elapsed().as_micros() as u64;
                match r {
                    Outcome::Ok(b) => {
                        if !b.replayed || &b.lease.lease_id != lease_id {
                            out.violations.push(format!(
                                "request_id {rid} gave lease {} (replayed={}) after lease {lease_id}",
                                b.lease.lease_id, b.replayed
                            ));
                        }
                        if timed {
                            out.lat_us.push(us);
                        }
                    }
                    Outcome::Err(e) if timed => bump(&mut out.errors, e),
                    Outcome::Err(_) => {}
                }
            }
            Mode::Release => {
                let lease_id = match http.claim(&request_id()).await {
                    Outcome::Ok(b) => {
                        out.leases_created += 1;
                        b.lease.lease_id
                    }
                    Outcome::Err(e) => {
                        bump(&mut out.errors, format!("claim-{e}"));
                        continue;
                    }
                };
                let t = Instant::now();
                let r = http.release(&lease_id).await;
                let us = t.elapsed().as_micros() as u64;
                match r {
                    Ok(()) if timed => out.lat_us.push(us),
                    Ok(()) => {}
                    Err(e) if timed => bump(&mut out.errors, e),
                    Err(_) => {}
                }
            }
        }
    }
    out
}

/// Runs the load; returns the result and the client-side violations (a VM handed out twice,
/// a replay answered with another lease).
pub async fn http_load(cfg: HttpLoad) -> anyhow::Result<(RunResult, Vec<String>)> {
    if cfg.endpoints.is_empty() {
        bail!("no endpoint to send the load to");
    }
    if cfg.token.bytes().any(|b| b.is_ascii_control()) {
        bail!("the token has a control character; it cannot be sent in a header");
    }
    let targets: Vec<Arc<Target>> = cfg
        .endpoints
        .iter()
        .map(|e| {
            let authority = e.trim_end_matches('/').strip_prefix("http://").with_context(|| {
                format!("endpoint {e}: the load generator speaks plain HTTP only (http://host:port)")
            })?;
            let pool = json!({"namespace": cfg.namespace, "name": cfg.pool});
            Ok(Arc::new(Target {
                authority: authority.to_string(),
                headers: format!(
                    "Host: {authority}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: ",
                    cfg.token
                ),
                body_head: format!("{{\"pool\": {pool}, \"request_id\": \""),
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let start_timing = Instant::now() + cfg.warmup;
    let stop = start_timing + cfg.duration;
    let handles: Vec<_> = (0..cfg.concurrency)
        .map(|i| tokio::spawn(worker(targets[i % targets.len()].clone(), cfg.mode, start_timing, stop)))
        .collect();
    tokio::time::sleep_until(start_timing.into()).await;
    let cpu_start = CpuMark::now(&cfg.server_pids, cfg.pooler_pid.as_deref(), cfg.postmaster_pid.as_deref());
    let mut lat = vec![];
    let mut errors = BTreeMap::new();
    let mut vms = HashSet::new();
    let mut violations = vec![];
    let mut leases_created = 0;
    for h in handles {
        let out = h.await.context("load worker panicked")?;
        lat.extend(out.lat_us);
        for (k, v) in out.errors {
            *errors.entry(k).or_default() += v;
        }
        for vm in out.vms {
            if !vms.insert(vm.clone()) {
                violations.push(format!("VM {vm} was handed out twice"));
            }
        }
        violations.extend(out.violations);
        leases_created += out.leases_created;
    }
    // Operations still running at `stop` finished after it: count the wall until the last one.
    let wall = Instant::now().saturating_duration_since(start_timing).max(cfg.duration);
    let cpu_end = CpuMark::now(&cfg.server_pids, cfg.pooler_pid.as_deref(), cfg.postmaster_pid.as_deref());
    let mut r = summarize(
        RunKey { label: &cfg.label, path: &cfg.path, mode: cfg.mode, concurrency: cfg.concurrency, round: cfg.round },
        wall,
        lat,
        errors,
        leases_created,
    );
    r.cpu = cpu_start.per_op(&cpu_end, r.ok);
    Ok((r, violations))
}

/// The pgbench script for `mode`: the service's own claim statement with pgbench variables
/// in place of its parameters. Comments are dropped (pgbench would read `name:` in them as
/// nothing, but a stray `:word` would be substituted).
pub fn pgbench_script(mode: Mode) -> anyhow::Result<String> {
    let sql: String = poolmgr_core::store::LEASE_CLAIM_SQL
        .lines()
        .map(|l| match l.find("--") {
            Some(i) => &l[..i],
            None => l,
        })
        .filter(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let request_id = match mode {
        Mode::Claim => ":rid",
        // Every transaction of a client reuses the client's id: the first claims, the rest replay.
        Mode::Replay => ":client_id",
        Mode::Release => bail!("release is measured through HTTP only (it calls flintlock)"),
    };
    let sql = sql
        .replace("$1", ":ns")
        .replace("$2", ":pool")
        .replace("$3", ":lid")
        .replace("$4", request_id)
        .replace("$5", ":principal");
    if sql.contains('$') {
        bail!("the claim statement has a parameter this script does not map");
    }
    Ok(format!(
        "-- Generated by `poolmgr-bench pgbench-script --mode {}` from poolmgr_core::store::LEASE_CLAIM_SQL.\n\
         -- Define ns, pool and principal with pgbench -D.\n\
         \\set lid random(1, 9000000000000000000)\n\
         \\set rid random(1, 9000000000000000000)\n\
         {sql};\n",
        mode.name()
    ))
}

/// Reads pgbench's per-transaction logs (`--log --log-prefix=PREFIX`): `client_id
/// transaction_no time script_no time_epoch time_us`, `time` in µs or `failed`/`skipped`.
pub fn pgbench_summary(
    log_prefix: &Path,
    label: &str,
    mode: Mode,
    concurrency: usize,
    duration: Duration,
    cpu_ms: Option<(f64, f64, Option<f64>)>,
) -> anyhow::Result<RunResult> {
    let dir = log_prefix.parent().unwrap_or(Path::new("."));
    let stem = log_prefix.file_name().context("--log-prefix needs a file name")?.to_string_lossy().to_string();
    let mut lat = vec![];
    let mut errors = BTreeMap::new();
    let mut files = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if !name.starts_with(&format!("{stem}.")) {
            continue;
        }
        files += 1;
        let text = std::fs::read_to_string(&path)?;
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 {
                continue;
            }
            match f[2].parse::<u64>() {
                Ok(us) => lat.push(us),
                Err(_) => *errors.entry(format!("pgbench-{}", f[2])).or_default() += 1,
            }
        }
    }
    if files == 0 {
        bail!("no pgbench log files {}.*: run pgbench with --log --log-prefix", log_prefix.display());
    }
    // A claim transaction creates a lease; in replay mode only each client's first one does.
    let n = match mode {
        Mode::Replay => concurrency.min(lat.len()) as u64,
        _ => lat.len() as u64,
    };
    let mut r = summarize(RunKey { label, path: "pgbench", mode, concurrency, round: None }, duration, lat, errors, n);
    r.cpu = cpu_ms.and_then(|(machine, client, postgres)| CpuPerOp::new(r.ok, machine, client, None, postgres));
    Ok(r)
}

/// One connection for the chores, with the TLS settings of the environment
/// (`POOLMGR_DATABASE_SSLMODE`, `POOLMGR_DATABASE_CA_PEM`).
async fn connect(database_url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let tls = poolmgr_core::db::DbTls::from_env().map_err(anyhow::Error::msg)?;
    poolmgr_core::db::connect_one(database_url, &tls).await.context("connecting to PostgreSQL")
}

/// Empties the pool and seeds it with `vms` AVAILABLE rows on `host`; every run starts from
/// the same state.
pub async fn seed(database_url: &str, namespace: &str, pool: &str, host: &str, vms: i64) -> anyhow::Result<()> {
    let client = connect(database_url).await?;
    client.batch_execute("DELETE FROM events; DELETE FROM leases;").await.context("clearing leases and events")?;
    client
        .execute("DELETE FROM vms WHERE pool_namespace = $1 AND pool_name = $2", &[&namespace, &pool])
        .await
        .context("clearing VMs")?;
    client
        .execute(
            "INSERT INTO vms (id, uid, pool_namespace, pool_name, flintlock_host, phase, network_interfaces)
             SELECT 'bench-' || g, 'UID' || g, $1, $2, $3, 'AVAILABLE',
                    '{\"eth1\": {\"host_device_name\": \"fltap0000001\", \"index\": 3, \"mac_address\": \"aa:bb:cc:dd:ee:ff\"}}'
             FROM generate_series(1, $4::bigint) g",
            &[&namespace, &pool, &host, &vms],
        )
        .await
        .context("seeding VMs")?;
    // One at a time: VACUUM cannot run in the implicit transaction of a multi-statement batch.
    for sql in ["VACUUM ANALYZE vms", "VACUUM ANALYZE leases", "VACUUM ANALYZE events", "CHECKPOINT"] {
        client.batch_execute(sql).await.with_context(|| sql.to_string())?;
    }
    Ok(())
}

/// After a run: every lease on its own VM, every LEASED VM with exactly one lease, and (when
/// given) exactly `expect_leases` leases.
pub async fn verify(database_url: &str, expect_leases: Option<i64>) -> anyhow::Result<Vec<String>> {
    let client = connect(database_url).await?;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM leases) AS leases,
                    (SELECT count(*) FROM (SELECT vm_id FROM leases GROUP BY vm_id HAVING count(*) > 1) d) AS shared_vms,
                    (SELECT count(*) FROM vms v WHERE v.phase = 'LEASED'
                       AND (SELECT count(*) FROM leases l WHERE l.vm_id = v.id) <> 1) AS leased_not_one,
                    (SELECT count(*) FROM leases l JOIN vms v ON v.id = l.vm_id
                       WHERE v.phase <> 'LEASED' OR v.lease_id IS DISTINCT FROM l.lease_id) AS lease_vm_mismatch,
                    (SELECT count(*) FROM events WHERE type = 'VM_CLAIMED') AS claimed_events",
            &[],
        )
        .await?;
    let (leases, shared, not_one, mismatch, events): (i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let mut v = vec![];
    if shared > 0 {
        v.push(format!("{shared} VMs carry more than one lease"));
    }
    if not_one > 0 {
        v.push(format!("{not_one} LEASED VMs do not have exactly one lease"));
    }
    if mismatch > 0 {
        v.push(format!("{mismatch} leases point at a VM that is not LEASED by them"));
    }
    if let Some(want) = expect_leases {
        if leases != want {
            v.push(format!("{leases} leases in the database, the clients got {want}"));
        }
        if events != want {
            v.push(format!("{events} VM_CLAIMED events, the clients got {want} leases"));
        }
    }
    eprintln!("    verify: {leases} leases, {events} VM_CLAIMED events, {} violations", v.len());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[test]
    fn a_response_head_is_read_once_complete() {
        let full = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        let head = parse_head(full).unwrap().expect("complete");
        assert_eq!((head.status, head.len, head.close), (201, 2, false));
        assert_eq!(&full[head.body_at..], b"{}");
        assert!(parse_head(&full[..20]).unwrap().is_none(), "a partial head waits for more");
        let close = parse_head(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
        assert!(close.unwrap().unwrap().close);
        assert!(parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n").unwrap().unwrap().close);
        assert_eq!(
            parse_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").err().as_deref(),
            Some("chunked-response")
        );
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\n\r\n").err().as_deref(), Some("no-content-length"));
        let no_content = parse_head(b"HTTP/1.1 204 No Content\r\ndate: x\r\n\r\n").unwrap().unwrap();
        assert_eq!((no_content.status, no_content.len), (204, 0));
        assert_eq!(parse_head(b"garbage\r\n\r\n").err().as_deref(), Some("bad-response"));
    }

    #[tokio::test]
    async fn an_answer_is_read_whatever_pieces_it_arrives_in() {
        let body = br#"{"lease": {"lease_id": "l1"}}"#;
        let mut answer = format!("HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
        answer.extend_from_slice(body);
        // A pipe that passes 3 bytes at a time: the head and the body each take many reads.
        let (mut client, mut server) = tokio::io::duplex(3);
        let sent = answer.clone();
        tokio::spawn(async move { server.write_all(&sent).await.unwrap() });
        let mut buf = b"the last answer".to_vec();
        let head = read_response(&mut client, &mut buf).await.unwrap();
        assert_eq!(head.status, 201);
        assert_eq!(&buf[head.body_at..head.body_at + head.len], body);
        assert_eq!(buf, answer, "the buffer holds this answer only");

        // Bytes after the body: nothing was asked for them.
        let (mut client, mut server) = tokio::io::duplex(1024);
        server.write_all(b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 204").await.unwrap();
        assert_eq!(read_response(&mut client, &mut Vec::new()).await.err().as_deref(), Some("bad-response"));

        // The connection ends inside the body.
        let (mut client, mut server) = tokio::io::duplex(1024);
        server.write_all(&answer[..answer.len() - 1]).await.unwrap();
        drop(server);
        assert_eq!(read_response(&mut client, &mut Vec::new()).await.err().as_deref(), Some("transport"));
    }

    /// A server that answers each request on a connection with `answers[i]` and reports every
    /// request it read.
    async fn scripted_server(answers: Vec<&'static str>) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut answers = answers.into_iter();
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                loop {
                    let mut buf = vec![0u8; 8192];
                    let n = s.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    tx.send(String::from_utf8_lossy(&buf[..n]).into_owned()).unwrap();
                    let Some(a) = answers.next() else { return };
                    s.write_all(a.as_bytes()).await.unwrap();
                    if a.contains("Connection: close") {
                        break;
                    }
                }
            }
        });
        (addr, rx)
    }

    fn target(addr: &str) -> Arc<Target> {
        Arc::new(Target {
            authority: addr.to_string(),
            headers: format!(
                "Host: {addr}\r\nAuthorization: Bearer t\r\nContent-Type: application/json\r\nContent-Length: "
            ),
            body_head: "{\"pool\": {\"namespace\": \"default\", \"name\": \"p\"}, \"request_id\": \"".into(),
        })
    }

    #[tokio::test]
    async fn the_client_sends_whole_requests_and_keeps_its_connection_until_told_to_close() {
        let claim = r#"{"lease": {"lease_id": "l1"}, "vm": {"id": "vm1"}, "replayed": false}"#;
        let ok: &'static str = Box::leak(
            format!("HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n{claim}", claim.len()).into_boxed_str(),
        );
        let busy = "HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let (addr, mut seen) = scripted_server(vec![ok, busy, ok]).await;
        let mut http = Http::new(target(&addr));

        match http.claim("rid-1").await {
            Outcome::Ok(b) => {
                assert_eq!((b.lease.lease_id.as_str(), b.vm.id.as_str(), b.replayed), ("l1", "vm1", false))
            }
            Outcome::Err(e) => panic!("claim failed: {e}"),
        }
        let req = seen.recv().await.unwrap();
        let body = r#"{"pool": {"namespace": "default", "name": "p"}, "request_id": "rid-1"}"#;
        assert!(req.starts_with("POST /v1/claims HTTP/1.1\r\n"), "{req}");
        assert!(req.contains("\r\nAuthorization: Bearer t\r\n"), "{req}");
        assert!(req.ends_with(&format!("Content-Length: {}\r\n\r\n{body}", body.len())), "{req}");

        // A refusal is the status; `Connection: close` drops the connection...
        assert!(matches!(http.claim("rid-2").await, Outcome::Err(e) if e == "429"));
        assert!(http.stream.is_none());
        // ...and the next request opens a new one.
        assert!(matches!(http.claim("rid-3").await, Outcome::Ok(_)));
        assert!(seen.recv().await.unwrap().contains("rid-2"));
        assert!(seen.recv().await.unwrap().contains("rid-3"));
    }

    #[tokio::test]
    async fn a_connection_closed_mid_answer_is_a_transport_error_and_is_reopened() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            // First connection: half an answer, then gone. Second: a whole empty answer.
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.read(&mut [0u8; 4096]).await.unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"a\"").await.unwrap();
            drop(s);
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.read(&mut [0u8; 4096]).await.unwrap();
            s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await.unwrap();
        });
        let mut http = Http::new(target(&addr));
        assert_eq!(http.send("DELETE", "/v1/leases/x", "").await.err().as_deref(), Some("transport"));
        assert!(http.stream.is_none());
        assert_eq!(http.release("x").await, Ok(()));
    }
}
