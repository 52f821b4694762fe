//! A faithful fake flintlock (`flintlockd`) gRPC server.
//!
//! It serves `microvm.services.api.v1alpha1.MicroVM` over plaintext HTTP/2 and
//! mimics the behaviour described in `shared/flintlock-api.md` §2–§3:
//! flintlock-shaped UNKNOWN errors, server-minted ULID uids, duplicate
//! (namespace, id) pairs, dropped labels, the firecracker `eth0` injection,
//! `meta-data` injection, a background PENDING → CREATED transition, Delete →
//! DELETING → gone, shuffled List order, and optional basic-token auth.
//!
//! It also serves the newer APIs of §5: `MicroVM/ServerInfo` (configurable
//! version, or UNIMPLEMENTED like flintlock < v0.15.0) and the bidi-streaming
//! `microvmexec.services.api.v1alpha1.MicroVMExec/ExecCommand`, whose outcomes
//! are scripted with [`Sim::set_exec_rule`] (exit code, output, duration,
//! agent error) or, as the binary's `--exec-rule PATTERN=EXIT_CODE` does, with
//! [`Sim::set_exec_exit_code`], plus a guest agent that is not up for a while after boot
//! ([`Sim::set_guest_agent_delay`]) and a switch to disable exec altogether.
//!
//! Tests run it in-process with [`Sim::serve`] on `127.0.0.1:0` and steer it
//! through the failure-injection and inspection methods on [`Sim`]; the
//! `flintlock-sim` binary serves it for the local dev stack.
//!
//! Records created through [`Sim::insert_vm`] keep the state they were given
//! (no background boot), which also makes them usable as "stuck" VMs; only a
//! Delete RPC moves them (to DELETING, then gone after the delete delay).
//!
//! # Persistence
//!
//! Real flintlock keeps its VMs across a restart (containerd holds the specs).
//! [`Sim::open`] gives the simulator the same property: every change of the
//! stored records (create, boot, fail, delete, removal, seed) rewrites a state
//! file atomically (write `PATH.tmp`, then rename), *before* the RPC that made
//! the change answers, and a restarted simulator loads it. So:
//!
//! - a CreateMicroVM whose reply the client saw survives a kill;
//! - a create killed before its record was written is lost, and its client saw
//!   an error (the connection broke), exactly like a flintlockd killed before
//!   containerd stored the spec;
//! - a VM still PENDING at the kill boots after the restart (flintlock resumes
//!   reconciling it), one boot delay after the load; a DELETING one is removed
//!   one delete delay after the load;
//! - faults, counters, exec rules and delays are runtime settings, not state,
//!   and start from their defaults; the guest agent of a CREATED VM counts as
//!   booted at load time (its guest-agent delay starts again).
//!
//! The write survives the process being killed (SIGKILL), not a power loss:
//! there is no fsync.

mod boot;
mod create;
mod exec;
mod service;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use flintlock_proto::exec::micro_vm_exec_server::MicroVmExecServer;
use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_proto::types::mount::MountType;
use flintlock_proto::types::network_interface::IfaceType;
use flintlock_proto::types::{
    Kernel, MicroVm, MicroVmSpec, Mount, NetworkInterface, NetworkInterfaceStatus, Volume, VolumeSource, VolumeStatus,
};
use flintlock_proto::v1alpha1::micro_vm_server::MicroVmServer;
use prost::Message;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use boot::BootDelay;
pub use exec::{ExecCall, ExecRule, parse_exec_rule};
pub use service::SimService;

/// The RPC method names as counted by [`Sim::calls`].
pub const METHOD_CREATE: &str = "CreateMicroVM";
/// See [`METHOD_CREATE`].
pub const METHOD_DELETE: &str = "DeleteMicroVM";
/// See [`METHOD_CREATE`].
pub const METHOD_GET: &str = "GetMicroVM";
/// See [`METHOD_CREATE`].
pub const METHOD_LIST: &str = "ListMicroVMs";
/// See [`METHOD_CREATE`].
pub const METHOD_LIST_STREAM: &str = "ListMicroVMsStream";
/// See [`METHOD_CREATE`] (`MicroVM/ServerInfo`).
pub const METHOD_SERVER_INFO: &str = "ServerInfo";
/// See [`METHOD_CREATE`] (`MicroVMExec/ExecCommand`).
pub const METHOD_EXEC: &str = "ExecCommand";

