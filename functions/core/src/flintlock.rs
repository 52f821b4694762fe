//! The flintlock client: one lazily connected channel per host, a timeout on every call,
//! optional TLS and basic-auth token.
//!
//! flintlock reports almost every failure as UNKNOWN with a text message; "not found" is
//! only recognisable by that substring. This module is the one place that reads it.
//! The channel cache is an optimisation only: nothing about correctness is kept here.
//!
//! Besides the MicroVM calls it speaks the newer APIs of shared/flintlock-api.md §5:
//! `ServerInfo` (flintlock v0.15.0+) with battery's exec version gate ([`exec_supported`]),
//! and `MicroVMExec/ExecCommand` ([`Flintlock::exec`], [`Flintlock::wait_ready`]). Both
//! stubs share the host's one channel and basic-auth header. Unary calls carry the
//! configured timeout as their gRPC deadline; an exec stream has its own (the command's
//! timeout + 5 s), which is why the timeout is not set on the channel itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use flintlock_proto::exec::exec_command_request::Payload as ExecRequestPayload;
use flintlock_proto::exec::exec_command_response::Payload as ExecResponsePayload;
use flintlock_proto::exec::micro_vm_exec_client::MicroVmExecClient;
use flintlock_proto::exec::{ExecCommandRequest, ExecStart};
use flintlock_proto::types as pb;
use flintlock_proto::v1alpha1 as api;
use flintlock_proto::v1alpha1::micro_vm_client::MicroVmClient;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

#[derive(Debug, thiserror::Error)]
pub enum FlintlockError {
    /// The host could not be reached or answered UNAVAILABLE / DEADLINE_EXCEEDED.
    #[error("flintlock host {host} unavailable: {message}")]
    Unavailable { host: String, message: String },
    /// The host answered with an error.
    #[error("flintlock host {host}: {code:?}: {message}")]
    Rpc { host: String, code: tonic::Code, message: String },
    /// The host's stored connection settings are unusable.
    #[error("flintlock host {host} is misconfigured: {message}")]
    Config { host: String, message: String },
    /// This function cannot open the host's stored secrets (it lacks the key the row names,
    /// or the row was altered; [`crate::credentials`]): nothing is wrong with the host or its
    /// VMs, so never a VM's failure nor an unreachable host.
    #[error("flintlock host {host}: {message}")]
    Credentials { host: String, message: String },
    /// The host's flintlockd lacks an API: UNIMPLEMENTED for ServerInfo (older than
    /// v0.15.0) or for ExecCommand (exec API not enabled).
    #[error("flintlock host {host} is unsupported: {message}")]
    Unsupported { host: String, message: String },
    /// The guest agent reported an `error` for an exec, or the exec stream ended
    /// without an exit code.
    #[error("exec on flintlock host {host} failed: {message}")]
    Exec { host: String, message: String },
}

impl FlintlockError {
    /// flintlock's "not found": UNKNOWN with that text (never the NOT_FOUND code).
    pub fn is_not_found(&self) -> bool {
        match self {
            FlintlockError::Rpc { code, message, .. } => {
                (*code == tonic::Code::Unknown || *code == tonic::Code::NotFound) && message.contains("not found")
            }
            _ => false,
        }
    }

    /// Whether the call failed in transit (the host could not be reached, the connection
    /// broke, the answer did not come in time) rather than being answered: retryable, and
    /// never a hook's failure (issue 23 finding 3). A create hook retries its step; a claim
    /// gives its VM back and answers 503.
    pub fn is_transport(&self) -> bool {
        matches!(self, FlintlockError::Unavailable { .. })
    }

    /// Whether this function could not open the host's stored secrets
    /// ([`FlintlockError::Credentials`]): retryable once the key is configured, and never
    /// the VM's failure.
    pub fn is_credentials(&self) -> bool {
        matches!(self, FlintlockError::Credentials { .. })
    }

    fn from_status(host: &str, s: tonic::Status) -> FlintlockError {
        match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                FlintlockError::Unavailable { host: host.to_owned(), message: s.message().to_owned() }
            }
            // The connection broke mid-call: tonic reports the HTTP/2 error as UNKNOWN. It is
            // the transport, not flintlock's answer (found by the fault campaign: a create
            // hook whose host was killed mid-command was quarantined).
            tonic::Code::Unknown if broken_connection(s.message()) => {
                FlintlockError::Unavailable { host: host.to_owned(), message: s.message().to_owned() }
            }
            tonic::Code::OutOfRange if s.message().contains("message length too large") => FlintlockError::Rpc {
                host: host.to_owned(),
                code: tonic::Code::OutOfRange,
                message: format!(
                    "{}: the host's answer is larger than poolmgr reads (32 MiB, about 50,000 microVMs); \
                     spread the VMs over more hosts",
                    s.message()
                ),
            },
            code => FlintlockError::Rpc { host: host.to_owned(), code, message: s.message().to_owned() },
        }
    }

    /// [`FlintlockError::from_status`] for ExecCommand: UNIMPLEMENTED means the exec API is off.
    fn from_exec_status(host: &str, s: tonic::Status) -> FlintlockError {
        if s.code() == tonic::Code::Unimplemented {
            return FlintlockError::Unsupported {
                host: host.to_owned(),
                message: format!("exec API disabled: start flintlockd with --enable-exec-api ({})", s.message()),
            };
        }
        FlintlockError::from_status(host, s)
    }

    /// Whether a failed readiness probe means "the guest agent is not up yet" (retry later)
    /// rather than a permanent problem. Like battery, every exec-level failure counts as not
    /// ready (flintlock's texts do not separate "agent still booting" from a broken agent),
    /// and so does an unreachable host or a VM that is not CREATED yet. A VM that is gone,
    /// has no guest agent, a disabled exec API or a misconfigured host are permanent.
    fn means_not_ready(&self) -> bool {
        match self {
            FlintlockError::Exec { .. } | FlintlockError::Unavailable { .. } => true,
            FlintlockError::Rpc { code: tonic::Code::Unknown, .. } => !self.is_not_found(),
            FlintlockError::Rpc { code: tonic::Code::FailedPrecondition, message, .. } => {
                message.contains("is not ready")
            }
            _ => false,
        }
    }
}

