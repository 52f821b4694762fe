//! The `microvmexec.services.api.v1alpha1.MicroVMExec` gRPC service of the
//! sim (shared/flintlock-api.md §5.8, §5.12): flintlockd's checks and error
//! texts, then a scripted outcome in place of the guest agent.

use std::pin::Pin;
use std::time::Duration;

use flintlock_proto::exec::exec_command_request::Payload as RequestPayload;
use flintlock_proto::exec::exec_command_response::Payload as ResponsePayload;
use flintlock_proto::exec::micro_vm_exec_server::MicroVmExec;
use flintlock_proto::exec::{ExecCommandRequest, ExecCommandResponse, ExecStart};
use flintlock_proto::types::micro_vm_status::MicroVmState;
use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use crate::service::SimService;
use crate::{DEFAULT_VERSION, METHOD_EXEC, Sim, vm_state};

/// The largest stdout / stderr chunk the guest agent sends (its pipe read size).
const MAX_CHUNK: usize = 32 * 1024;

/// Exit code after an `error` message (the command could not be set up).
pub const EXIT_SETUP_FAILED: i32 = 126;
/// Exit code of a command killed by the `timeout_seconds` SIGTERM (128 + 15).
pub const EXIT_TIMED_OUT: i32 = 143;

/// The scripted outcome of the commands matching a pattern
/// ([`Sim::set_exec_rule`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRule {
    /// Exit code sent at the end (non-zero is a normal result).
    pub exit_code: i32,
    /// Sent as `stdout` chunks (one per line, at most 32 KiB each) first.
    pub stdout: String,
    /// Sent as `stderr` chunks after stdout.
    pub stderr: String,
    /// Simulated run time between the output and the exit code. When the
    /// request's `timeout_seconds` is > 0 and shorter, the command is "killed"
    /// at the timeout instead and exits 143.
    pub duration: Duration,
    /// Some: the agent cannot set the command up; it sends this `error`
    /// message, then exit code 126 (no output, no duration).
    pub error: Option<String>,
    /// Some: after the output and the run time, the stream ends with UNAVAILABLE and this
    /// message instead of an exit code, as when the connection to flintlockd breaks
    /// mid-command (a flintlockd restart, a network blip).
    pub broken: Option<String>,
}

impl Default for ExecRule {
    fn default() -> Self {
        ExecRule {
            exit_code: 0,
            stdout: String::new(),
            stderr: String::new(),
            duration: Duration::ZERO,
            error: None,
            broken: None,
        }
    }
}

impl ExecRule {
    /// The rule of `--exec-rule PATTERN=EXIT_CODE` ([`Sim::set_exec_exit_code`](crate::Sim::set_exec_exit_code)):
    /// exit with `exit_code` at once; a non-zero one with a stderr line naming the rule.
    pub fn exit_code_rule(pattern: &str, exit_code: i32) -> ExecRule {
        let stderr = if exit_code == 0 {
            String::new()
        } else {
            format!("flintlock-sim: exit {exit_code} by --exec-rule {pattern}={exit_code}\n")
        };
        ExecRule { exit_code, stderr, ..ExecRule::default() }
    }
}

/// Parses the value of `--exec-rule`: `PATTERN=EXIT_CODE`, split at the last `=` (so a
/// pattern may contain `=`), the exit code 0-255. An empty pattern matches every command.
pub fn parse_exec_rule(spec: &str) -> Result<(String, i32), String> {
    let (pattern, code) = spec
        .rsplit_once('=')
        .ok_or_else(|| format!("--exec-rule {spec:?}: expected PATTERN=EXIT_CODE (e.g. setup=3)"))?;
    let code: i32 = code
        .parse()
        .ok()
        .filter(|c| (0..=255).contains(c))
        .ok_or_else(|| format!("--exec-rule {spec:?}: the exit code {code:?} must be a number from 0 to 255"))?;
    Ok((pattern.to_owned(), code))
}

/// One ExecCommand start as recorded by [`Sim::exec_calls`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecCall {
    /// The VM uid.
    pub uid: String,
    /// The command: `cmd`, plus `" "` and the `args` joined with spaces when
    /// there are any.
    pub cmd: String,
    pub shell: bool,
    pub timeout_seconds: i32,
}

