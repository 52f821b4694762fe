//! `flintlock-sim`: serve the fake flintlock MicroVM and MicroVMExec gRPC APIs (plaintext) for
//! the local dev stack. Prints `flintlock-sim listening on <addr>` on stdout
//! once bound, logs to stderr, and stops on SIGINT/SIGTERM.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use flintlock_sim::{BootDelay, DEFAULT_VERSION, Sim, SimConfig};
use tracing_subscriber::EnvFilter;

const USAGE: &str = "\
Usage: flintlock-sim [OPTIONS]

A fake flintlockd serving microvm.services.api.v1alpha1.MicroVM (with ServerInfo) and
microvmexec.services.api.v1alpha1.MicroVMExec over plaintext gRPC. Exec commands (hooks) exit
0 with no output unless an --exec-rule matches them.

Options:
  --listen ADDR              Address to listen on (default 127.0.0.1:9090; port 0 picks a free port)
  --boot-delay-ms N          Milliseconds from PENDING to CREATED (default 100)
  --boot-delay-dist SPEC     Draw each VM's boot delay from a distribution instead of
                             --boot-delay-ms: lognormal:MEDIAN_MS:SIGMA (median · e^(SIGMA·Z)),
                             uniform:MIN_MS:MAX_MS or fixed:MS; each draw is logged with the
                             VM's creation (boot_delay_ms)
  --delete-delay-ms N        Milliseconds from DELETING to removal (default 50)
  --basic-auth-token TOKEN   Require metadata `authorization: Basic <base64(TOKEN)>`
  --exec-disabled            Run as without --enable-exec-api: ExecCommand answers UNIMPLEMENTED
  --version V                Version reported by ServerInfo (default v0.16.0; e.g. undefined)
  --guest-agent-delay-ms N   Exec fails (handshake read: EOF) for N ms after a VM is CREATED (default 0)
  --exec-rule PATTERN=CODE   An exec command containing PATTERN (a substring of the command line)
                             exits with CODE (0-255), with a line naming the rule on stderr when
                             CODE is not 0. Repeatable; the first matching rule applies, so put
                             the narrower pattern first; an empty PATTERN matches every command.
                             Split at the last `=`. E.g. --exec-rule setup=3 makes every hook
                             command containing `setup` fail with exit code 3
  --exec-slow PATTERN=MS     An exec command containing PATTERN runs MS milliseconds, then exits
                             0 (repeatable, tried after the --exec-rule ones): hooks that take
                             time, so faults meet them mid-command
  --fail-image PATTERN       A VM whose root volume image contains PATTERN ends FAILED instead
                             of booting (repeatable): a template that never boots
  --state-file PATH          Keep the VMs in PATH across restarts, like flintlockd keeps them in
                             containerd: loaded at start (PENDING VMs resume booting), rewritten
                             atomically on every change before the RPC answers. Default: memory only
  -h, --help                 Print this help

Logging goes to stderr; filter with RUST_LOG (default info).";

#[derive(Debug)]
struct Args {
    listen: SocketAddr,
    config: SimConfig,
    /// `--boot-delay-dist`: overrides `config.boot_delay` when set.
    boot_dist: Option<BootDelay>,
    exec_enabled: bool,
    version: String,
    guest_agent_delay: Duration,
    state_file: Option<PathBuf>,
    /// `--exec-rule` values in the order given: (pattern, exit code).
    exec_rules: Vec<(String, i32)>,
    /// `--exec-slow` values: (pattern, run time).
    exec_slow: Vec<(String, Duration)>,
    /// `--fail-image` patterns.
    fail_images: Vec<String>,
}

