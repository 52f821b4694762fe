//! `poolmgrctl`: the command-line client of poolmgr over its HTTP API
//! (`shared/http-api.md`), built on `poolmgr-client`. Run `poolmgrctl --help` for the command
//! tree.
//!
//! Every request goes through `poolmgr-client` (its routes, errors and the safe retrying
//! claim); this crate parses flags, finds the endpoint and token ([`config`]), and prints.

mod apply;
mod cli;
mod config;
mod context;
mod error;
mod events;
mod filter;
mod host;
mod lease;
mod output;
mod pool;
mod run;
mod vm;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use poolmgr_client::{Call, Client, PoolRef, Reply};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::cli::{Cli, Command, Format};
use crate::error::CliError;
use crate::output::Table;

/// What every command needs.
pub struct Ctx {
    pub client: Client,
    pub format: Format,
    pub no_headers: bool,
    /// The global --timeout: one request's, or a whole `pool wait`'s.
    pub timeout: std::time::Duration,
}

impl Ctx {
    /// One request; the error says how to give a token when none was given.
    pub async fn send(&self, call: Call) -> Result<Reply, CliError> {
        self.client.send(call).await.map_err(|e| self.explain(e))
    }

    pub fn explain(&self, e: poolmgr_client::Error) -> CliError {
        let mut e = CliError::from(e);
        if e.status == "unauthenticated" && !self.client.has_token() {
            e.message.push_str(" (no token given: use --token-file, --token, POOLMGR_TOKEN or a context's token)");
        }
        e
    }

    /// Every page of a paginated list (`key` is its field: `pools`, `vms`, `hosts`,
    /// `leases`), read through the client's paginator: the items as the server sent them, and
    /// one document `{key: [...], "next_page_token": ""}` holding all of them.
    pub async fn list_all(&self, call: Call, key: &str) -> Result<(Vec<u8>, Vec<Value>), CliError> {
        let mut pages = self.client.pages::<RawPage>(call);
        let mut items: Vec<Box<RawValue>> = Vec::new();
        while let Some(p) = pages.next_page().await.map_err(|e| self.explain(e))? {
            items.extend(p.items);
        }
        let mut doc = serde_json::Map::new();
        doc.insert(key.to_owned(), serde_json::to_value(&items).map_err(|e| CliError::new("internal", e.to_string()))?);
        doc.insert("next_page_token".into(), Value::String(String::new()));
        let raw = serde_json::to_vec(&doc).map_err(|e| CliError::new("internal", e.to_string()))?;
        let values = items.iter().map(|i| serde_json::from_str(i.get()).unwrap_or(Value::Null)).collect();
        Ok((raw, values))
    }

    /// Prints a table (without its header under --no-headers).
    pub fn table(&self, t: &Table) -> Result<(), CliError> {
        output::emit(&t.render(!self.no_headers))
    }

    /// After a command that answers nothing (a delete, a release): `done` in a table, the
    /// name under `-o name`, nothing otherwise.
    pub fn done(&self, name: &str, done: &str) -> Result<(), CliError> {
        match self.format {
            Format::Table => output::emit(&format!("{done}\n")),
            Format::Name => output::emit(&format!("{}\n", output::printable(name))),
            _ => Ok(()),
        }
    }
}

/// One page of any list, its items kept as the server wrote them.
#[derive(Deserialize)]
struct RawPage {
    #[serde(alias = "leases", alias = "pools", alias = "vms", alias = "hosts")]
    items: Vec<Box<RawValue>>,
    #[serde(default)]
    next_page_token: String,
}

impl poolmgr_client::Page for RawPage {
    type Item = Box<RawValue>;
    fn next_page_token(&self) -> &str {
        &self.next_page_token
    }
    fn into_items(self) -> Vec<Box<RawValue>> {
        self.items
    }
}

/// `NAMESPACE/NAME`, or `NAME` in namespace `default`.
pub fn parse_pool_ref(s: &str) -> Result<PoolRef, CliError> {
    PoolRef::parse(s).map_err(CliError::usage)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let done = match cli.command {
        Command::Completion { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "poolmgrctl", &mut out);
            output::emit(&String::from_utf8_lossy(&out))
        }
        Command::Man { dir } => output::man_pages(Cli::command(), dir.as_deref()),
        Command::Context(c) => output::resolve_format(&cli.global).and_then(|f| context::run(&cli.global, f, c)),
        command => match (
            output::resolve_format(&cli.global),
            tokio::runtime::Builder::new_current_thread().enable_all().build(),
        ) {
            (Err(e), _) => Err(e),
            (Ok(format), Ok(rt)) => rt.block_on(run(cli.global, format, command)),
            (Ok(_), Err(e)) => Err(CliError::new("internal", format!("cannot start the async runtime: {e}"))),
        },
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // What must not be lost (the answer a failed --jq filter did not print) first.
            if let Some(text) = &e.output {
                let _ = output::emit(text);
            }
            if !e.is_silent() {
                eprintln!("{e}");
            }
            ExitCode::from(e.exit_code())
        }
    }
}

async fn run(g: cli::Global, format: Format, command: Command) -> Result<(), CliError> {
    let target = config::resolve(&g, &config::Env::process())?;
    let mut b = Client::builder(&target.endpoint)
        .timeout(g.timeout)
        .connect_timeout(g.connect_timeout)
        .user_agent(concat!("poolmgrctl/", env!("CARGO_PKG_VERSION")));
    if let Some(t) = target.token {
        b = b.token(t);
    }
    if let Some(ca) = target.ca_file {
        b = b.ca_file(ca);
    }
    let client = b.build()?;
    let ctx = Ctx { client, format, no_headers: g.no_headers, timeout: g.timeout };
    match command {
        Command::Pool(c) => pool::run(&ctx, c).await,
        Command::Lease(c) => lease::run(&ctx, c).await,
        Command::Vm(c) => vm::run(&ctx, c).await,
        Command::Host(c) => host::run(&ctx, c).await,
        Command::Events(c) => events::run(&ctx, c).await,
        Command::Completion { .. } | Command::Man { .. } | Command::Context(_) => {
            unreachable!("handled before the runtime starts")
        }
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