/// The version [`Sim`] reports through ServerInfo unless told otherwise.
pub const DEFAULT_VERSION: &str = "v0.16.0";

/// `status.retry` of a VM that ended FAILED (flintlock gives up after retry > 10).
pub const FAILED_RETRY: i32 = 11;

/// Static configuration of a [`Sim`]; the delays can be changed later.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Time from Create (PENDING) to CREATED (or FAILED).
    pub boot_delay: Duration,
    /// Time from Delete (DELETING) to the record vanishing.
    pub delete_delay: Duration,
    /// When set, every RPC needs metadata `authorization: Basic <base64(token)>`.
    pub basic_auth_token: Option<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            boot_delay: Duration::from_millis(100),
            delete_delay: Duration::from_millis(50),
            basic_auth_token: None,
        }
    }
}

/// Counter semantics: 0 = off, `u32::MAX` = until reset, otherwise the next n calls.
#[derive(Debug, Default)]
struct Faults {
    fail_creates: u32,
    lose_create_replies: u32,
    fail_deletes: u32,
    vms_end_failed: bool,
    unavailable: bool,
}

/// Consumes one shot of a fault counter; returns whether the fault fires.
fn take_fault(counter: &mut u32) -> bool {
    match *counter {
        0 => false,
        u32::MAX => true,
        _ => {
            *counter -= 1;
            true
        }
    }
}

#[derive(Debug)]
struct Inner {
    boot_delay: Duration,
    /// When set, each VM's boot delay is drawn from it instead ([`Sim::set_boot_delay_dist`]).
    boot_dist: Option<BootDelay>,
    delete_delay: Duration,
    basic_auth_token: Option<String>,
    vms: HashMap<String, MicroVm>,
    faults: Faults,
    calls: HashMap<&'static str, usize>,
    /// How long CreateMicroVM takes to answer (default none), as a busy flintlockd does.
    create_delay: Duration,
    /// How long ListMicroVMs waits between taking its snapshot and answering.
    list_delay: Duration,
    /// How long GetMicroVM waits before it answers.
    get_delay: Duration,
    /// A VM whose root volume image contains one of these ends FAILED instead of booting.
    failing_images: Vec<String>,
    /// CreateMicroVM calls being answered right now, and the most there ever were at once.
    creates_in_flight: usize,
    max_creates_in_flight: usize,
    next_ifindex: i32,
    next_snapshot: u64,
    /// When each VM reached CREATED (for the guest-agent delay).
    booted_at: HashMap<String, Instant>,
    /// Process start, for ServerInfo's uptime.
    started_at: Instant,
    /// The address last passed to [`Sim::serve`] (ServerInfo's exec address).
    listen_addr: Option<SocketAddr>,
    exec: exec::ExecState,
    /// Where every change of `vms` is written ([`Sim::open`]); `None` = memory only.
    state_file: Option<PathBuf>,
}

/// The state file's content: the records and the counters that keep new device names and
/// snapshot numbers unique across restarts.
#[derive(Clone, PartialEq, prost::Message)]
struct PersistedState {
    #[prost(message, repeated, tag = "1")]
    vms: Vec<MicroVm>,
    #[prost(int32, tag = "2")]
    next_ifindex: i32,
    #[prost(uint64, tag = "3")]
    next_snapshot: u64,
}

/// The fake server's shared state. Cheap to clone; all clones share state.
#[derive(Debug, Clone)]
pub struct Sim {
    inner: Arc<Mutex<Inner>>,
}

/// A running server started by [`Sim::serve`]. Dropping it aborts the serving
/// task (open connections are then shut down gracefully).
#[derive(Debug)]
pub struct SimServer {
    /// The bound address (with the real port when 0 was requested).
    pub addr: SocketAddr,
    handle: Option<JoinHandle<()>>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl SimServer {
    /// Stops accepting connections, shuts open ones down gracefully and waits
    /// (at most 5 s, then aborts) for the serving task to end.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(mut handle) = self.handle.take()
            && tokio::time::timeout(Duration::from_secs(5), &mut handle).await.is_err()
        {
            handle.abort();
        }
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(handle) = self.handle.take() {
            handle.abort();
        }
    }
}

