//! The server binaries behave like services on their command line (issue 26 item 8):
//! `--help` lists every environment variable the binary reads with its default and
//! `--version` its version, both at once and without starting anything: no database
//! connection, no migration, no Lambda runtime, no listener. No database needed: a local TCP
//! listener stands in for PostgreSQL and the Lambda Runtime API and must see no connection.

use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use poolmgr_core::cli;

use crate::lambda_lifecycle::function_bin;

/// A token that must never appear in the help (values are hidden).
const SECRET: &str = "do-not-print-this-token-0123456789";

/// Generous: a debug binary on a busy 2-core machine; starting nothing takes milliseconds.
const QUICKLY: Duration = Duration::from_secs(10);

/// A binary's variables, by `--help` heading.
type Groups = &'static [(&'static str, &'static [cli::Var])];

/// Runs `bin args` with every address it could reach pointing at `trap`.
fn run(bin: &PathBuf, args: &[&str], trap: &TcpListener) -> (Output, Duration) {
    let addr = trap.local_addr().unwrap();
    let started = Instant::now();
    let out = Command::new(bin)
        .args(args)
        .env("DATABASE_URL", format!("postgres://poolmgr@{addr}/poolmgr?connect_timeout=30"))
        .env("POOLMGR_ADMIN_TOKENS", SECRET)
        .env("POOLMGR_HTTP_ADDR", "127.0.0.1:0")
        .env("AWS_LAMBDA_RUNTIME_API", addr.to_string())
        .env("AWS_LAMBDA_FUNCTION_NAME", "binaries-test")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    (out, started.elapsed())
}

fn no_connection(trap: &TcpListener, what: &str) {
    match trap.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("{what} connected to the database / runtime address (from {peer})"),
        Err(e) => panic!("accept: {e}"),
    }
}

#[test]
fn help_and_version_list_every_variable_and_start_nothing() {
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let bins: [(PathBuf, Groups); 4] = [
        (poolmgr_tests::local::server_bin().to_path_buf(), cli::POOLMGR_LOCAL),
        (function_bin("migrate"), cli::MIGRATE_BIN),
        (function_bin("claims"), cli::FUNCTION),
        (function_bin("reconcile"), cli::FUNCTION),
    ];
    for (bin, groups) in &bins {
        let name = bin.file_name().unwrap().to_string_lossy().into_owned();
        let (out, took) = run(bin, &["--help"], &trap);
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --help: {out:?}");
        assert!(took < QUICKLY, "{name} --help took {took:?}");
        let mut listed = 0;
        for (_, vars) in *groups {
            for var in *vars {
                assert!(help.contains(&format!("[env: {}", var.name)), "{name} --help lacks {}:\n{help}", var.name);
                assert!(help.contains(&format!("[default: {}]", var.default)), "{name}: {}'s default", var.name);
                listed += 1;
            }
        }
        assert!(listed >= 10, "{name}: {listed}");
        assert!(!help.contains(SECRET), "{name} --help prints a variable's value:\n{help}");
        no_connection(&trap, &format!("{name} --help"));

        let (out, took) = run(bin, &["--version"], &trap);
        let version = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --version: {out:?}");
        assert!(took < QUICKLY, "{name} --version took {took:?}");
        assert!(version.starts_with(&format!("{name} {}", env!("CARGO_PKG_VERSION"))), "{version}");
        no_connection(&trap, &format!("{name} --version"));
    }
    // poolmgr-local's help names the variables the README's table was missing.
    let (out, _) = run(&bins[0].0, &["--help"], &trap);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("POOLMGR_RECONCILE_MAX_CREATES") && help.contains("[default: 50]"), "{help}");
    assert!(help.contains("--events-retention"), "{help}");
}

/// The Lambda functions and migrate read the environment only: an option would be ignored
/// there, so it is refused before anything starts, naming the variable to set.
#[test]
fn an_option_to_a_function_binary_is_refused_naming_the_variable() {
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let (out, took) = run(&function_bin("claims"), &["--db-pool-size", "3"], &trap);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("set POOLMGR_DB_POOL_SIZE"), "{stderr}");
    assert!(took < QUICKLY);
    let (out, _) = run(&function_bin("migrate"), &["--no-such-option"], &trap);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    no_connection(&trap, "a refused option");
}
