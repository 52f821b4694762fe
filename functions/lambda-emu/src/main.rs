//! `lambda-emu`: run a function binary under the emulated Lambda Runtime API and Parameters
//! and Secrets extension (see the library), to measure its cold start (`cold-start`,
//! driven by `scripts/bench-cold-start.sh`); run it as one execution environment invoked on a
//! schedule and through an emulated Lambda Invoke API (`schedule`, the deployed reconciler of
//! `scripts/bench-demand.sh`); or print an API Gateway HTTP API event.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use lambda_emu::schedule::{self, EnvironmentSpec};
use lambda_emu::{Emulator, InvokeApi, Outcome, http_event};
use serde_json::Value;

#[derive(Parser)]
#[command(about = "An emulated AWS Lambda Runtime API and Parameters and Secrets extension")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start BIN as a fresh Lambda execution environment RUNS times and time each one from
    /// process start to its first answer (the cold start); the secrets are served only once
    /// the function asked for its first event, as on AWS. Prints one line per run, then the
    /// median. Fails on an error answer, an HTTP status of 400 or more, or a function that
    /// read a secret during INIT.
    ColdStart {
        /// The function binary (e.g. target/release/claims).
        #[arg(long)]
        bin: PathBuf,
        /// AWS_LAMBDA_FUNCTION_NAME (default: the binary's file name).
        #[arg(long)]
        name: Option<String>,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// A secret the extension serves: ARN=FILE (the file holds the SecretString).
        #[arg(long = "secret", value_name = "ARN=FILE")]
        secrets: Vec<String>,
        /// A variable of the function's environment (repeatable; the environment is
        /// otherwise empty but for Lambda's own variables).
        #[arg(long = "env", value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// The events, in order: the first is the cold one, later ones run warm in the same
        /// process. `{run}` in a file is replaced by the run's number, `{ulid}` by a new ULID.
        #[arg(long = "event", value_name = "FILE", required = true)]
        events: Vec<PathBuf>,
        /// Append the function's stderr (its logs) of every run to this file.
        #[arg(long)]
        log: Option<PathBuf>,
    },
    /// Start BIN as one Lambda execution environment, invoke it with an EventBridge Scheduler
    /// event every --every-ms, and serve the Lambda Invoke API on --invoke-addr
    /// (`POST /2015-03-31/functions/{name}/invocations`; an `Event` invoke answers 202 and
    /// queues its payload). Invocations run one at a time, in order; each one's start, end and
    /// answer go to stderr. Prints `lambda-emu invoke API listening on http://ADDR` on stdout
    /// once it serves; stops on SIGINT/SIGTERM.
    Schedule {
        /// The function binary (e.g. target/debug/reconcile).
        #[arg(long)]
        bin: PathBuf,
        /// AWS_LAMBDA_FUNCTION_NAME and the name invokes use (default: the binary's file name).
        #[arg(long)]
        name: Option<String>,
        /// Milliseconds between scheduled invocations (0: none, only the Invoke API's).
        #[arg(long)]
        every_ms: u64,
        /// Where the Invoke API listens (port 0: a free one).
        #[arg(long, default_value = "127.0.0.1:0")]
        invoke_addr: SocketAddr,
        /// A variable of the function's environment (repeatable; on top of Lambda's own).
        #[arg(long = "env", value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// A secret the extension serves: ARN=SECRET_STRING, or ARN=@FILE (repeatable).
        #[arg(long = "secret", value_name = "ARN=JSON")]
        secrets: Vec<String>,
        /// The function's timeout: each invocation's deadline, after which the environment is
        /// replaced.
        #[arg(long, default_value_t = 120_000)]
        timeout_ms: u64,
        /// Another key pair whose signed invokes are accepted, ACCESS_KEY_ID:SECRET_ACCESS_KEY
        /// (repeatable; the environment's own always are). With none, a well-formed SigV4
        /// header from anyone is accepted; with some, every signature is checked.
        #[arg(long = "credentials", value_name = "KEY_ID:SECRET")]
        credentials: Vec<String>,
        /// Merge an Event into one already queued for the function and not yet started
        /// (default: queue every one, as Lambda does).
        #[arg(long)]
        coalesce: bool,
        /// The scheduled event's payload (default: the EventBridge Scheduler envelope, a fresh
        /// id and time each time).
        #[arg(long)]
        event: Option<PathBuf>,
    },
    /// Print an API Gateway HTTP API (payload 2.0) event for METHOD PATH.
    HttpEvent {
        method: String,
        /// The path with its query string, e.g. /v1/leases?limit=10
        path: String,
        /// A request header, "name: value" (repeatable).
        #[arg(long = "header", value_name = "NAME: VALUE")]
        headers: Vec<String>,
        /// A JSON request body.
        #[arg(long)]
        body: Option<String>,
    },
}

