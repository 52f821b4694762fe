//! `poolmgrctl vm …`

use poolmgr_client::{Call, VmQuery};
use serde_json::Value;

use crate::cli::{Format, VmCmd};
use crate::error::CliError;
use crate::output::{Table, cell, emit_document, pool_cell, printable};
use crate::{Ctx, parse_pool_ref};

pub async fn run(ctx: &Ctx, cmd: VmCmd) -> Result<(), CliError> {
    match cmd {
        VmCmd::List { pool, namespace, phase } => {
            let mut q = match pool.as_deref().map(parse_pool_ref).transpose()? {
                Some(p) => VmQuery::pool(&p),
                None => VmQuery::default(),
            };
            if let Some(ns) = namespace {
                poolmgr_client::validate_name("namespace", &ns).map_err(CliError::usage)?;
                q.namespace = Some(ns);
            }
            q.phase = phase;
            let (raw, vms) = ctx.list_all(Call::list_vms(&q), "vms").await?;
            show(ctx, &raw, &vms)
        }
        VmCmd::Get { id } => {
            let r = ctx.send(Call::get_vm(&id)).await?;
            show(ctx, &r.body, &[r.json()?])
        }
        VmCmd::Delete { id } => {
            ctx.send(Call::delete_vm(&id)).await?;
            ctx.done(&id, &format!("vm {} deleted", printable(&id)))
        }
    }
}

fn show(ctx: &Ctx, raw: &[u8], vms: &[Value]) -> Result<(), CliError> {
    match &ctx.format {
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
            ctx.table(&t)
        }
        f => emit_document(f, raw, || vms.iter().map(|v| cell(&v["id"])).collect()),
    }
}