impl Sim {
    pub fn new(config: SimConfig) -> Sim {
        Sim {
            inner: Arc::new(Mutex::new(Inner {
                boot_delay: config.boot_delay,
                boot_dist: None,
                delete_delay: config.delete_delay,
                basic_auth_token: config.basic_auth_token,
                vms: HashMap::new(),
                faults: Faults::default(),
                calls: HashMap::new(),
                create_delay: Duration::ZERO,
                list_delay: Duration::ZERO,
                get_delay: Duration::ZERO,
                failing_images: Vec::new(),
                creates_in_flight: 0,
                max_creates_in_flight: 0,
                next_ifindex: 2,
                next_snapshot: 1,
                booted_at: HashMap::new(),
                started_at: Instant::now(),
                listen_addr: None,
                exec: exec::ExecState::default(),
                state_file: None,
            })),
        }
    }

    /// A simulator whose records persist in `path` (see the crate docs, *Persistence*):
    /// loads the file if it exists (VMs PENDING in it resume booting, DELETING ones resume
    /// their removal), and rewrites it atomically on every change from now on. Must be called
    /// inside a Tokio runtime (the resumed transitions are spawned tasks).
    pub fn open(config: SimConfig, path: impl AsRef<Path>) -> std::io::Result<Sim> {
        let path = path.as_ref().to_path_buf();
        let sim = Sim::new(config);
        let loaded = match std::fs::read(&path) {
            Ok(bytes) => Some(PersistedState::decode(bytes.as_slice()).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not a flintlock-sim state file ({e}); remove it to start empty", path.display()),
                )
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let (pending, deleting) = {
            let mut inner = sim.lock();
            inner.state_file = Some(path);
            let (mut pending, mut deleting) = (vec![], vec![]);
            if let Some(state) = loaded {
                inner.next_ifindex = state.next_ifindex.max(2);
                inner.next_snapshot = state.next_snapshot.max(1);
                for vm in state.vms {
                    let uid = vm_uid(&vm).to_string();
                    match vm_state(&vm) {
                        MicroVmState::Pending => pending.push(uid.clone()),
                        MicroVmState::Deleting => deleting.push(uid.clone()),
                        MicroVmState::Created => {
                            inner.booted_at.insert(uid.clone(), Instant::now());
                        }
                        MicroVmState::Failed => {}
                    }
                    inner.vms.insert(uid, vm);
                }
            }
            // Written at once: an unreadable or unwritable path fails here, not on the first RPC.
            inner.persist()?;
            (pending, deleting)
        };
        let delete_delay = sim.lock().delete_delay;
        tracing::info!(
            vms = sim.lock().vms.len(),
            resumed_boots = pending.len(),
            resumed_deletes = deleting.len(),
            "flintlock-sim state loaded"
        );
        for uid in pending {
            let boot_delay = sim.lock().next_boot_delay();
            sim.schedule_boot(uid, boot_delay, false);
        }
        for uid in deleting {
            sim.schedule_removal(uid, delete_delay);
        }
        Ok(sim)
    }

    /// The state file given to [`Sim::open`], if any.
    pub fn state_file(&self) -> Option<PathBuf> {
        self.lock().state_file.clone()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The tonic service, for mounting into a caller-built server.
    pub fn service(&self) -> MicroVmServer<SimService> {
        MicroVmServer::new(SimService::new(self.clone()))
    }

    /// The `MicroVMExec` tonic service, for mounting next to [`Sim::service`]
    /// into a caller-built server ([`Sim::serve`] mounts both). It is always
    /// registered; [`Sim::set_exec_enabled`] switches its answers to
    /// UNIMPLEMENTED, which is what an unregistered service gives.
    pub fn exec_service(&self) -> MicroVmExecServer<SimService> {
        MicroVmExecServer::new(SimService::new(self.clone()))
    }

    /// Serve on `addr` (use `127.0.0.1:0` for a free port); returns the bound
    /// address and keeps serving in a spawned task until the handle is dropped
    /// or [`SimServer::shutdown`] is called.
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<SimServer> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        self.lock().listen_addr = Some(addr);
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let (tx, rx) = oneshot::channel::<()>();
        let svc = self.service();
        let exec_svc = self.exec_service();
        let handle = tokio::spawn(async move {
            let result = tonic::transport::Server::builder()
                .add_service(svc)
                .add_service(exec_svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = rx.await;
                })
                .await;
            if let Err(err) = result {
                tracing::error!(error = %err, "flintlock-sim server failed");
            }
        });
        tracing::debug!(%addr, "flintlock-sim serving");
        Ok(SimServer { addr, handle: Some(handle), shutdown: Some(tx) })
    }