/// Whether an UNKNOWN status's text is hyper's or h2's for a connection that broke, rather
/// than an error flintlock sent.
fn broken_connection(message: &str) -> bool {
    // Not "connection reset" alone: flintlock says that of its own guest-agent session
    // ("reading guest-agent exec session: connection reset"), which is its answer.
    const TRANSPORT: [&str; 3] = ["h2 protocol error", "error reading a body from connection", "transport error"];
    let m = message.to_ascii_lowercase();
    TRANSPORT.iter().any(|t| m.contains(t))
}

/// What a host's `ServerInfo` says, as far as poolmgr cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// `version.version` as reported (e.g. `v0.15.2`, `v0.15.2-3-gabc1234`, `undefined`).
    pub version: String,
    /// `exec.enabled`: flintlockd runs with `--enable-exec-api`.
    pub exec_enabled: bool,
    /// The whole answer as decoded, for logs: should our guess of ServerInfo's unpublished
    /// field numbers be wrong, this shows where the values landed.
    pub response: String,
}

/// The oldest flintlock whose exec path battery trusts (the guest-agent socket path fix).
pub const MIN_EXEC_VERSION: (u64, u64, u64) = (0, 15, 2);

/// battery's exec gate on a host's [`ServerInfo`]: the version (a leading `v` added when
/// missing, cut at the first `-` or `+`, so `v0.15.2-3-gabc1234` counts as `v0.15.2`) must be
/// `major.minor.patch` semver at least [`MIN_EXEC_VERSION`], and the exec API must be
/// enabled. The error says why not.
pub fn exec_supported(info: &ServerInfo) -> Result<(), String> {
    let raw = info.version.trim();
    let with_v = if raw.starts_with('v') { raw.to_owned() } else { format!("v{raw}") };
    let core = with_v.split(['-', '+']).next().unwrap_or_default();
    let Some(version) = parse_semver_core(&core[1..]) else {
        return Err(format!("version {:?} is not semver (a build without version info)", info.version));
    };
    if version < MIN_EXEC_VERSION {
        let (major, minor, patch) = MIN_EXEC_VERSION;
        return Err(format!("flintlock {core} is older than v{major}.{minor}.{patch}"));
    }
    if !info.exec_enabled {
        return Err("exec API disabled: start flintlockd with --enable-exec-api".to_owned());
    }
    Ok(())
}

/// `MAJOR.MINOR.PATCH`, each a decimal number without leading zeros (semver's rule).
fn parse_semver_core(s: &str) -> Option<(u64, u64, u64)> {
    let number = |part: Option<&str>| -> Option<u64> {
        let part = part?;
        let digits = !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
        if !digits || (part.len() > 1 && part.starts_with('0')) {
            return None;
        }
        part.parse().ok()
    };
    let mut parts = s.split('.');
    let version = (number(parts.next())?, number(parts.next())?, number(parts.next())?);
    parts.next().is_none().then_some(version)
}

/// The result of a command run through the guest agent. A non-zero exit code is a result,
/// not an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutcome {
    pub exit_code: i32,
    /// The first [`EXEC_OUTPUT_CAP`] bytes of stdout (invalid UTF-8 replaced).
    pub stdout: String,
    /// The first [`EXEC_OUTPUT_CAP`] bytes of stderr (invalid UTF-8 replaced).
    pub stderr: String,
}

/// How much of a failed hook command's output [`hook_failure`] keeps: its end, where the
/// error usually is. A few KiB: the reason is stored in a `VM_HOOK_FAILED` event on every
/// failure and sent in a claim's error answer.
pub const HOOK_OUTPUT_TAIL: usize = 2048;

/// How much of the command itself [`hook_failure`] quotes (commands may be 4 KiB).
pub const HOOK_COMMAND_HEAD: usize = 256;

/// Why a hook command failed, `None` if it exited 0: the one description both hook paths use
/// (a pool's create hooks in the reconcile pass, its pre-lease hooks in a claim), stored in
/// `VM_HOOK_FAILED` and, for a claim, sent in its 500 answer.
///
/// Everything in it came from outside poolmgr (the command from the pool spec, the output from
/// the guest, the error from the host), so all of it goes through [`crate::domain::printable`]:
/// control characters escaped (a NUL made PostgreSQL refuse the event, which failed the pool's
/// reconcile step and reran the command every pass, or answered a claim 500 and stranded its
/// VM), the output cut to its last [`HOOK_OUTPUT_TAIL`] bytes (stderr, or stdout when stderr
/// is empty) and the command to [`HOOK_COMMAND_HEAD`].
pub fn hook_failure(command: &str, outcome: &Result<ExecOutcome, FlintlockError>) -> Option<String> {
    use crate::domain::{Keep, printable};
    let cmd = printable(command, HOOK_COMMAND_HEAD, Keep::Head);
    match outcome {
        Ok(o) if o.exit_code == 0 => None,
        Ok(o) => {
            let output = [o.stderr.trim(), o.stdout.trim()].into_iter().find(|t| !t.is_empty());
            let output =
                output.map(|t| format!(": {}", printable(t, HOOK_OUTPUT_TAIL, Keep::Tail))).unwrap_or_default();
            Some(format!("`{cmd}` exited with {}{output}", o.exit_code))
        }
        Err(e) => Some(format!("`{cmd}` could not run: {}", printable(&e.to_string(), HOOK_OUTPUT_TAIL, Keep::Head))),
    }
}

