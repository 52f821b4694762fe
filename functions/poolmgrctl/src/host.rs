//! `poolmgrctl host …`

use std::path::Path;

use poolmgr_client::{Call, HostSpec, HostTls, Reply};
use serde_json::{Value, json};

use crate::Ctx;
use crate::cli::{Format, HostArgs, HostCmd};
use crate::error::CliError;
use crate::output::{Table, cell, emit_document, printable};

pub async fn run(ctx: &Ctx, cmd: HostCmd) -> Result<(), CliError> {
    match cmd {
        HostCmd::Add(a) => show_one(ctx, &ctx.send(Call::create_host(&host_spec(&a)?)).await?),
        HostCmd::Update(a) => show_one(ctx, &ctx.send(Call::update_host(&host_spec(&a)?)).await?),
        HostCmd::Remove { name } => {
            ctx.send(Call::delete_host(&name)).await?;
            ctx.done(&name, &format!("host {} removed", printable(&name)))
        }
        HostCmd::Get { name } => show_one(ctx, &ctx.send(Call::get_host(&name)).await?),
        HostCmd::List => {
            let (raw, hosts) = ctx.list_all(Call::list_hosts(), "hosts").await?;
            show(ctx, &raw, &hosts)
        }
        HostCmd::Cordon { name, reason } => {
            show_one(ctx, &ctx.send(Call::cordon_host(&name, reason.as_deref())).await?)
        }
        HostCmd::Uncordon { name } => show_one(ctx, &ctx.send(Call::uncordon_host(&name)).await?),
    }
}

fn read_pem(flag: &str, path: &Path) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("{flag} {}: {e}", path.display())))
}

/// The HostSpec: `tls.insecure` for plaintext, else the PEM files' contents.
fn host_spec(a: &HostArgs) -> Result<HostSpec, CliError> {
    poolmgr_client::validate_name("name", &a.name).map_err(CliError::usage)?;
    let tls = match &a.ca_file {
        None => HostTls::insecure(),
        Some(ca) => {
            let mut tls = HostTls::with_ca(read_pem("--ca-file", ca)?);
            if let (Some(c), Some(k)) = (&a.cert_file, &a.key_file) {
                tls.cert_pem = Some(read_pem("--cert-file", c)?);
                tls.key_pem = Some(read_pem("--key-file", k)?);
            }
            tls
        }
    };
    let mut spec = HostSpec::new(&a.name, &a.address, tls);
    spec.basic_auth_token = a.basic_auth_token.clone();
    spec.exec = a.exec.map(Into::into);
    Ok(spec)
}

fn show_one(ctx: &Ctx, r: &Reply) -> Result<(), CliError> {
    show(ctx, &r.body, &[r.json()?])
}

fn show(ctx: &Ctx, raw: &[u8], hosts: &[Value]) -> Result<(), CliError> {
    match &ctx.format {
        Format::Table => {
            let mut t = Table::new(&["NAME", "ADDRESS", "TLS", "EXEC", "CORDONED", "VMS", "REASON"]);
            for h in hosts {
                let tls = &h["tls"];
                let mode = if tls["insecure"] == json!(true) {
                    "insecure"
                } else if tls["cert_pem"].is_string() {
                    "mtls"
                } else {
                    "tls"
                };
                t.row(vec![
                    cell(&h["name"]),
                    cell(&h["address"]),
                    mode.into(),
                    cell(&h["exec"]),
                    cell(&h["cordoned"]),
                    cell(&h["vm_count"]),
                    cell(&h["cordoned_reason"]),
                ]);
            }
            ctx.table(&t)
        }
        f => emit_document(f, raw, || hosts.iter().map(|h| cell(&h["name"])).collect()),
    }
}