enum Parsed {
    Run(Box<Args>),
    Help,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
    let mut listen: SocketAddr = "127.0.0.1:9090".parse().expect("valid default");
    let mut config = SimConfig::default();
    let mut boot_dist = None;
    let mut exec_enabled = true;
    let mut version = DEFAULT_VERSION.to_string();
    let mut guest_agent_delay = Duration::ZERO;
    let mut state_file = None;
    let mut fail_images = Vec::new();
    let mut exec_rules = vec![];
    let mut exec_slow = vec![];
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            return Ok(Parsed::Help);
        }
        if flag == "--exec-disabled" {
            if inline.is_some() {
                return Err(format!("{flag} takes no value"));
            }
            exec_enabled = false;
            continue;
        }
        let mut value = || -> Result<String, String> {
            inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--listen" => {
                let v = value()?;
                listen = v.parse().map_err(|e| format!("--listen: invalid address {v:?}: {e}"))?;
            }
            "--boot-delay-ms" => config.boot_delay = parse_ms(&flag, &value()?)?,
            "--boot-delay-dist" => boot_dist = Some(BootDelay::parse(&value()?).map_err(|e| format!("{flag}: {e}"))?),
            "--delete-delay-ms" => config.delete_delay = parse_ms(&flag, &value()?)?,
            "--guest-agent-delay-ms" => guest_agent_delay = parse_ms(&flag, &value()?)?,
            "--version" => version = value()?,
            "--exec-rule" => exec_rules.push(flintlock_sim::parse_exec_rule(&value()?)?),
            "--exec-slow" => {
                let v = value()?;
                let (pattern, ms) =
                    v.rsplit_once('=').ok_or_else(|| format!("--exec-slow: {v:?} is not PATTERN=MS"))?;
                exec_slow.push((pattern.to_owned(), parse_ms(&flag, ms)?));
            }
            "--fail-image" => {
                let v = value()?;
                if v.is_empty() {
                    return Err("--fail-image needs a non-empty PATTERN".into());
                }
                fail_images.push(v);
            }
            "--state-file" => {
                let v = value()?;
                if v.is_empty() {
                    return Err("--state-file needs a path".into());
                }
                state_file = Some(PathBuf::from(v));
            }
            "--basic-auth-token" => {
                let v = value()?;
                config.basic_auth_token = (!v.is_empty()).then_some(v);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Parsed::Run(Box::new(Args {
        listen,
        config,
        boot_dist,
        exec_enabled,
        version,
        guest_agent_delay,
        state_file,
        exec_rules,
        exec_slow,
        fail_images,
    })))
}

fn parse_ms(flag: &str, v: &str) -> Result<Duration, String> {
    v.parse::<u64>().map(Duration::from_millis).map_err(|e| format!("{flag}: invalid number {v:?}: {e}"))
}