/// How much of each of stdout and stderr [`Flintlock::exec`] keeps.
pub const EXEC_OUTPUT_CAP: usize = 64 * 1024;

/// How long a connection to a flintlock host may take to open, at most (the call's own
/// timeout when shorter).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What the client deadline of an exec adds to the command's timeout.
pub const EXEC_DEADLINE_SLACK: Duration = Duration::from_secs(5);

/// Appends `chunk` to `buf`, keeping at most [`EXEC_OUTPUT_CAP`] bytes.
fn push_capped(buf: &mut Vec<u8>, chunk: &[u8]) {
    let room = EXEC_OUTPUT_CAP.saturating_sub(buf.len());
    buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
}

/// `timeout` rounded up to whole seconds, for `ExecStart.timeout_seconds` (0 = no limit).
fn timeout_seconds(timeout: Duration) -> i32 {
    let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

type AuthHeader = Option<MetadataValue<tonic::metadata::Ascii>>;

/// Adds `authorization: Basic <base64(token)>` when the host has a token, and gives
/// requests without a deadline of their own the default one (unary calls).
#[derive(Clone)]
pub struct BasicAuth {
    header: AuthHeader,
    default_timeout: Option<Duration>,
}

impl Interceptor for BasicAuth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.header {
            req.metadata_mut().insert("authorization", v.clone());
        }
        if let Some(t) = self.default_timeout
            && req.metadata().get("grpc-timeout").is_none()
        {
            req.set_timeout(t);
        }
        Ok(req)
    }
}

pub type Client = MicroVmClient<InterceptedService<Channel, BasicAuth>>;

/// The largest answer read from a host. gRPC's default (4 MiB) is a `ListMicroVMs` of about
/// 6,000 VMs: a host of 25,000 answered 16 MiB, and the orphan scan and `poolmgr-check` failed
/// on it with OutOfRange. flintlock (Go gRPC) sends answers of any size. 32 MiB is about 50,000
/// VMs per host, and decoded a few times that in memory: it must fit a 256 MB function with
/// room to spare (it was 256 MiB, which a host could answer to exhaust the function; issue 25
/// item 11). A larger answer fails the call with OutOfRange and says so.
pub const MAX_RESPONSE_BYTES: usize = 32 << 20;
pub type ExecClient = MicroVmExecClient<InterceptedService<Channel, BasicAuth>>;

/// Where and how to reach one flintlock host: all the client knows of a host, nothing of the
/// database (`store::HostRow::endpoint` builds one from a host's row). A changed endpoint
/// (a host update) rebuilds the host's cached channel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The host's registered name: names it in errors and keys the channel cache.
    pub name: String,
    /// `host:port` of flintlockd's gRPC API, no scheme.
    pub address: String,
    /// Plaintext gRPC (`http://`); otherwise TLS with the system roots and `ca_pem`.
    pub tls_insecure: bool,
    pub ca_pem: Option<String>,
    /// Client certificate and key for mutual TLS, used together.
    pub cert_pem: Option<String>,
    /// The key as the host's row stores it: sealed when `credentials_key_id` is set
    /// ([`crate::credentials`]); opened only when the channel is built.
    pub key_pem: Option<String>,
    /// flintlockd's basic-auth token, sent as `Authorization: Basic base64(token)`; stored
    /// as `key_pem` is.
    pub basic_auth_token: Option<String>,
    /// The key-encryption key's id and the wrapped data key of a sealed row (V24); `None`:
    /// the secrets above are plaintext (a row from before encryption, or a test's).
    pub credentials_key_id: Option<String>,
    pub credentials_dek: Option<String>,
}

/// One host's cache entry: the settings it was built from, the channel and the auth header.
type CachedChannel = (Endpoint, Channel, AuthHeader);

/// Told of every failed call: the host's name and the gRPC method (`CreateMicroVM`, …).
pub type ErrorObserver = Arc<dyn Fn(&str, &str) + Send + Sync>;

#[derive(Clone)]
pub struct Flintlock {
    timeout: Duration,
    channels: Arc<Mutex<HashMap<String, CachedChannel>>>,
    on_error: Option<ErrorObserver>,
    /// The largest answer read ([`MAX_RESPONSE_BYTES`]).
    max_response: usize,
    /// Opens hosts' sealed secrets when a channel is built ([`Flintlock::with_keyring`]).
    keyring: Arc<crate::credentials::Keyring>,
}

impl Flintlock {
    pub fn new(timeout: Duration) -> Flintlock {
        Flintlock {
            timeout,
            channels: Arc::default(),
            on_error: None,
            max_response: MAX_RESPONSE_BYTES,
            keyring: Arc::default(),
        }
    }

    /// The same client, opening hosts' sealed secrets with `keyring` (`Config::credentials`).
    /// Without it, a host whose row is sealed cannot be reached (a configuration error, never
    /// taken for an unreachable host).
    pub fn with_keyring(self, keyring: Arc<crate::credentials::Keyring>) -> Flintlock {
        Flintlock { keyring, ..self }
    }