fn split_pair<'a>(s: &'a str, sep: char, what: &str) -> anyhow::Result<(&'a str, &'a str)> {
    s.split_once(sep).with_context(|| format!("expected {what}, got {s:?}"))
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 }
}

/// Refuses an answer that is not a success: an error, or an HTTP response of 400 or more.
/// Returns the `duration_ms` the answer reports (the reconcile pass's own time), if any.
fn check(outcome: &Outcome) -> anyhow::Result<Option<u64>> {
    match outcome {
        Outcome::Error { error_type, body } => bail!("the function answered an error {error_type}: {body}"),
        Outcome::Response(bytes) => {
            let v: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
            match v.get("statusCode").and_then(Value::as_u64) {
                Some(code) if code >= 400 => bail!("the function answered HTTP {code}: {}", v["body"]),
                _ => Ok(v.get("duration_ms").and_then(Value::as_u64)),
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn cold_start(
    bin: PathBuf,
    name: Option<String>,
    runs: usize,
    secrets: Vec<String>,
    env: Vec<String>,
    events: Vec<PathBuf>,
    log: Option<PathBuf>,
) -> anyhow::Result<()> {
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    let bin = std::fs::canonicalize(&bin).with_context(|| format!("{}: build it first", bin.display()))?;
    let name = match name {
        Some(n) => n,
        None => bin.file_name().context("--bin needs a file name")?.to_string_lossy().into_owned(),
    };
    let mut secret_values = vec![];
    for s in &secrets {
        let (arn, file) = split_pair(s, '=', "--secret ARN=FILE")?;
        let value = std::fs::read_to_string(file).with_context(|| format!("reading secret file {file}"))?;
        secret_values.push((arn.to_owned(), value));
    }
    let env: Vec<(String, String)> = env
        .iter()
        .map(|e| split_pair(e, '=', "--env KEY=VALUE").map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect::<anyhow::Result<_>>()?;
    let templates: Vec<String> = events
        .iter()
        .map(|f| std::fs::read_to_string(f).with_context(|| format!("reading event file {}", f.display())))
        .collect::<anyhow::Result<_>>()?;
    let mut log = match log {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        None => None,
    };

    eprintln!("==> {name}: {runs} cold starts of {}", bin.display());
    let mut colds = vec![];
    // First answer minus the answer's own duration_ms, when it reports one (reconcile).
    let mut starts = vec![];
    for run in 1..=runs {
        let emu = Emulator::start(&name).await.context("starting the emulator")?;
        for (arn, value) in &secret_values {
            emu.extension.put_secret(arn, value);
        }
        let mut function = emu.spawn(&bin, &env).with_context(|| format!("starting {}", bin.display()))?;
        let mut times = vec![];
        let mut reported = None;
        let mut result = Ok(());
        for template in &templates {
            let payload =
                template.replace("{run}", &run.to_string()).replace("{ulid}", &ulid::Ulid::generate().to_string());
            let sent = std::time::Instant::now();
            let answer = match function.invoke(payload, Duration::from_secs(60)).await {
                Ok(a) => a,
                Err(e) => {
                    result = Err(anyhow::anyhow!("run {run}: {e}"));
                    break;
                }
            };
            match check(&answer.outcome) {
                Ok(d) if times.is_empty() => reported = d,
                Ok(_) => {}
                Err(e) => {
                    result = Err(e.context(format!("run {run}")));
                    break;
                }
            }
            // The cold one counts from process start, warm ones from when they were sent.
            let since = if times.is_empty() { function.started() } else { sent };
            times.push(answer.at.duration_since(since).as_secs_f64() * 1000.0);
        }
        function.kill().await;
        if let Some(f) = log.as_mut() {
            use std::io::Write;
            writeln!(f, "--- {name} run {run}\n{}", function.stderr())?;
        }
        result.with_context(|| format!("the function's log:\n{}", function.stderr()))?;
        let calls = emu.extension.calls();
        if calls.refused_in_init > 0 {
            bail!(
                "run {run}: the function read a secret during INIT ({} refused calls): AWS's extension refuses that",
                calls.refused_in_init
            );
        }
        let warm: Vec<String> = times[1..].iter().map(|t| format!("{t:.1}")).collect();
        let init = function.init_done().map(|t| t.duration_since(function.started()).as_secs_f64() * 1000.0);
        println!(
            "run {run}: first answer after {:.1} ms (INIT {:.1} ms{}){}; {} secret reads",
            times[0],
            init.unwrap_or(f64::NAN),
            reported.map(|d| format!(", the answer's own duration_ms {d}")).unwrap_or_default(),
            if warm.is_empty() { String::new() } else { format!(", then warm {} ms", warm.join(", ")) },
            calls.served
        );
        colds.push(times[0]);
        if let Some(d) = reported {
            starts.push(times[0] - d as f64);
        }
    }
    colds.sort_by(f64::total_cmp);
    println!(
        "{name}: cold start median {:.1} ms over {runs} runs (min {:.1}, max {:.1})",
        median(&colds),
        colds[0],
        colds[colds.len() - 1]
    );
    println!("median_ms={:.1}", median(&colds));
    if starts.len() == colds.len() {
        starts.sort_by(f64::total_cmp);
        println!("{name}: without the work the answers report (duration_ms), median {:.1} ms", median(&starts));
        println!("median_start_ms={:.1}", median(&starts));
    }
    Ok(())
}

fn stamp() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:03}", t.as_secs(), t.subsec_millis())
}

#[allow(clippy::too_many_arguments)]
async fn run_schedule(
    bin: PathBuf,
    name: Option<String>,
    every_ms: u64,
    invoke_addr: SocketAddr,
    env: Vec<String>,
    secrets: Vec<String>,
    timeout_ms: u64,
    credentials: Vec<String>,
    coalesce: bool,
    event: Option<PathBuf>,
) -> anyhow::Result<()> {
    let bin = std::fs::canonicalize(&bin).with_context(|| format!("{}: build it first", bin.display()))?;
    let name = match name {
        Some(n) => n,
        None => bin.file_name().context("--bin needs a file name")?.to_string_lossy().into_owned(),
    };
    let env: Vec<(String, String)> = env
        .iter()
        .map(|e| split_pair(e, '=', "--env KEY=VALUE").map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect::<anyhow::Result<_>>()?;
    let mut secret_values = vec![];
    for s in &secrets {
        let (arn, value) = split_pair(s, '=', "--secret ARN=JSON")?;
        let value = match value.strip_prefix('@') {
            Some(file) => std::fs::read_to_string(file).with_context(|| format!("reading secret file {file}"))?,
            None => value.to_owned(),
        };
        secret_values.push((arn.to_owned(), value));
    }
    let event = match event {
        Some(f) => Some(std::fs::read_to_string(&f).with_context(|| format!("reading event file {}", f.display()))?),
        None => None,
    };
    let api = InvokeApi::start(invoke_addr)
        .await
        .with_context(|| format!("cannot listen on {invoke_addr}: pick a free --invoke-addr"))?;
    for c in &credentials {
        let (key, secret) = split_pair(c, ':', "--credentials ACCESS_KEY_ID:SECRET_ACCESS_KEY")?;
        api.add_credentials(key, secret);
    }
    api.set_coalesce(coalesce);
    api.set_log(|line| eprintln!("{} lambda-emu: {line}", stamp()));
    let queue = api.add_function(&name);
    let spec = EnvironmentSpec {
        bin,
        name: name.clone(),
        env,
        secrets: secret_values,
        timeout: Duration::from_millis(timeout_ms),
    };
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "lambda-emu invoke API listening on http://{}", api.addr())?;
        out.flush()?;
    }
    let log = |line: String| eprintln!("{} lambda-emu: {line}", stamp());
    log(format!(
        "{name}: scheduled every {every_ms} ms, invoke API on {}, timeout {timeout_ms} ms{}",
        api.addr(),
        if coalesce { ", events coalesced" } else { "" }
    ));
    let ticker = async {
        if every_ms == 0 {
            return std::future::pending::<()>().await;
        }
        let mut tick = tokio::time::interval(Duration::from_millis(every_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let payload = event.clone().unwrap_or_else(|| schedule::scheduled_event("poolmgr-reconcile").to_string());
            if !api.enqueue(&name, payload) {
                log("scheduled event merged into one already queued".to_owned());
            }
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = schedule::serve(&spec, &api, queue, &log) => r.context("starting the function")?,
        _ = ticker => {}
        _ = tokio::signal::ctrl_c() => log("interrupted; stopping".to_owned()),
        _ = term.recv() => log("terminated; stopping".to_owned()),
    }
    let received = api.received();
    let events = received.iter().filter(|r| r.status == 202).count();
    let coalesced = received.iter().filter(|r| r.coalesced).count();
    log(format!("{} invoke requests: {events} accepted events ({coalesced} coalesced)", received.len()));
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Schedule { bin, name, every_ms, invoke_addr, env, secrets, timeout_ms, credentials, coalesce, event } => {
            run_schedule(bin, name, every_ms, invoke_addr, env, secrets, timeout_ms, credentials, coalesce, event).await
        }
        Cmd::ColdStart { bin, name, runs, secrets, env, events, log } => {
            cold_start(bin, name, runs, secrets, env, events, log).await
        }
        Cmd::HttpEvent { method, path, headers, body } => {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|h| split_pair(h, ':', "--header \"NAME: VALUE\"").map(|(k, v)| (k.trim(), v.trim())))
                .collect::<anyhow::Result<_>>()?;
            println!("{}", http_event(&method, &path, &headers, body.as_deref()));
            Ok(())
        }
    }
}