async fn wait_for_signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r,
        _ = term.recv() => Ok(()),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Parsed::Run(args)) => args,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("flintlock-sim: {msg}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };

    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .init();

    let sim = match &args.state_file {
        None => Sim::new(args.config.clone()),
        Some(path) => match Sim::open(args.config.clone(), path) {
            Ok(sim) => sim,
            Err(err) => {
                tracing::error!(state_file = %path.display(), error = %err, "cannot use the state file");
                return ExitCode::FAILURE;
            }
        },
    };
    sim.set_boot_delay_dist(args.boot_dist);
    sim.set_exec_enabled(args.exec_enabled);
    sim.set_server_info(&args.version);
    sim.set_guest_agent_delay(args.guest_agent_delay);
    for (pattern, exit_code) in &args.exec_rules {
        sim.set_exec_exit_code(pattern, *exit_code);
    }
    for (pattern, duration) in &args.exec_slow {
        sim.set_exec_rule(pattern, flintlock_sim::ExecRule { duration: *duration, ..Default::default() });
    }
    for pattern in &args.fail_images {
        sim.add_failing_image(pattern);
    }
    let server = match sim.serve(args.listen).await {
        Ok(server) => server,
        Err(err) => {
            tracing::error!(listen = %args.listen, error = %err, "cannot listen");
            return ExitCode::FAILURE;
        }
    };
    {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "flintlock-sim listening on {}", server.addr);
        let _ = stdout.flush();
    }
    tracing::info!(
        addr = %server.addr,
        boot_delay_ms = args.config.boot_delay.as_millis() as u64,
        boot_delay_dist = args.boot_dist.map(|d| d.to_string()),
        delete_delay_ms = args.config.delete_delay.as_millis() as u64,
        basic_auth = args.config.basic_auth_token.is_some(),
        exec_enabled = args.exec_enabled,
        version = %args.version,
        guest_agent_delay_ms = args.guest_agent_delay.as_millis() as u64,
        state_file = args.state_file.as_ref().map(|p| p.display().to_string()),
        exec_rules = ?args.exec_rules,
        "flintlock-sim started"
    );

    if let Err(err) = wait_for_signal().await {
        tracing::error!(error = %err, "cannot wait for signals");
    }
    tracing::info!("shutting down");
    server.shutdown().await;
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[&str]) -> Result<Parsed, String> {
        parse_args(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn parses_flags() {
        let Ok(Parsed::Run(a)) = parse(&[
            "--listen",
            "127.0.0.1:0",
            "--boot-delay-ms=5",
            "--delete-delay-ms",
            "7",
            "--basic-auth-token",
            "tok",
        ]) else {
            panic!("parse failed");
        };
        assert_eq!(a.listen.port(), 0);
        assert_eq!(a.config.boot_delay, Duration::from_millis(5));
        assert_eq!(a.config.delete_delay, Duration::from_millis(7));
        assert_eq!(a.config.basic_auth_token.as_deref(), Some("tok"));
        assert!(a.exec_enabled);
        assert_eq!(a.version, "v0.16.0");
        assert_eq!(a.guest_agent_delay, Duration::ZERO);
        assert!(a.state_file.is_none());
        assert!(a.exec_rules.is_empty());
    }

    /// Issue 14 item 13: `--exec-rule PATTERN=EXIT_CODE`, repeatable, in the order given.
    #[test]
    fn parses_exec_rules() {
        let Ok(Parsed::Run(a)) = parse(&["--exec-rule", "setup=3", "--exec-rule=a=b=0", "--exec-rule", "=1"]) else {
            panic!("parse failed");
        };
        assert_eq!(a.exec_rules, [("setup".to_owned(), 3), ("a=b".to_owned(), 0), (String::new(), 1)]);
        assert!(parse(&["--exec-rule"]).is_err());
        assert!(parse(&["--exec-rule", "setup"]).is_err());
        assert!(parse(&["--exec-rule", "setup=300"]).is_err());
        assert!(parse(&["--exec-rule", "setup=fail"]).is_err());
        let Ok(Parsed::Run(a)) = parse(&["--exec-slow", "reset=800"]) else { panic!("parses") };
        assert_eq!(a.exec_slow, [("reset".to_owned(), Duration::from_millis(800))]);
        assert!(parse(&["--exec-slow", "reset"]).is_err());
    }

    #[test]
    fn fail_image_is_repeatable_and_needs_a_pattern() {
        let Ok(Parsed::Run(a)) = parse(&["--fail-image", "broken", "--fail-image=bad:2"]) else { panic!("parses") };
        assert_eq!(a.fail_images, ["broken", "bad:2"]);
        assert!(parse(&["--fail-image", ""]).is_err());
    }

    #[test]
    fn parses_boot_delay_dist() {
        let Ok(Parsed::Run(a)) = parse(&["--boot-delay-ms", "5", "--boot-delay-dist", "lognormal:250:0.3"]) else {
            panic!("parse failed");
        };
        assert_eq!(a.boot_dist, Some(BootDelay::LogNormal { median_ms: 250.0, sigma: 0.3 }));
        let Ok(Parsed::Run(a)) = parse(&["--boot-delay-dist=uniform:10:20"]) else {
            panic!("parse failed");
        };
        assert_eq!(a.boot_dist, Some(BootDelay::Uniform { min_ms: 10, max_ms: 20 }));
        let Ok(Parsed::Run(a)) = parse(&[]) else {
            panic!("parse failed");
        };
        assert_eq!(a.boot_dist, None);
        assert!(parse(&["--boot-delay-dist"]).is_err());
        let err = parse(&["--boot-delay-dist", "gauss:1:2"]).err().unwrap();
        assert!(err.starts_with("--boot-delay-dist: ") && err.contains("lognormal:MEDIAN_MS:SIGMA"), "{err}");
    }

    #[test]
    fn parses_state_file() {
        let Ok(Parsed::Run(a)) = parse(&["--state-file", "/tmp/sim.state"]) else {
            panic!("parse failed");
        };
        assert_eq!(a.state_file.as_deref(), Some(std::path::Path::new("/tmp/sim.state")));
        assert!(parse(&["--state-file"]).is_err());
        assert!(parse(&["--state-file="]).is_err());
    }

    #[test]
    fn parses_exec_flags() {
        let Ok(Parsed::Run(a)) =
            parse(&["--exec-disabled", "--version", "v0.15.2-3-gabc1234", "--guest-agent-delay-ms=1500"])
        else {
            panic!("parse failed");
        };
        assert!(!a.exec_enabled);
        assert_eq!(a.version, "v0.15.2-3-gabc1234");
        assert_eq!(a.guest_agent_delay, Duration::from_millis(1500));
        assert!(parse(&["--exec-disabled=yes"]).is_err());
        assert!(parse(&["--version"]).is_err());
        assert!(parse(&["--guest-agent-delay-ms", "soon"]).is_err());
    }

    #[test]
    fn defaults_help_and_errors() {
        let Ok(Parsed::Run(a)) = parse(&[]) else {
            panic!("parse failed");
        };
        assert_eq!(a.listen.to_string(), "127.0.0.1:9090");
        assert!(a.config.basic_auth_token.is_none());
        assert!(matches!(parse(&["--help"]), Ok(Parsed::Help)));
        assert!(parse(&["--bogus"]).is_err());
        assert!(parse(&["--listen"]).is_err());
        assert!(parse(&["--boot-delay-ms", "x"]).is_err());
    }
}