    /// The same client reading answers of at most `bytes` (tests; [`MAX_RESPONSE_BYTES`]
    /// otherwise).
    pub fn with_max_response(self, bytes: usize) -> Flintlock {
        Flintlock { max_response: bytes, ..self }
    }

    /// The same client, telling `observer` of every failed call (the metrics'
    /// `poolmgr_flintlock_errors_total`). A failure is an `Err` from one of the call
    /// methods below; a VM flintlock does not know, where the method treats that as an
    /// answer (`get`, `delete`), and a command's non-zero exit code are not failures, nor is
    /// a readiness probe that finds the guest agent not up yet ([`Flintlock::wait_ready`]).
    pub fn with_error_observer(self, observer: ErrorObserver) -> Flintlock {
        Flintlock { on_error: Some(observer), ..self }
    }

    /// Passes `result` through, telling the observer when it is an error.
    fn observed<T>(
        &self,
        host: &Endpoint,
        method: &str,
        result: Result<T, FlintlockError>,
    ) -> Result<T, FlintlockError> {
        if let (Err(_), Some(observe)) = (&result, &self.on_error) {
            observe(&host.name, method);
        }
        result
    }

    /// A lazily connecting channel and the auth header for `host`. No per-request timeout
    /// on the channel: the interceptor sets one on unary calls, exec sets its own.
    fn build(&self, host: &Endpoint) -> Result<(Channel, AuthHeader), FlintlockError> {
        let cfg_err = |message: String| FlintlockError::Config { host: host.name.clone(), message };
        let stored = crate::credentials::Stored {
            key_pem: host.key_pem.clone(),
            basic_auth_token: host.basic_auth_token.clone(),
            key_id: host.credentials_key_id.clone(),
            dek: host.credentials_dek.clone(),
        };
        let secrets = self
            .keyring
            .open(&host.name, &stored)
            .map_err(|e| FlintlockError::Credentials { host: host.name.clone(), message: e.to_string() })?;
        let scheme = if host.tls_insecure { "http" } else { "https" };
        let mut ep = tonic::transport::Endpoint::from_shared(format!("{scheme}://{}", host.address))
            .map_err(|e| cfg_err(format!("address {:?}: {e}", host.address)))?
            // A connect that has not completed in a couple of seconds is an answer too: the
            // host is unreachable (issue 23 finding 2), whatever the call's own timeout.
            .connect_timeout(self.timeout.min(CONNECT_TIMEOUT));
        if !host.tls_insecure {
            let mut tls = ClientTlsConfig::new().with_enabled_roots();
            if let Some(ca) = &host.ca_pem {
                tls = tls.ca_certificate(Certificate::from_pem(ca));
            }
            if let (Some(cert), Some(key)) = (&host.cert_pem, &secrets.key_pem) {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            ep = ep.tls_config(tls).map_err(|e| cfg_err(format!("TLS settings: {e}")))?;
        }
        let auth = match &secrets.basic_auth_token {
            None => None,
            Some(t) => {
                let v = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(t));
                Some(v.parse().map_err(|_| cfg_err("basic_auth_token is not valid header text".into()))?)
            }
        };
        Ok((ep.connect_lazy(), auth))
    }

    /// The cached channel and auth header for `host`, rebuilt when its settings changed.
    fn channel(&self, host: &Endpoint) -> Result<(Channel, AuthHeader), FlintlockError> {
        let key = host.clone();
        let mut map = self.channels.lock().expect("channel cache poisoned");
        if let Some((k, channel, auth)) = map.get(&host.name)
            && *k == key
        {
            return Ok((channel.clone(), auth.clone()));
        }
        let (channel, auth) = self.build(host)?;
        map.insert(host.name.clone(), (key, channel.clone(), auth.clone()));
        Ok((channel, auth))
    }

    /// The MicroVM client for `host` on its cached channel; every call gets the configured
    /// timeout as its deadline unless the request sets one.
    pub fn client(&self, host: &Endpoint) -> Result<Client, FlintlockError> {
        let (channel, header) = self.channel(host)?;
        Ok(MicroVmClient::with_interceptor(channel, BasicAuth { header, default_timeout: Some(self.timeout) })
            .max_decoding_message_size(self.max_response))
    }

    /// The MicroVMExec client for `host` on the same cached channel, without a default
    /// deadline (a stream lasts as long as its command; set one per request).
    pub fn exec_client(&self, host: &Endpoint) -> Result<ExecClient, FlintlockError> {
        let (channel, header) = self.channel(host)?;
        Ok(MicroVmExecClient::with_interceptor(channel, BasicAuth { header, default_timeout: None })
            .max_decoding_message_size(self.max_response))
    }

    /// `MicroVM/ServerInfo`. UNIMPLEMENTED (flintlock older than v0.15.0) becomes
    /// [`FlintlockError::Unsupported`]; any other failure is returned as usual.
    pub async fn server_info(&self, host: &Endpoint) -> Result<ServerInfo, FlintlockError> {
        let result = self.server_info_call(host).await;
        self.observed(host, "ServerInfo", result)
    }