/// Exec and ServerInfo settings and records, part of the sim's state.
#[derive(Debug)]
pub(crate) struct ExecState {
    pub(crate) enabled: bool,
    pub(crate) version: String,
    pub(crate) server_info_unimplemented: bool,
    pub(crate) guest_agent_delay: Duration,
    pub(crate) rules: Vec<(String, ExecRule)>,
    pub(crate) calls: Vec<ExecCall>,
    pub(crate) running: usize,
}

impl Default for ExecState {
    fn default() -> Self {
        ExecState {
            enabled: true,
            version: DEFAULT_VERSION.to_string(),
            server_info_unimplemented: false,
            guest_agent_delay: Duration::ZERO,
            rules: Vec::new(),
            calls: Vec::new(),
            running: 0,
        }
    }
}

/// Counts a running simulated command for [`Sim::exec_running`] while alive.
struct RunningGuard(Sim);

impl RunningGuard {
    fn new(sim: Sim) -> RunningGuard {
        sim.lock().exec.running += 1;
        RunningGuard(sim)
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.exec.running = inner.exec.running.saturating_sub(1);
    }
}

type ExecStream = Pin<Box<dyn Stream<Item = Result<ExecCommandResponse, Status>> + Send + 'static>>;

fn response(payload: ResponsePayload) -> Result<ExecCommandResponse, Status> {
    Ok(ExecCommandResponse { payload: Some(payload) })
}

/// Splits output like a pipe reader would deliver it: one chunk per line
/// (newline kept), lines longer than 32 KiB split further.
fn chunks(text: &str) -> Vec<Vec<u8>> {
    text.split_inclusive('\n').flat_map(|line| line.as_bytes().chunks(MAX_CHUNK).map(<[u8]>::to_vec)).collect()
}

fn command_line(start: &ExecStart) -> String {
    if start.args.is_empty() { start.cmd.clone() } else { format!("{} {}", start.cmd, start.args.join(" ")) }
}

/// Plays `rule` into `tx`; stops early when the client goes away.
async fn run(tx: mpsc::Sender<Result<ExecCommandResponse, Status>>, rule: ExecRule, timeout_seconds: i32) {
    if let Some(error) = rule.error {
        if tx.send(response(ResponsePayload::Error(error))).await.is_ok() {
            let _ = tx.send(response(ResponsePayload::ExitCode(EXIT_SETUP_FAILED))).await;
        }
        return;
    }
    let output = chunks(&rule.stdout)
        .into_iter()
        .map(ResponsePayload::Stdout)
        .chain(chunks(&rule.stderr).into_iter().map(ResponsePayload::Stderr));
    for payload in output {
        if tx.send(response(payload)).await.is_err() {
            return;
        }
    }
    let limit = u64::try_from(timeout_seconds).ok().filter(|s| *s > 0).map(Duration::from_secs);
    let (wait, exit_code) = match limit {
        Some(limit) if rule.duration > limit => (limit, EXIT_TIMED_OUT),
        _ => (rule.duration, rule.exit_code),
    };
    if !wait.is_zero() {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = tx.closed() => return,
        }
    }
    if let Some(message) = rule.broken {
        let _ = tx.send(Err(Status::unavailable(message))).await;
        return;
    }
    let _ = tx.send(response(ResponsePayload::ExitCode(exit_code))).await;
}

#[tonic::async_trait]
impl MicroVmExec for SimService {
    type ExecCommandStream = ExecStream;