    // ---- failure injection -------------------------------------------------

    /// The next `n` CreateMicroVM calls that pass validation fail with UNKNOWN
    /// `creating microvm: saving microvm spec: injected failure` and create
    /// nothing. `u32::MAX` = until [`Sim::reset_faults`].
    pub fn fail_creates(&self, n: u32) {
        self.lock().faults.fail_creates = n;
    }

    /// The next `n` CreateMicroVM calls that pass validation do create the VM,
    /// but the client receives UNAVAILABLE `injected: reply lost`.
    pub fn lose_create_replies(&self, n: u32) {
        self.lock().faults.lose_create_replies = n;
    }

    /// The next `n` DeleteMicroVM calls with a non-empty uid fail with UNKNOWN
    /// `deleting microvm: injected failure` (`u32::MAX` = until reset).
    pub fn fail_deletes(&self, n: u32) {
        self.lock().faults.fail_deletes = n;
    }

    /// VMs created while on go PENDING → FAILED (retry [`FAILED_RETRY`])
    /// instead of CREATED.
    pub fn set_vms_end_failed(&self, on: bool) {
        self.lock().faults.vms_end_failed = on;
    }

    /// While on, every RPC answers UNAVAILABLE `injected: server unavailable`.
    pub fn set_unavailable(&self, on: bool) {
        self.lock().faults.unavailable = on;
    }

    /// Boot delay for VMs created from now on (replaces a distribution set before).
    pub fn set_boot_delay(&self, d: Duration) {
        let mut inner = self.lock();
        inner.boot_delay = d;
        inner.boot_dist = None;
    }

    /// Boot delays drawn from `dist`, once per VM, for VMs created from now on (`None`: the
    /// fixed boot delay again).
    pub fn set_boot_delay_dist(&self, dist: Option<BootDelay>) {
        self.lock().boot_dist = dist;
    }

    /// How long each CreateMicroVM takes from now on (its VM is stored at the end of it).
    pub fn set_create_delay(&self, d: Duration) {
        self.lock().create_delay = d;
    }

    /// How long each ListMicroVMs waits, from now on, between taking its snapshot and
    /// answering it: a list that is stale by the time it arrives, to force the moment a VM
    /// changes between a caller's list and what it reads next.
    pub fn set_list_delay(&self, d: Duration) {
        self.lock().list_delay = d;
    }

    /// How long each GetMicroVM waits before it answers, from now on (a host that hangs
    /// past its caller's limit).
    pub fn set_get_delay(&self, d: Duration) {
        self.lock().get_delay = d;
    }

    /// VMs created from now on whose root volume image contains `pattern` end FAILED instead
    /// of booting (a template that never boots); the others boot as usual.
    pub fn add_failing_image(&self, pattern: &str) {
        self.lock().failing_images.push(pattern.to_owned());
    }

    /// Forgets every [`Sim::add_failing_image`] pattern.
    pub fn clear_failing_images(&self) {
        self.lock().failing_images.clear();
    }

    /// The most CreateMicroVM calls this sim was answering at the same time.
    pub fn max_creates_in_flight(&self) -> usize {
        self.lock().max_creates_in_flight
    }

    /// Delete delay for deletes issued from now on.
    pub fn set_delete_delay(&self, d: Duration) {
        self.lock().delete_delay = d;
    }