    async fn server_info_call(&self, host: &Endpoint) -> Result<ServerInfo, FlintlockError> {
        match self.client(host)?.server_info(()).await {
            Ok(resp) => {
                let resp = resp.into_inner();
                let response = format!("{resp:?}");
                Ok(ServerInfo {
                    version: resp.version.map(|v| v.version).unwrap_or_default(),
                    exec_enabled: resp.exec.is_some_and(|e| e.enabled),
                    response,
                })
            }
            Err(s) if s.code() == tonic::Code::Unimplemented => Err(FlintlockError::Unsupported {
                host: host.name.clone(),
                message: "flintlock older than v0.15.0 (no ServerInfo)".to_owned(),
            }),
            Err(s) => Err(FlintlockError::from_status(&host.name, s)),
        }
    }

    /// Runs `command` in VM `uid` through the guest agent, the way battery's hook runner
    /// does: one `start` message (`shell = true`, the whole command in `cmd`,
    /// `timeout_seconds` = `timeout` rounded up to whole seconds, 0 = no guest-side limit),
    /// then an immediate half-close. stdout/stderr are collected (each capped at
    /// [`EXEC_OUTPUT_CAP`]) until `exit_code`, which is returned whatever its value.
    ///
    /// - An `error` message from the agent → [`FlintlockError::Exec`] at once (the exit code
    ///   that follows it is not awaited).
    /// - The stream ending without an exit code → [`FlintlockError::Exec`].
    /// - UNIMPLEMENTED (exec API off) → [`FlintlockError::Unsupported`]; other RPC errors
    ///   (unknown uid, FAILED_PRECONDITION, agent not up) as [`FlintlockError::Rpc`].
    /// - The whole call is bounded by `timeout` + [`EXEC_DEADLINE_SLACK`] →
    ///   [`FlintlockError::Unavailable`].
    ///
    /// Returning (or dropping the future) cancels the stream, which stops the command.
    pub async fn exec(
        &self,
        host: &Endpoint,
        uid: &str,
        command: &str,
        timeout: Duration,
    ) -> Result<ExecOutcome, FlintlockError> {
        let result = self.exec_call(host, uid, command, timeout).await;
        self.observed(host, "ExecCommand", result)
    }

    /// [`Flintlock::exec`] without telling the error observer.
    async fn exec_call(
        &self,
        host: &Endpoint,
        uid: &str,
        command: &str,
        timeout: Duration,
    ) -> Result<ExecOutcome, FlintlockError> {
        let deadline = timeout.saturating_add(EXEC_DEADLINE_SLACK);
        let mut client = self.exec_client(host)?;
        let start = ExecCommandRequest {
            payload: Some(ExecRequestPayload::Start(ExecStart {
                uid: uid.to_owned(),
                cmd: command.to_owned(),
                shell: true,
                timeout_seconds: timeout_seconds(timeout),
                ..Default::default()
            })),
        };
        let name = host.name.as_str();
        let exec_err = |message: String| FlintlockError::Exec { host: name.to_owned(), message };
        let call = async {
            // The request stream yields the start message and ends: that is the half-close.
            let mut req = tonic::Request::new(futures::stream::iter([start]));
            req.set_timeout(deadline);
            let mut stream =
                client.exec_command(req).await.map_err(|s| FlintlockError::from_exec_status(name, s))?.into_inner();
            let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
            loop {
                let Some(msg) = stream.message().await.map_err(|s| FlintlockError::from_exec_status(name, s))? else {
                    return Err(exec_err("exec stream ended without an exit code".to_owned()));
                };
                match msg.payload {
                    Some(ExecResponsePayload::Stdout(chunk)) => push_capped(&mut stdout, &chunk),
                    Some(ExecResponsePayload::Stderr(chunk)) => push_capped(&mut stderr, &chunk),
                    Some(ExecResponsePayload::Error(message)) => return Err(exec_err(message)),
                    Some(ExecResponsePayload::ExitCode(exit_code)) => {
                        return Ok(ExecOutcome {
                            exit_code,
                            stdout: String::from_utf8_lossy(&stdout).into_owned(),
                            stderr: String::from_utf8_lossy(&stderr).into_owned(),
                        });
                    }
                    None => {}
                }
            }
        };
        match tokio::time::timeout(deadline, call).await {
            Ok(result) => result,
            Err(_) => Err(FlintlockError::Unavailable {
                host: host.name.clone(),
                message: format!("exec did not finish within its client deadline of {deadline:?}"),
            }),
        }
    }

    /// One readiness probe of VM `uid`'s guest agent: `exec("true")`, bounded by
    /// `per_attempt`. `Ok(true)` when an exit code (any value) arrives without an `error`
    /// message first; `Ok(false)` when the agent is not ready yet (agent error, handshake
    /// failure, VM not CREATED yet, attempt timed out): the caller retries on a later step,
    /// this never loops. `Err` with a [`FlintlockError::is_transport`] error when the host
    /// could not be reached (retry later, and not the agent's fault); any other `Err` for what
    /// retrying will not fix: the VM is gone ([`FlintlockError::is_not_found`]), was created
    /// without guest agent access, the exec API is disabled ([`FlintlockError::Unsupported`]),
    /// or the host is misconfigured.
    pub async fn wait_ready(&self, host: &Endpoint, uid: &str, per_attempt: Duration) -> Result<bool, FlintlockError> {
        let result = match tokio::time::timeout(per_attempt, self.exec_call(host, uid, "true", per_attempt)).await {
            Err(_) => Ok(false),
            Ok(Ok(_)) => Ok(true),
            // Not the agent's answer: the caller must not count it against the agent.
            Ok(Err(e)) if e.is_transport() => Err(e),
            Ok(Err(e)) if e.means_not_ready() => Ok(false),
            Ok(Err(e)) => Err(e),
        };
        self.observed(host, "ExecCommand", result)
    }

