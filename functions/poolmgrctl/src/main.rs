//! `poolmgrctl`: the command-line client of poolmgr over its HTTP API
//! (`shared/http-api.md`). Run `poolmgrctl --help` for the command tree.

mod cli;
mod client;
mod error;
mod events;
mod host;
mod lease;
mod output;
mod pool;
mod vm;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use poolmgr_core::domain::PoolRef;

use crate::cli::{Cli, Command, Format};
use crate::client::Client;
use crate::error::CliError;

/// What every command needs.
pub struct Ctx {
    pub client: Client,
    pub format: Format,
}

/// `NAMESPACE/NAME`, or `NAME` in namespace `default`.
pub fn parse_pool_ref(s: &str) -> Result<PoolRef, CliError> {
    let (ns, name) = s.split_once('/').unwrap_or(("default", s));
    PoolRef::parse(ns, name).map_err(|e| CliError::usage(format!("pool {s:?}: {e}")))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completion { shell } = cli.command {
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "poolmgrctl", &mut out);
        return match output::emit(&String::from_utf8_lossy(&out)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&e),
        };
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&CliError::new("internal", format!("cannot start the async runtime: {e}"))),
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn fail(e: &CliError) -> ExitCode {
    eprintln!("{e}");
    ExitCode::from(e.exit_code())
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let g = cli.global;
    let ctx = Ctx { client: Client::new(&g.endpoint, g.token, g.timeout)?, format: g.output };
    match cli.command {
        Command::Pool(c) => pool::run(&ctx, c).await,
        Command::Lease(c) => lease::run(&ctx, c).await,
        Command::Vm(c) => vm::run(&ctx, c).await,
        Command::Host(c) => host::run(&ctx, c).await,
        Command::Events(c) => events::run(&ctx, c).await,
        Command::Completion { .. } => unreachable!("handled before the runtime starts"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_refs() {
        assert_eq!(parse_pool_ref("ci").unwrap().to_string(), "default/ci");
        assert_eq!(parse_pool_ref("team-a/ci").unwrap().to_string(), "team-a/ci");
        for bad in ["", "a/", "/b", "A/b", "a/b/c", "a_b"] {
            assert_eq!(parse_pool_ref(bad).unwrap_err().exit_code(), 2, "{bad:?}");
        }
    }
}
