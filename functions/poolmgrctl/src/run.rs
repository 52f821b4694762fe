//! `poolmgrctl lease run --pool P -- CMD ARGS…`: a command under a lease. Claims (the
//! library's retrying claim, a generated request id unless one is given), heartbeats in the
//! background (`poolmgr-client`'s keep-alive), runs CMD with the VM's facts in its
//! environment, forwards SIGINT/SIGTERM/SIGHUP to it, and releases the lease once CMD has
//! exited, whatever the exit. Failed heartbeats are reported and retried by the keep-alive
//! until the lease expires; a lost lease stops CMD (SIGTERM, SIGKILL after --kill-after).
//!
//! Must never leak a lease it could release: every way out after the claim goes through
//! [`finish`], which releases (retried) before the exit code is decided. Only a SIGKILL of
//! this process skips it; the lease then expires by itself (nothing heartbeats it).

use std::collections::BTreeMap;
use std::time::Duration;

use poolmgr_client::{ClaimResponse, LeaseGuard, LeaseState, PoolRef, RELEASE_DEADLINE, Status};
use tokio::process::Command;

use crate::Ctx;
use crate::error::{CliError, EXIT_LEASE_LOST};
use crate::output::printable;

/// How a run ended, before the release.
enum Ending {
    /// CMD exited with this code (or 128+signal).
    Exited(u8),
    /// CMD could not be started: 127 (not found) or 126 (not runnable).
    NotStarted(u8),
}

pub async fn run(
    ctx: &Ctx,
    pool: &PoolRef,
    request_id: Option<String>,
    wait: Option<Duration>,
    kill_after: Duration,
    command: Vec<String>,
) -> Result<(), CliError> {
    let Some((program, args)) = command.split_first() else {
        return Err(CliError::usage("lease run needs a command after --"));
    };
    // Installed before the claim, so a signal from now on is handled here instead of killing
    // this process with a lease it could still release.
    let mut signals = Signals::install()?;
    let id = request_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    eprintln!("lease run: claiming from {pool} with request_id {}", printable(&id));
    let claimed = tokio::select! {
        c = crate::lease::claim_reporting(ctx, pool, id.clone(), wait) => c?,
        sig = signals.recv() => {
            // The claim in flight is dropped: it may still commit (see the library's cancel
            // safety), under an id we printed.
            eprintln!(
                "lease run: {} while claiming; a lease claimed under request_id {} expires by itself \
                 (or claim it again with `poolmgrctl lease claim --request-id {}` and release it)",
                signal_name(sig), printable(&id), printable(&id)
            );
            return Err(CliError::silent(128u8.saturating_add(sig as u8)));
        }
    };
    let claim = claimed.response;
    let raw = String::from_utf8_lossy(&claimed.reply.body).into_owned();
    eprintln!(
        "lease run: claimed lease {} (VM {} on host {}){}",
        printable(&claim.lease.lease_id),
        printable(&claim.vm.id),
        printable(&claim.vm.flintlock_host.name),
        if claim.replayed { ", replayed" } else { "" }
    );
    let mut guard = ctx.client.keep_alive(&claim.lease);
    let mut reports = guard.watch();
    // The claim and a signal may have been ready together and the claim picked: a signal that
    // came before CMD exists reached no CMD (in a terminal, ^C went to this process only), so
    // it stops the run here instead of being taken for one CMD already got.
    if let Some(sig) = pending_signal(&mut signals) {
        eprintln!("lease run: {} before the command started; not starting it", signal_name(sig));
        return finish(guard, &claim, Ending::NotStarted(128u8.saturating_add(sig as u8)), false).await;
    }
    let mut child = match Command::new(program).args(args).envs(environment(&claim, &raw)).spawn() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 };
            eprintln!("lease run: cannot run {}: {e}", printable(program));
            return finish(guard, &claim, Ending::NotStarted(code), false).await;
        }
    };
    let pid = child.id().map(|p| p as i32);
    let mut lost = false;
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut reporting = true;
    let ending = loop {
        tokio::select! {
            status = child.wait() => {
                break Ending::Exited(match status {
                    Ok(s) => exit_code(s),
                    Err(e) => {
                        eprintln!("lease run: cannot wait for {}: {e}", printable(program));
                        1
                    }
                });
            }
            sig = signals.recv() => {
                if sig == libc::SIGINT && in_terminal_foreground() {
                    // The terminal sent it to CMD as well: a second one would be a double ^C.
                    eprintln!("lease run: interrupted; waiting for the command to exit");
                } else {
                    eprintln!("lease run: {}; forwarding it to the command", signal_name(sig));
                    send_signal(pid, sig);
                }
            }
            e = guard.lost(), if !lost => {
                lost = true;
                eprintln!(
                    "lease run: lease {} lost ({}); sending SIGTERM to the command (SIGKILL in {})",
                    printable(&claim.lease.lease_id),
                    CliError::from(e),
                    humantime::format_duration(kill_after)
                );
                send_signal(pid, libc::SIGTERM);
                kill_at = Some(tokio::time::Instant::now() + kill_after);
            }
            () = sleep_until_some(kill_at) => {
                kill_at = None;
                eprintln!(
                    "lease run: the command did not exit within {} of SIGTERM; sending SIGKILL",
                    humantime::format_duration(kill_after)
                );
                send_signal(pid, libc::SIGKILL);
            }
            change = reports.next_change(), if reporting && !lost => match change {
                Some(LeaseState::Alive { failures, last_error: Some(e), lease, .. }) if failures > 0 => {
                    let left = (lease.expires_at - chrono::Utc::now()).num_milliseconds().max(0) as f64 / 1000.0;
                    eprintln!(
                        "lease run: heartbeat of lease {} failed ({}); retrying ({left:.0}s before it expires)",
                        printable(&claim.lease.lease_id),
                        CliError::from(e)
                    );
                }
                Some(_) => {}
                None => reporting = false,
            },
        }
    };
    finish(guard, &claim, ending, lost).await
}