    pub async fn create(&self, host: &Endpoint, spec: pb::MicroVmSpec) -> Result<pb::MicroVm, FlintlockError> {
        let result = self.create_call(host, spec).await;
        self.observed(host, "CreateMicroVM", result)
    }

    async fn create_call(&self, host: &Endpoint, spec: pb::MicroVmSpec) -> Result<pb::MicroVm, FlintlockError> {
        let resp = self
            .client(host)?
            .create_micro_vm(api::CreateMicroVmRequest { microvm: Some(spec), metadata: Default::default() })
            .await
            .map_err(|s| FlintlockError::from_status(&host.name, s))?;
        resp.into_inner().microvm.ok_or_else(|| FlintlockError::Rpc {
            host: host.name.clone(),
            code: tonic::Code::Internal,
            message: "CreateMicroVM answered without a microvm".into(),
        })
    }

    /// Gets a VM by uid; `Ok(None)` when flintlock says it is not found.
    pub async fn get(&self, host: &Endpoint, uid: &str) -> Result<Option<pb::MicroVm>, FlintlockError> {
        let result = match self.client(host) {
            Err(e) => Err(e),
            Ok(mut c) => match c.get_micro_vm(api::GetMicroVmRequest { uid: uid.to_owned() }).await {
                Ok(r) => Ok(r.into_inner().microvm),
                Err(s) => {
                    let e = FlintlockError::from_status(&host.name, s);
                    if e.is_not_found() { Ok(None) } else { Err(e) }
                }
            },
        };
        self.observed(host, "GetMicroVM", result)
    }

    /// Deletes a VM by uid. A VM flintlock no longer knows counts as deleted.
    pub async fn delete(&self, host: &Endpoint, uid: &str) -> Result<(), FlintlockError> {
        let result = match self.client(host) {
            Err(e) => Err(e),
            Ok(mut c) => match c.delete_micro_vm(api::DeleteMicroVmRequest { uid: uid.to_owned() }).await {
                Ok(_) => Ok(()),
                Err(s) => {
                    let e = FlintlockError::from_status(&host.name, s);
                    if e.is_not_found() { Ok(()) } else { Err(e) }
                }
            },
        };
        self.observed(host, "DeleteMicroVM", result)
    }

    /// Lists VMs in `namespace` (all namespaces when empty), optionally only those named `name`.
    pub async fn list(
        &self,
        host: &Endpoint,
        namespace: &str,
        name: Option<&str>,
    ) -> Result<Vec<pb::MicroVm>, FlintlockError> {
        let result = self.list_call(host, namespace, name).await;
        self.observed(host, "ListMicroVMs", result)
    }

    async fn list_call(
        &self,
        host: &Endpoint,
        namespace: &str,
        name: Option<&str>,
    ) -> Result<Vec<pb::MicroVm>, FlintlockError> {
        let resp = self
            .client(host)?
            .list_micro_v_ms(api::ListMicroVMsRequest {
                namespace: namespace.to_owned(),
                name: name.map(str::to_owned),
            })
            .await
            .map_err(|s| FlintlockError::from_status(&host.name, s))?;
        Ok(resp.into_inner().microvm)
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, Ordering};

    use flintlock_proto::exec::ExecCommandResponse;
    use flintlock_proto::exec::micro_vm_exec_server::{MicroVmExec, MicroVmExecServer};
    use futures::{Stream, StreamExt};

    use super::*;

    fn info(version: &str, exec_enabled: bool) -> ServerInfo {
        ServerInfo { version: version.to_owned(), exec_enabled, response: String::new() }
    }

    /// Issue 14 item 8: the one description of a failed hook command escapes control
    /// characters everywhere and keeps only the end of the output.
    #[test]
    fn hook_failure_is_printable_and_keeps_the_end_of_the_output() {
        let out = |exit_code, stdout: &str, stderr: &str| {
            Ok(ExecOutcome { exit_code, stdout: stdout.to_owned(), stderr: stderr.to_owned() })
        };
        assert_eq!(hook_failure("true", &out(0, "", "noise")), None);
        assert_eq!(hook_failure("x", &out(2, "", "")).as_deref(), Some("`x` exited with 2"));
        assert_eq!(
            hook_failure("x", &out(2, "only\0stdout\n", " \n")).as_deref(),
            Some("`x` exited with 2: only\\x00stdout")
        );
        assert_eq!(
            hook_failure("a\rb", &out(1, "ignored", "bad\0\x1b[31m\n")).as_deref(),
            Some("`a\\x0db` exited with 1: bad\\x00\\x1b[31m")
        );
        let flood = format!("{}THE END", "\0".repeat(64 * 1024));
        let long = hook_failure(&"c".repeat(4096), &out(1, "", &flood)).unwrap();
        assert!(long.len() <= HOOK_COMMAND_HEAD + HOOK_OUTPUT_TAIL + 64, "{}", long.len());
        assert!(long.ends_with("\\x00THE END") && long.contains("…"), "{long}");
        assert!(!long.chars().any(|c| c.is_control()));
        let err = FlintlockError::Exec { host: "h".into(), message: "no\0agent".into() };
        assert_eq!(
            hook_failure("x", &Err(err)).as_deref(),
            Some("`x` could not run: exec on flintlock host h failed: no\\x00agent")
        );
    }

