//! One emulated execution environment of a function, fed by a queue: what `lambda-emu
//! schedule` runs for the reconcile function in the deployed shape. The queue gets the
//! schedule's events ([`scheduled_event`], every N ms) and the Invoke API's
//! ([`crate::InvokeApi`]); [`serve`] hands them to the function one at a time, as Lambda runs
//! one invocation per environment, and logs each one's start, end and answer.
//!
//! An environment whose function crashed or timed out is replaced by a fresh one (a new
//! process, a new INIT), as Lambda does; the invocation that met it answers an error. Never
//! runs two invocations at once.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::invoke::{InvokeApi, InvokeQueue};
use crate::{ACCOUNT, Emulator, Function, Outcome, REGION};

/// How to start the function.
#[derive(Debug, Clone)]
pub struct EnvironmentSpec {
    pub bin: PathBuf,
    /// `AWS_LAMBDA_FUNCTION_NAME`, and the name the Invoke API knows it by.
    pub name: String,
    /// Variables on top of Lambda's own (they win).
    pub env: Vec<(String, String)>,
    /// Secrets the Parameters and Secrets extension serves: (ARN, SecretString).
    pub secrets: Vec<(String, String)>,
    /// Each invocation's deadline.
    pub timeout: Duration,
}

/// A process and the emulator it talks to.
struct Environment {
    // Kept alive for the function: its Runtime API and extension.
    _emu: Emulator,
    function: Function,
    started: Instant,
}

impl Environment {
    async fn start(spec: &EnvironmentSpec, api: &InvokeApi) -> std::io::Result<Environment> {
        let emu = Emulator::start_with_timeout(&spec.name, spec.timeout).await?;
        for (arn, value) in &spec.secrets {
            emu.extension.put_secret(arn, value);
        }
        // The function's own invokes (a loop handed on) are signed with these.
        let (key, secret) = emu.credentials();
        api.add_credentials(key, secret);
        let function = emu.spawn(&spec.bin, &spec.env)?;
        Ok(Environment { _emu: emu, function, started: Instant::now() })
    }
}

/// At most `n` characters of `s` on one line.
fn short(s: &str, n: usize) -> String {
    let one_line: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    match one_line.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &one_line[..i]),
        None => one_line,
    }
}

/// One line saying what an answer was.
pub fn summary(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Response(b) => format!("response {}", short(&String::from_utf8_lossy(b), 1500)),
        Outcome::Error { error_type, body } => {
            format!("error {error_type}: {}", short(body["errorMessage"].as_str().unwrap_or(&body.to_string()), 300))
        }
    }
}

/// Runs `queue`'s invocations on one environment of `spec`, one at a time, until the queue
/// ends; `log` gets one line per start, end and environment change. Fails only when no
/// environment can be started at all (the binary is missing, no port is free).
pub async fn serve(
    spec: &EnvironmentSpec,
    api: &InvokeApi,
    mut queue: InvokeQueue,
    log: &(dyn Fn(String) + Send + Sync),
) -> std::io::Result<()> {
    let mut env = Environment::start(spec, api).await?;
    log(format!("{}: environment started ({})", spec.name, spec.bin.display()));
    let mut seq = 0u64;
    while let Some(q) = queue.recv().await {
        seq += 1;
        let waited = q.queued_at.elapsed();
        log(format!(
            "invocation {seq} start: {} from {:?}, queued {:.1} ms",
            q.invocation_type.as_str(),
            q.source,
            waited.as_secs_f64() * 1000.0
        ));
        let t = Instant::now();
        let result = env.function.invoke(q.payload, spec.timeout).await;
        let took = t.elapsed().as_secs_f64() * 1000.0;
        match result {
            Ok(answer) => {
                log(format!("invocation {seq} end after {took:.1} ms: {}", summary(&answer.outcome)));
                if let Some(reply) = q.reply {
                    let _ = reply.send(Ok(answer.outcome));
                }
            }
            Err(no_answer) => {
                let why = no_answer.to_string();
                log(format!("invocation {seq} end after {took:.1} ms without an answer: {}", short(&why, 2000)));
                if let Some(reply) = q.reply {
                    let _ = reply.send(Err(short(&why, 300)));
                }
                let age = env.started.elapsed().as_secs_f64();
                env.function.kill().await;
                env = Environment::start(spec, api).await?;
                log(format!("{}: environment replaced (the last one lived {age:.1} s)", spec.name));
            }
        }
    }
    env.function.kill().await;
    Ok(())
}

/// The event EventBridge Scheduler sends for schedule `schedule` now (the shape of
/// `functions/reconcile/events/scheduled.json`).
pub fn scheduled_event(schedule: &str) -> serde_json::Value {
    json!({
        "version": "0",
        "id": ulid::Ulid::generate().to_string().to_lowercase(),
        "detail-type": "Scheduled Event",
        "source": "aws.scheduler",
        "account": ACCOUNT,
        "time": rfc3339_seconds(SystemTime::now()),
        "region": REGION,
        "resources": [format!("arn:aws:scheduler:{REGION}:{ACCOUNT}:schedule/default/{schedule}")],
        "detail": {}
    })
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
fn rfc3339_seconds(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduled_events_have_the_schedulers_shape() {
        let ev = scheduled_event("poolmgr-reconcile");
        assert_eq!(ev["source"], "aws.scheduler");
        assert_eq!(ev["detail-type"], "Scheduled Event");
        assert_eq!(
            ev["resources"][0],
            format!("arn:aws:scheduler:{REGION}:{ACCOUNT}:schedule/default/poolmgr-reconcile")
        );
        assert_ne!(ev["id"], scheduled_event("x")["id"], "a fresh id per event");
        assert_eq!(rfc3339_seconds(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(1_798_761_599)), "2026-12-31T23:59:59Z");
        assert_eq!(rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn summaries_fit_on_one_line() {
        let long = Outcome::Response(bytes::Bytes::from(format!("{{\"a\": \"{}\"}}\n", "x".repeat(2000))));
        let s = summary(&long);
        assert!(s.starts_with("response {\"a\": \"xxx") && s.ends_with('…') && !s.contains('\n'), "{s}");
        let err = Outcome::Error { error_type: "Retryable".into(), body: json!({"errorMessage": "db down"}) };
        assert_eq!(summary(&err), "error Retryable: db down");
    }
}