/// Completes at `at`, or never without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A signal already received and not yet handled, without waiting for one.
fn pending_signal(signals: &mut Signals) -> Option<i32> {
    use futures_util::FutureExt;
    signals.recv().now_or_never()
}

/// Releases the lease (unless it is gone already), says so, and decides the exit code.
async fn finish(guard: LeaseGuard, claim: &ClaimResponse, ending: Ending, lost: bool) -> Result<(), CliError> {
    let id = printable(&claim.lease.lease_id);
    let gone = matches!(&guard.state(), LeaseState::Lost(e) if e.status() == Some(&Status::NotFound));
    if gone {
        drop(guard);
        eprintln!("lease run: lease {id} is gone already: nothing to release");
    } else {
        match guard.release(RELEASE_DEADLINE).await {
            Ok(()) => eprintln!("lease run: released lease {id}"),
            Err(e) => eprintln!(
                "lease run: cannot release lease {id}: {}; it expires by itself (its heartbeats stopped)",
                CliError::from(e)
            ),
        }
    }
    let code = match ending {
        _ if lost => EXIT_LEASE_LOST,
        Ending::Exited(c) | Ending::NotStarted(c) => c,
    };
    if code == 0 { Ok(()) } else { Err(CliError::silent(code)) }
}

/// The VM's facts for CMD's environment (see `poolmgrctl lease run --help`).
fn environment(c: &ClaimResponse, raw: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: &str| {
        env.insert(k.to_owned(), v.to_owned());
    };
    set("POOLMGR_LEASE_ID", &c.lease.lease_id);
    set("POOLMGR_REQUEST_ID", c.lease.request_id.as_deref().unwrap_or_default());
    set("POOLMGR_POOL", &c.lease.pool.to_string());
    set("POOLMGR_VM_ID", &c.vm.id);
    set("POOLMGR_VM_UID", &c.vm.uid);
    set("POOLMGR_HOST", &c.vm.flintlock_host.name);
    set("POOLMGR_HOST_ADDRESS", &c.vm.flintlock_host.address);
    set("POOLMGR_LEASE_EXPIRES_AT", &c.lease.expires_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    set("POOLMGR_CLAIM_JSON", raw);
    let devices: Vec<&str> = c.vm.network_interfaces.keys().map(String::as_str).collect();
    set("POOLMGR_VM_INTERFACES", &devices.join(" "));
    // BTreeMap: the interfaces in device id order, so N is stable.
    for (n, (device, i)) in c.vm.network_interfaces.iter().enumerate() {
        if n == 0 {
            set("POOLMGR_VM_MAC", &i.mac_address);
        }
        set(&format!("POOLMGR_VM_IFACE_{n}_DEVICE"), device);
        set(&format!("POOLMGR_VM_IFACE_{n}_MAC"), &i.mac_address);
        set(&format!("POOLMGR_VM_IFACE_{n}_HOST_DEVICE"), &i.host_device_name);
        set(&format!("POOLMGR_VM_IFACE_{n}_INDEX"), &i.index.to_string());
    }
    env
}

/// A child's exit status as a shell reports it: its code, or 128+N for signal N.
fn exit_code(s: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(sig)) => 128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
        (None, None) => 1,
    }
}

/// The signals `lease run` handles instead of dying of them.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals, CliError> {
        use tokio::signal::unix::{SignalKind, signal};
        let s = |k| signal(k).map_err(|e| CliError::new("internal", format!("cannot handle signals: {e}")));
        Ok(Signals {
            int: s(SignalKind::interrupt())?,
            term: s(SignalKind::terminate())?,
            hup: s(SignalKind::hangup())?,
        })
    }

    /// The next signal received.
    async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => libc::SIGINT,
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.hup.recv() => libc::SIGHUP,
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

fn send_signal(pid: Option<i32>, sig: i32) {
    if let Some(pid) = pid.filter(|p| *p > 0) {
        // SAFETY: kill(2) with a pid we spawned and have not reaped yet (tokio reaps it only
        // in `wait`, which has not returned), so it cannot name another process.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Whether this process is in the foreground process group of the terminal on one of its
/// standard descriptors: then a ^C reached CMD (in the same group) directly.
fn in_terminal_foreground() -> bool {
    // SAFETY: plain queries of this process's descriptors and group.
    unsafe {
        let group = libc::getpgrp();
        (0..3).any(|fd| libc::isatty(fd) == 1 && libc::tcgetpgrp(fd) == group)
    }
}