    async fn exec_command(
        &self,
        request: Request<Streaming<ExecCommandRequest>>,
    ) -> Result<Response<Self::ExecCommandStream>, Status> {
        self.precheck_gated(METHOD_EXEC, request.metadata(), |inner| {
            (!inner.exec.enabled)
                .then(|| Status::unimplemented("unknown service microvmexec.services.api.v1alpha1.MicroVMExec"))
        })?;
        let mut stream = request.into_inner();

        // 1. The first message must be `start` with a uid and (cmd or shell).
        let first = match stream.message().await {
            Ok(Some(msg)) => msg,
            Ok(None) => return Err(Status::unknown("receiving exec start message: EOF")),
            Err(status) => {
                return Err(Status::unknown(format!("receiving exec start message: {}", status.message())));
            }
        };
        let start = match first.payload {
            Some(RequestPayload::Start(start)) if !start.uid.is_empty() && (!start.cmd.is_empty() || start.shell) => {
                start
            }
            _ => {
                return Err(Status::invalid_argument("first message must be a start message with uid and cmd set"));
            }
        };
        let uid = start.uid.clone();
        let command = command_line(&start);

        let rule = {
            let mut inner = self.sim.lock();
            // 2. Lookup, with GetMicroVM's error text.
            let Some(vm) = inner.vms.get(&uid) else {
                return Err(Status::unknown(format!(
                    "getting microvm: error attempting to locate microvm with uid: {uid}: microvm spec //{uid} not found"
                )));
            };
            // 3. Preconditions. (The sim fills vsock_path at boot, so the
            // state is checked before it to give pending VMs the state text.)
            let allow_guest_agent = vm.spec.as_ref().is_some_and(|s| s.allow_guest_agent);
            if !allow_guest_agent {
                return Err(Status::failed_precondition("microvm was not created with guest agent access enabled"));
            }
            let state = vm_state(vm);
            if state != MicroVmState::Created {
                let name = state.as_str_name().to_ascii_lowercase();
                return Err(Status::failed_precondition(format!("microvm is not ready (state: {name})")));
            }
            if vm.status.as_ref().is_none_or(|s| s.vsock_path.is_empty()) {
                return Err(Status::failed_precondition("microvm was not created with guest agent access enabled"));
            }
            inner.exec.calls.push(ExecCall {
                uid: uid.clone(),
                cmd: command.clone(),
                shell: start.shell,
                timeout_seconds: start.timeout_seconds,
            });
            // 4. Dialling the agent: not up yet for a while after boot.
            let delay = inner.exec.guest_agent_delay;
            if inner.booted_at.get(&uid).is_some_and(|at| at.elapsed() < delay) {
                tracing::debug!(%uid, "guest agent not up yet");
                return Err(Status::unknown(
                    "starting guest-agent exec session: dialling guest-agent control channel: \
                     guest agent: handshake read: EOF",
                ));
            }
            inner.exec.rules.iter().find(|(pattern, _)| command.contains(pattern.as_str())).map(|(_, r)| r.clone())
        }
        .unwrap_or_default();
        tracing::info!(%uid, %command, exit_code = rule.exit_code, "exec");

        // 5. The scripted command. Later client messages are never read
        // (stdin is not simulated), but the request stream is kept open
        // until the command ends, as flintlockd does.
        let (tx, mut rx) = mpsc::channel(8);
        let guard = RunningGuard::new(self.sim.clone());
        let timeout_seconds = start.timeout_seconds;
        tokio::spawn(async move {
            let _guard = guard;
            let _requests = stream;
            run(tx, rule, timeout_seconds).await;
        });
        let out: ExecStream = Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)));
        Ok(Response::new(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_lines_and_long_lines() {
        assert!(chunks("").is_empty());
        assert_eq!(chunks("a\nb\nc"), vec![b"a\n".to_vec(), b"b\n".to_vec(), b"c".to_vec()]);
        let long = "x".repeat(MAX_CHUNK + 10);
        let parts = chunks(&long);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].len(), MAX_CHUNK);
        assert_eq!(parts[1].len(), 10);
    }

    #[test]
    fn exec_rule_flags_parse_at_the_last_equals_sign() {
        assert_eq!(parse_exec_rule("setup=3"), Ok(("setup".to_owned(), 3)));
        assert_eq!(parse_exec_rule("FOO=bar baz=255"), Ok(("FOO=bar baz".to_owned(), 255)));
        assert_eq!(parse_exec_rule("=1"), Ok((String::new(), 1)), "an empty pattern matches every command");
        assert_eq!(parse_exec_rule("ok=0"), Ok(("ok".to_owned(), 0)));
        for bad in ["setup", "setup=", "setup=x", "setup=-1", "setup=256", "setup=3.0"] {
            assert!(parse_exec_rule(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_exit_code_rule_names_itself_on_stderr_when_it_fails() {
        let r = ExecRule::exit_code_rule("setup", 3);
        assert_eq!((r.exit_code, r.stderr.as_str()), (3, "flintlock-sim: exit 3 by --exec-rule setup=3\n"));
        assert_eq!(ExecRule::exit_code_rule("setup", 0), ExecRule::default());
    }

    #[test]
    fn command_line_joins_args() {
        let mut s = ExecStart { cmd: "echo".into(), ..Default::default() };
        assert_eq!(command_line(&s), "echo");
        s.args = vec!["a".into(), "b c".into()];
        assert_eq!(command_line(&s), "echo a b c");
    }
}