    #[test]
    fn exec_gate_accepts_new_enough_versions() {
        for v in
            ["v0.15.2", "0.15.2", "v0.15.3", "v0.16.0", "v1.0.0", "v0.15.2-3-gabc1234", "v0.15.2+build.7", "v0.15.10"]
        {
            assert_eq!(exec_supported(&info(v, true)), Ok(()), "{v}");
        }
    }

    #[test]
    fn exec_gate_rejects_old_versions() {
        assert_eq!(exec_supported(&info("v0.14.1", true)), Err("flintlock v0.14.1 is older than v0.15.2".to_owned()));
        assert_eq!(exec_supported(&info("0.15.1", true)), Err("flintlock v0.15.1 is older than v0.15.2".to_owned()));
        assert_eq!(
            exec_supported(&info("v0.15.1-9-gdeadbee", true)),
            Err("flintlock v0.15.1 is older than v0.15.2".to_owned())
        );
        assert!(exec_supported(&info("v0.9.99", true)).unwrap_err().contains("older than v0.15.2"));
    }

    #[test]
    fn exec_gate_rejects_non_semver() {
        assert_eq!(
            exec_supported(&info("undefined", true)),
            Err("version \"undefined\" is not semver (a build without version info)".to_owned())
        );
        for v in ["", "v", "v0.15", "v0.15.2.1", "v0.15.x", "v01.15.2", "v0.015.2", "V0.15.2", "vv0.15.2", "v-0.15.2"] {
            let err = exec_supported(&info(v, true)).unwrap_err();
            assert!(err.contains("is not semver"), "{v}: {err}");
        }
    }

    #[test]
    fn exec_gate_needs_the_exec_api() {
        assert_eq!(
            exec_supported(&info("v0.16.0", false)),
            Err("exec API disabled: start flintlockd with --enable-exec-api".to_owned())
        );
        // The version is checked first.
        assert!(exec_supported(&info("v0.14.0", false)).unwrap_err().contains("older than"));
    }

    #[test]
    fn a_broken_connection_reported_as_unknown_is_a_transport_error() {
        let broken = tonic::Status::unknown("h2 protocol error: error reading a body from connection");
        assert!(FlintlockError::from_status("h", broken).is_transport());
        let answered = tonic::Status::unknown("getting microvm: microvm spec //X not found");
        assert!(!FlintlockError::from_status("h", answered).is_transport());
    }

    #[test]
    fn timeout_rounds_up_to_whole_seconds() {
        assert_eq!(timeout_seconds(Duration::ZERO), 0);
        assert_eq!(timeout_seconds(Duration::from_millis(1)), 1);
        assert_eq!(timeout_seconds(Duration::from_secs(5)), 5);
        assert_eq!(timeout_seconds(Duration::from_millis(5001)), 6);
        assert_eq!(timeout_seconds(Duration::from_secs(u64::MAX)), i32::MAX);
    }

    #[test]
    fn output_is_capped() {
        let mut buf = Vec::new();
        push_capped(&mut buf, &vec![b'a'; EXEC_OUTPUT_CAP - 1]);
        push_capped(&mut buf, b"bcd");
        push_capped(&mut buf, b"e");
        assert_eq!(buf.len(), EXEC_OUTPUT_CAP);
        assert_eq!(buf.last(), Some(&b'b'));
    }

    #[test]
    fn not_ready_classification() {
        let rpc = |code, message: &str| FlintlockError::Rpc { host: "h".into(), code, message: message.into() };
        let unknown = "starting guest-agent exec session: dialling guest-agent control channel: handshake read: EOF";
        assert!(rpc(tonic::Code::Unknown, unknown).means_not_ready());
        assert!(rpc(tonic::Code::FailedPrecondition, "microvm is not ready (state: pending)").means_not_ready());
        assert!(FlintlockError::Exec { host: "h".into(), message: "boom".into() }.means_not_ready());
        assert!(FlintlockError::Unavailable { host: "h".into(), message: "down".into() }.means_not_ready());
        let gone = rpc(tonic::Code::Unknown, "getting microvm: microvm spec //X not found");
        assert!(gone.is_not_found() && !gone.means_not_ready());
        assert!(
            !rpc(tonic::Code::FailedPrecondition, "microvm was not created with guest agent access enabled")
                .means_not_ready()
        );
        assert!(!FlintlockError::Unsupported { host: "h".into(), message: "off".into() }.means_not_ready());
        assert!(!rpc(tonic::Code::Unauthenticated, "bad token").means_not_ready());
    }

    #[test]
    fn interceptor_sets_auth_and_a_default_deadline() {
        let mut auth =
            BasicAuth { header: Some("Basic dG9r".parse().unwrap()), default_timeout: Some(Duration::from_secs(3)) };
        let req = auth.call(tonic::Request::new(())).unwrap();
        assert_eq!(req.metadata().get("authorization").unwrap(), "Basic dG9r");
        assert_eq!(req.metadata().get("grpc-timeout").unwrap(), "3000000u");
        // A request's own deadline wins.
        let mut own = tonic::Request::new(());
        own.set_timeout(Duration::from_secs(60));
        let req = auth.call(own).unwrap();
        assert_eq!(req.metadata().get("grpc-timeout").unwrap(), "60000000u");
        // The exec client's interceptor adds no deadline.
        let mut exec = BasicAuth { header: None, default_timeout: None };
        let req = exec.call(tonic::Request::new(())).unwrap();
        assert!(req.metadata().get("authorization").is_none() && req.metadata().get("grpc-timeout").is_none());
    }

