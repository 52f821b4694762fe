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
            let r = ctx.send(Call::list_hosts()).await?;
            let v: Value = r.json()?;
            show(ctx, &r.body, v["hosts"].as_array().map(Vec::as_slice).unwrap_or_default())
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
        None => HostTls { insecure: true, ..Default::default() },
        Some(ca) => {
            let mut tls = HostTls { insecure: false, ca_pem: Some(read_pem("--ca-file", ca)?), ..Default::default() };
            if let (Some(c), Some(k)) = (&a.cert_file, &a.key_file) {
                tls.cert_pem = Some(read_pem("--cert-file", c)?);
                tls.key_pem = Some(read_pem("--key-file", k)?);
            }
            tls
        }
    };
    Ok(HostSpec {
        name: a.name.clone(),
        address: a.address.clone(),
        tls,
        basic_auth_token: a.basic_auth_token.clone(),
        exec: a.exec.map(Into::into),
    })
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
