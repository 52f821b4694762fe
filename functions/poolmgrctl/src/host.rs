//! `poolmgrctl host …`

use std::path::Path;

use reqwest::Method;
use serde_json::{Value, json};

use crate::Ctx;
use crate::cli::{Format, HostArgs, HostCmd};
use crate::client::{Reply, Req};
use crate::error::CliError;
use crate::output::{Table, cell, emit, emit_document};

pub async fn run(ctx: &Ctx, cmd: HostCmd) -> Result<(), CliError> {
    match cmd {
        HostCmd::Add(a) => {
            let body = host_body(&a)?;
            let r = ctx.client.send(Req::new(Method::POST, &["v1", "hosts"]).body(&body)).await?;
            show_one(ctx, &r)
        }
        HostCmd::Update(a) => {
            let body = host_body(&a)?;
            let r = ctx.client.send(Req::new(Method::PUT, &["v1", "hosts", &a.name]).body(&body)).await?;
            show_one(ctx, &r)
        }
        HostCmd::Remove { name } => {
            ctx.client.send(Req::new(Method::DELETE, &["v1", "hosts", &name])).await?;
            if ctx.format == Format::Table {
                emit(&format!("host {name} removed\n"))?;
            }
            Ok(())
        }
        HostCmd::Get { name } => {
            let r = ctx.client.send(Req::get(&["v1", "hosts", &name])).await?;
            show_one(ctx, &r)
        }
        HostCmd::List => {
            let r = ctx.client.send(Req::get(&["v1", "hosts"])).await?;
            let hosts = r.json["hosts"].as_array().cloned().unwrap_or_default();
            show(ctx, &r.raw, &hosts)
        }
        HostCmd::Cordon { name, reason } => {
            let body = match reason {
                Some(r) => json!({"reason": r}),
                None => json!({}),
            };
            let r = ctx.client.send(Req::new(Method::POST, &["v1", "hosts", &name, "cordon"]).body(&body)).await?;
            show_one(ctx, &r)
        }
        HostCmd::Uncordon { name } => {
            let r = ctx.client.send(Req::new(Method::POST, &["v1", "hosts", &name, "uncordon"])).await?;
            show_one(ctx, &r)
        }
    }
}

fn read_pem(flag: &str, path: &Path) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("{flag} {}: {e}", path.display())))
}

/// The HostSpec body: `tls.insecure` for plaintext, else the PEM files' contents.
fn host_body(a: &HostArgs) -> Result<Value, CliError> {
    poolmgr_core::domain::validate_name("name", &a.name).map_err(CliError::usage)?;
    let tls = match &a.ca_file {
        None => json!({"insecure": true}),
        Some(ca) => {
            let mut tls = json!({"insecure": false, "ca_pem": read_pem("--ca-file", ca)?});
            if let (Some(c), Some(k)) = (&a.cert_file, &a.key_file) {
                tls["cert_pem"] = json!(read_pem("--cert-file", c)?);
                tls["key_pem"] = json!(read_pem("--key-file", k)?);
            }
            tls
        }
    };
    let mut body = json!({"name": a.name, "address": a.address, "tls": tls});
    if let Some(t) = &a.basic_auth_token {
        body["basic_auth_token"] = json!(t);
    }
    if let Some(e) = a.exec {
        body["exec"] = json!(e.as_str());
    }
    Ok(body)
}

fn show_one(ctx: &Ctx, r: &Reply) -> Result<(), CliError> {
    show(ctx, &r.raw, std::slice::from_ref(&r.json))
}

fn show(ctx: &Ctx, raw: &[u8], hosts: &[Value]) -> Result<(), CliError> {
    match ctx.format {
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
            emit(&t.render())
        }
        f => emit_document(f, raw),
    }
}