    /// How a [`Scripted`] exec stream ends after its messages.
    #[derive(Clone, Copy)]
    enum End {
        /// OK without an exit code.
        Eof,
        /// Never ends (only the client can end it).
        Hang,
        /// UNKNOWN, as when flintlockd loses the guest-agent session.
        Unknown,
    }

    /// An exec server that plays fixed messages: the paths the simulator does not script.
    struct Scripted {
        messages: Vec<ExecResponsePayload>,
        end: End,
        /// Set when the response stream is dropped (the client cancelled or it ended).
        dropped: Arc<AtomicBool>,
    }

    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    type ScriptedStream = Pin<Box<dyn Stream<Item = Result<ExecCommandResponse, tonic::Status>> + Send>>;

    #[tonic::async_trait]
    impl MicroVmExec for Scripted {
        type ExecCommandStream = ScriptedStream;

        async fn exec_command(
            &self,
            _request: tonic::Request<tonic::Streaming<ExecCommandRequest>>,
        ) -> Result<tonic::Response<ScriptedStream>, tonic::Status> {
            let head = futures::stream::iter(
                self.messages.clone().into_iter().map(|p| Ok(ExecCommandResponse { payload: Some(p) })),
            );
            let tail: ScriptedStream = match self.end {
                End::Eof => Box::pin(futures::stream::empty()),
                End::Hang => Box::pin(futures::stream::pending()),
                End::Unknown => Box::pin(futures::stream::once(async {
                    Err(tonic::Status::unknown("reading guest-agent exec session: connection reset"))
                })),
            };
            let flag = DropFlag(self.dropped.clone());
            let stream = head.chain(tail).map(move |item| {
                let _alive = &flag;
                item
            });
            Ok(tonic::Response::new(Box::pin(stream)))
        }
    }

    async fn scripted_host(messages: Vec<ExecResponsePayload>, end: End) -> (Endpoint, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        let svc = MicroVmExecServer::new(Scripted { messages, end, dropped: dropped.clone() });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let host = Endpoint {
            name: "scripted".into(),
            address: addr.to_string(),
            tls_insecure: true,
            ca_pem: None,
            cert_pem: None,
            key_pem: None,
            basic_auth_token: None,
            credentials_key_id: None,
            credentials_dek: None,
        };
        (host, dropped)
    }

    #[tokio::test]
    async fn exec_stream_ending_without_exit_code_is_an_exec_error() {
        let (host, _) = scripted_host(vec![ExecResponsePayload::Stdout(b"partial".to_vec())], End::Eof).await;
        let fl = Flintlock::new(Duration::from_secs(3));
        match fl.exec(&host, "uid", "true", Duration::from_secs(10)).await {
            Err(FlintlockError::Exec { host, message }) => {
                assert_eq!(host, "scripted");
                assert!(message.contains("without an exit code"), "{message}");
            }
            other => panic!("expected an exec error, got {other:?}"),
        }
        // Not ready, for a readiness probe.
        assert!(!fl.wait_ready(&host, "uid", Duration::from_secs(1)).await.unwrap());
    }

    #[tokio::test]
    async fn exec_error_message_returns_at_once_and_cancels() {
        let (host, dropped) = scripted_host(
            vec![ExecResponsePayload::Stdout(b"x".to_vec()), ExecResponsePayload::Error("start: no such file".into())],
            End::Hang,
        )
        .await;
        let fl = Flintlock::new(Duration::from_secs(3));
        let t = std::time::Instant::now();
        match fl.exec(&host, "uid", "missing-binary", Duration::from_secs(60)).await {
            Err(FlintlockError::Exec { message, .. }) => assert_eq!(message, "start: no such file"),
            other => panic!("expected an exec error, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5), "did not wait for an exit code");
        // Returning cancelled the stream on the server.
        for _ in 0..100 {
            if dropped.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(dropped.load(Ordering::SeqCst), "server stream still alive after the client returned");
    }

    #[tokio::test]
    async fn exec_stream_failure_is_an_rpc_error() {
        let (host, _) = scripted_host(vec![ExecResponsePayload::Stderr(b"e".to_vec())], End::Unknown).await;
        let fl = Flintlock::new(Duration::from_secs(3));
        match fl.exec(&host, "uid", "true", Duration::from_secs(10)).await {
            Err(e @ FlintlockError::Rpc { code: tonic::Code::Unknown, .. }) => {
                assert!(e.to_string().contains("reading guest-agent exec session"), "{e}");
                assert!(!e.is_not_found());
            }
            other => panic!("expected UNKNOWN, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn exec_hang_is_bounded_by_the_client_deadline() {
        let (host, dropped) = scripted_host(vec![], End::Hang).await;
        let fl = Flintlock::new(Duration::from_secs(3));
        let t = std::time::Instant::now();
        // timeout 0: no guest-side limit, client deadline 0 + 5 s.
        match fl.exec(&host, "uid", "sleep infinity", Duration::ZERO).await {
            Err(FlintlockError::Unavailable { .. }) => {}
            other => panic!("expected the deadline, got {other:?}"),
        }
        let took = t.elapsed();
        assert!(took >= EXEC_DEADLINE_SLACK && took < EXEC_DEADLINE_SLACK + Duration::from_secs(3), "{took:?}");
        for _ in 0..100 {
            if dropped.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(dropped.load(Ordering::SeqCst));
        // A probe gives up after its own per-attempt bound, as "not ready".
        let t = std::time::Instant::now();
        assert!(!fl.wait_ready(&host, "uid", Duration::from_millis(200)).await.unwrap());
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
