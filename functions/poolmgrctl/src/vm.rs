//! `poolmgrctl vm …`

use reqwest::Method;
use serde_json::Value;

use crate::cli::{Format, VmCmd};
use crate::client::Req;
use crate::error::CliError;
use crate::output::{Table, cell, emit, emit_document, pool_cell};
use crate::{Ctx, parse_pool_ref};

pub async fn run(ctx: &Ctx, cmd: VmCmd) -> Result<(), CliError> {
    match cmd {
        VmCmd::List { pool, namespace, phase } => {
            let mut req = Req::get(&["v1", "vms"]);
            if let Some(p) = pool.as_deref().map(parse_pool_ref).transpose()? {
                req = req.query("namespace", p.namespace).query("pool", p.name);
            }
            if let Some(ns) = namespace {
                poolmgr_core::domain::validate_name("namespace", &ns).map_err(CliError::usage)?;
                req = req.query("namespace", ns);
            }
            if let Some(ph) = phase {
                req = req.query("phase", ph);
            }
            let r = ctx.client.send(req).await?;
            let vms = r.json["vms"].as_array().cloned().unwrap_or_default();
            show(ctx, &r.raw, &vms)
        }
        VmCmd::Get { id } => {
            let r = ctx.client.send(Req::get(&["v1", "vms", &id])).await?;
            show(ctx, &r.raw, std::slice::from_ref(&r.json))
        }
        VmCmd::Delete { id } => {
            ctx.client.send(Req::new(Method::DELETE, &["v1", "vms", &id])).await?;
            if ctx.format == Format::Table {
                emit(&format!("vm {id} deleted\n"))?;
            }
            Ok(())
        }
    }
}

fn show(ctx: &Ctx, raw: &[u8], vms: &[Value]) -> Result<(), CliError> {
    match ctx.format {
        Format::Table => {
            let mut t = Table::new(&["ID", "POOL", "HOST", "PHASE", "LEASE_ID", "CREATED"]);
            for v in vms {
                t.row(vec![
                    cell(&v["id"]),
                    pool_cell(&v["pool"]),
                    cell(&v["flintlock_host"]),
                    cell(&v["phase"]),
                    cell(&v["lease_id"]),
                    cell(&v["created_at"]),
                ]);
            }
            emit(&t.render())
        }
        f => emit_document(f, raw),
    }
}