    /// Clears every injected fault (delays and auth are kept, and so are the
    /// exec / ServerInfo settings below).
    pub fn reset_faults(&self) {
        self.lock().faults = Faults::default();
    }

    // ---- exec and ServerInfo ----------------------------------------------

    /// Whether flintlockd runs with `--enable-exec-api` (default on). Off:
    /// ExecCommand answers UNIMPLEMENTED (the service is not registered on a
    /// real server) and ServerInfo reports `exec.enabled = false`.
    pub fn set_exec_enabled(&self, on: bool) {
        self.lock().exec.enabled = on;
    }

    /// The version ServerInfo reports (default [`DEFAULT_VERSION`]); e.g.
    /// `v0.15.2`, `v0.15.2-3-gabc1234` or `undefined` (a build without
    /// ldflags, which then also reports build date and commit `undefined`).
    pub fn set_server_info(&self, version: &str) {
        self.lock().exec.version = version.to_string();
    }

    /// While on, ServerInfo answers UNIMPLEMENTED, like flintlock < v0.15.0.
    pub fn set_server_info_unimplemented(&self, on: bool) {
        self.lock().exec.server_info_unimplemented = on;
    }

    /// For this long after a VM reaches CREATED its guest agent is not up:
    /// ExecCommand on it fails with UNKNOWN `starting guest-agent exec
    /// session: dialling guest-agent control channel: guest agent: handshake
    /// read: EOF`. Applies to VMs already booted too (measured from their
    /// boot). Default zero.
    pub fn set_guest_agent_delay(&self, d: Duration) {
        self.lock().exec.guest_agent_delay = d;
    }

    /// Scripts the outcome of commands containing `pattern` (substring of
    /// `cmd` + `" "` + `args` joined with spaces). Rules are tried in the
    /// order they were first set; the first match applies. Setting an
    /// existing pattern again replaces its rule in place. A command that
    /// matches no rule exits 0 at once with no output.
    pub fn set_exec_rule(&self, pattern: &str, rule: ExecRule) {
        let rules = &mut self.lock().exec.rules;
        match rules.iter_mut().find(|(p, _)| p == pattern) {
            Some((_, r)) => *r = rule,
            None => rules.push((pattern.to_string(), rule)),
        }
    }

    /// What `flintlock-sim --exec-rule PATTERN=EXIT_CODE` sets: commands containing
    /// `pattern` exit with `exit_code` at once. A non-zero exit also writes one line to
    /// stderr naming the rule, so a hook failure caused by it says where it came from. Same
    /// order and replacement rules as [`Sim::set_exec_rule`].
    pub fn set_exec_exit_code(&self, pattern: &str, exit_code: i32) {
        self.set_exec_rule(pattern, ExecRule::exit_code_rule(pattern, exit_code));
    }

    /// Removes every exec rule.
    pub fn clear_exec_rules(&self) {
        self.lock().exec.rules.clear();
    }

    /// Every ExecCommand start that got past the server's checks (first
    /// message, VM lookup, guest-agent and state preconditions), in arrival
    /// order, including those then refused by a not-yet-up guest agent.
    pub fn exec_calls(&self) -> Vec<ExecCall> {
        self.lock().exec.calls.clone()
    }

    /// Number of simulated commands still running (sleeping out their
    /// duration or waiting to deliver output). Drops back when they finish or
    /// when the client cancels the stream.
    pub fn exec_running(&self) -> usize {
        self.lock().exec.running
    }

    // ---- inspection --------------------------------------------------------

    /// Snapshot of every stored record, any state (unspecified order).
    pub fn vms(&self) -> Vec<MicroVm> {
        self.lock().vms.values().cloned().collect()
    }

    /// The stored record for `uid`, if any.
    pub fn vm(&self, uid: &str) -> Option<MicroVm> {
        self.lock().vms.get(uid).cloned()
    }

    /// Removes the record for `uid` at once, as a microVM deleted behind poolmgr's back or
    /// lost with its host's reboot (no DELETING phase, no delete call). `false`: no such VM.
    pub fn remove_vm(&self, uid: &str) -> bool {
        let mut inner = self.lock();
        let removed = inner.vms.remove(uid).is_some();
        inner.booted_at.remove(uid);
        inner.persist_or_log();
        removed
    }

    /// Pre-seeds a record (e.g. in a foreign namespace, or a duplicate name)
    /// in the given state and returns its uid. The record has a minimal valid
    /// firecracker spec and does not transition by itself.
    pub fn insert_vm(&self, namespace: &str, id: &str, state: MicroVmState) -> String {
        let spec = MicroVmSpec {
            id: "seed".to_string(),
            namespace: namespace.to_string(),
            vcpu: 2,
            memory_in_mb: 1024,
            kernel: Some(Kernel {
                image: "ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77".to_string(),
                filename: Some("boot/vmlinux".to_string()),
                add_network_config: true,
                ..Default::default()
            }),
            root_volume: Some(Volume {
                id: "root".to_string(),
                source: Some(VolumeSource {
                    container_source: Some("ghcr.io/liquidmetal-dev/capmvm-k8s-os:1.23.5".to_string()),
                    virtiofs_source: None,
                }),
                ..Default::default()
            }),
            interfaces: vec![NetworkInterface {
                device_id: "eth1".to_string(),
                r#type: IfaceType::Tap as i32,
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut vm =
            create::build_microvm(Some(spec), || ulid::Ulid::generate().to_string()).expect("seed spec is valid");
        let uid = vm_uid(&vm).to_string();
        if let Some(spec) = vm.spec.as_mut() {
            spec.id = id.to_string();
            spec.namespace = namespace.to_string();
        }
        let mut inner = self.lock();
        match state {
            MicroVmState::Pending => {}
            MicroVmState::Created => {
                inner.mark_booted(&mut vm);
                inner.booted_at.insert(uid.clone(), Instant::now());
            }
            MicroVmState::Failed => mark_failed(&mut vm),
            MicroVmState::Deleting => set_state(&mut vm, MicroVmState::Deleting, 0),
        }
        inner.vms.insert(uid.clone(), vm);
        inner.persist_or_log();
        uid
    }

    /// Number of RPCs received for `method` (e.g. `"CreateMicroVM"`,
    /// `"ServerInfo"`, `"ExecCommand"`), including failed and fault-injected
    /// ones.
    pub fn calls(&self, method: &str) -> usize {
        self.lock().calls.get(method).copied().unwrap_or(0)
    }

    // ---- background transitions -------------------------------------------

    fn schedule_boot(&self, uid: String, delay: Duration, ends_failed: bool) {
        let sim = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut inner = sim.lock();
            let Inner { vms, next_ifindex, next_snapshot, booted_at, .. } = &mut *inner;
            let Some(vm) = vms.get_mut(&uid) else {
                return;
            };
            if vm_state(vm) != MicroVmState::Pending {
                return;
            }
            if ends_failed {
                mark_failed(vm);
                tracing::info!(%uid, "microvm FAILED");
            } else {
                booted(vm, next_ifindex, next_snapshot);
                booted_at.insert(uid.clone(), Instant::now());
                tracing::info!(%uid, "microvm CREATED");
            }
            inner.persist_or_log();
        });
    }

    fn schedule_removal(&self, uid: String, delay: Duration) {
        let sim = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut inner = sim.lock();
            if inner.vms.get(&uid).is_some_and(|vm| vm_state(vm) == MicroVmState::Deleting) {
                inner.vms.remove(&uid);
                inner.booted_at.remove(&uid);
                inner.persist_or_log();
                tracing::info!(%uid, "microvm removed");
            }
        });
    }
}

impl Inner {
    /// The boot delay of the next VM: a draw when a distribution is set.
    fn next_boot_delay(&self) -> Duration {
        match &self.boot_dist {
            Some(d) => d.sample(&mut rand::rng()),
            None => self.boot_delay,
        }
    }

    fn mark_booted(&mut self, vm: &mut MicroVm) {
        booted(vm, &mut self.next_ifindex, &mut self.next_snapshot);
    }

    /// Rewrites the state file (if any) with the current records: `PATH.tmp`, then a rename,
    /// so a reader (or a restart after SIGKILL) sees the old file or the new one, never half.
    /// Called with the lock held, so writes happen in the order of the changes.
    fn persist(&self) -> std::io::Result<()> {
        let Some(path) = &self.state_file else {
            return Ok(());
        };
        let mut vms: Vec<MicroVm> = self.vms.values().cloned().collect();
        vms.sort_by(|a, b| vm_uid(a).cmp(vm_uid(b)));
        let state = PersistedState { vms, next_ifindex: self.next_ifindex, next_snapshot: self.next_snapshot };
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        std::fs::write(&tmp, state.encode_to_vec())?;
        std::fs::rename(&tmp, path)
    }

    /// [`Inner::persist`] where a failure cannot be answered to anyone (background
    /// transitions): logged, and retried by the next change.
    fn persist_or_log(&self) {
        if let Err(e) = self.persist() {
            tracing::error!(error = %e, "cannot write the flintlock-sim state file; VMs will be lost on restart");
        }
    }
}

fn vm_uid(vm: &MicroVm) -> &str {
    vm.spec.as_ref().and_then(|s| s.uid.as_deref()).unwrap_or_default()
}

fn vm_state(vm: &MicroVm) -> MicroVmState {
    vm.status.as_ref().and_then(|s| MicroVmState::try_from(s.state).ok()).unwrap_or(MicroVmState::Pending)
}

/// Sets state and retry and bumps the version (one persisted change).
fn set_state(vm: &mut MicroVm, state: MicroVmState, retry: i32) {
    let status = vm.status.get_or_insert_with(Default::default);
    status.state = state as i32;
    status.retry = retry;
    vm.version += 1;
}

fn mark_failed(vm: &mut MicroVm) {
    set_state(vm, MicroVmState::Failed, FAILED_RETRY);
}

fn random_hex7() -> String {
    format!("{:07x}", rand::random::<u32>() & 0x0fff_ffff)
}

fn random_mac() -> String {
    let mut b: [u8; 6] = rand::random();
    // Locally administered, unicast.
    b[0] = (b[0] | 0x02) & 0xfe;
    b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(":")
}

/// PENDING → CREATED: fills the status the way a successful reconcile does.
fn booted(vm: &mut MicroVm, next_ifindex: &mut i32, next_snapshot: &mut u64) {
    let spec = vm.spec.clone().unwrap_or_default();
    let status = vm.status.get_or_insert_with(Default::default);
    for iface in &spec.interfaces {
        let prefix = if iface.r#type == IfaceType::Macvtap as i32 { "flvtap" } else { "fltap" };
        status.network_interfaces.insert(
            iface.device_id.clone(),
            NetworkInterfaceStatus {
                host_device_name: format!("{prefix}{}", random_hex7()),
                index: *next_ifindex,
                mac_address: random_mac(),
            },
        );
        *next_ifindex += 1;
    }
    for vol in spec.root_volume.iter().chain(spec.additional_volumes.iter()) {
        let n = *next_snapshot;
        *next_snapshot += 1;
        status.volumes.insert(
            vol.id.clone(),
            VolumeStatus {
                mount: Some(Mount {
                    r#type: MountType::Dev as i32,
                    source: format!("/dev/mapper/flintlock-thinpool-snap-{n}"),
                }),
            },
        );
    }
    let mut hostpath_mount = || {
        let n = *next_snapshot;
        *next_snapshot += 1;
        Mount {
            r#type: MountType::Hostpath as i32,
            source: format!("/var/lib/containerd-dev/io.containerd.snapshotter.v1.native/snapshots/{n}"),
        }
    };
    if spec.kernel.as_ref().is_some_and(|k| !k.image.is_empty()) {
        status.kernel_mount = Some(hostpath_mount());
    }
    if spec.initrd.is_some() {
        status.initrd_mount = Some(hostpath_mount());
    }
    if spec.allow_guest_agent {
        status.vsock_path = format!(
            "/var/lib/flintlock/vm/{}/{}/{}/guest-agent.vsock",
            spec.namespace,
            spec.id,
            spec.uid.as_deref().unwrap_or_default()
        );
    }
    set_state(vm, MicroVmState::Created, 0);
}
