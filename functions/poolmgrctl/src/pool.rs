//! `poolmgrctl pool …`

use std::io::{IsTerminal, Read};
use std::path::Path;
use std::pin::pin;
use std::time::Duration;

use poolmgr_client::{Call, ExpectRequest, PoolRef, PoolSpec, Reply};
use serde_json::Value;

use crate::cli::{Format, PoolCmd, RolloutCmd};
use crate::error::{CliError, EXIT_UNAVAILABLE};
use crate::output::{Table, cell, emit, emit_document, pool_cell, stream_document};
use crate::{Ctx, parse_pool_ref};

pub async fn run(ctx: &Ctx, cmd: PoolCmd) -> Result<(), CliError> {
    match cmd {
        PoolCmd::Create(f) => {
            let spec = load_spec(&f.file)?;
            let r = ctx.send(Call::create_pool(&spec)).await?;
            show_pools(ctx, &r.body, &[r.json()?])
        }
        PoolCmd::Update(f) => {
            let spec = load_spec(&f.file)?;
            let r = ctx.send(Call::update_pool(&spec)).await?;
            show_pools(ctx, &r.body, &[r.json()?])
        }
        PoolCmd::Apply { file, dry_run } => crate::apply::apply(ctx, &file, dry_run).await,
        PoolCmd::Diff { file } => match crate::apply::diff(ctx, &file).await {
            Ok(false) => Ok(()),
            Ok(true) => Err(CliError::differences()),
            // kubectl diff's rule: 1 means differences, so no error may exit 1.
            Err(e) if e.exit_code() == crate::error::EXIT_OTHER => Err(e.exit_with(crate::error::EXIT_DIFF_FAILED)),
            Err(e) => Err(e),
        },
        PoolCmd::Get { pool } => {
            let r = ctx.send(Call::get_pool(&parse_pool_ref(&pool)?)).await?;
            show_pools(ctx, &r.body, &[r.json()?])
        }
        PoolCmd::List { namespace } => {
            if let Some(ns) = &namespace {
                poolmgr_client::validate_name("namespace", ns).map_err(CliError::usage)?;
            }
            let (raw, pools) = ctx.list_all(Call::list_pools(namespace.as_deref()), "pools").await?;
            show_pools(ctx, &raw, &pools)
        }
        PoolCmd::Delete { pool, force } => {
            let p = parse_pool_ref(&pool)?;
            ctx.send(Call::delete_pool(&p, force)).await?;
            ctx.done(&p.to_string(), &format!("pool {p} deleted"))
        }
        PoolCmd::Expect { pool, claims, within } => {
            let p = parse_pool_ref(&pool)?;
            let within_seconds = i32::try_from(within.as_secs()).unwrap_or(i32::MAX);
            let req = ExpectRequest::new(claims, within_seconds);
            req.validate().map_err(CliError::usage)?;
            let r = ctx.send(Call::expect(&p, &req)).await?;
            match &ctx.format {
                Format::Table => {
                    let v: Value = r.json()?;
                    emit(&format!(
                        "pool {p}: {claims} claims expected within {}; working towards {} VMs until {}\n",
                        humantime::format_duration(within),
                        cell(&v["desired_size"]),
                        cell(&v["expected_until"])
                    ))
                }
                f => emit_document(f, &r.body, || vec![p.to_string()]),
            }
        }
        PoolCmd::Rollout(cmd) => rollout(ctx, cmd).await,
        PoolCmd::Wait { pool, available, interval } => wait(ctx, &parse_pool_ref(&pool)?, available, interval).await,
        PoolCmd::Status { pool, watch, interval } => {
            let p = parse_pool_ref(&pool)?;
            if watch {
                watch_status(ctx, &p, interval, status_table).await
            } else {
                let r = ctx.send(Call::get_pool(&p)).await?;
                match &ctx.format {
                    Format::Table => ctx.table(&status_table(&r.json()?)),
                    f => emit_document(f, &r.body, || vec![p.to_string()]),
                }
            }
        }
    }
}

fn show_pools(ctx: &Ctx, raw: &[u8], pools: &[Value]) -> Result<(), CliError> {
    match &ctx.format {
        Format::Table => {
            let mut t = Table::new(&[
                "POOL",
                "SIZE",
                "AVAILABLE",
                "CLAIMING",
                "LEASED",
                "PROVISIONING",
                "QUARANTINED",
                "DELETING",
                "STRATEGY",
                "HOSTS",
            ]);
            for p in pools {
                let (spec, st) = (&p["spec"], &p["status"]);
                let hosts: Vec<String> =
                    spec["flintlock_hosts"].as_array().map(|a| a.iter().map(cell).collect()).unwrap_or_default();
                t.row(vec![
                    pool_cell(spec),
                    cell(&spec["size"]),
                    cell(&st["available"]),
                    cell(&st["claiming"]),
                    cell(&st["leased"]),
                    cell(&st["provisioning"]),
                    cell(&st["quarantined"]),
                    cell(&st["deleting"]),
                    cell(&spec["replenishment"]["strategy"]),
                    if hosts.is_empty() { "<none>".into() } else { hosts.join(",") },
                ]);
            }
            ctx.table(&t)
        }
        f => emit_document(f, raw, || pools.iter().map(|p| pool_cell(&p["spec"])).collect()),
    }
}

async fn rollout(ctx: &Ctx, cmd: RolloutCmd) -> Result<(), CliError> {
    match cmd {
        RolloutCmd::Status { pool, watch, interval } => {
            let p = parse_pool_ref(&pool)?;
            if watch {
                return watch_status(ctx, &p, interval, rollout_table).await;
            }
            let r = ctx.send(Call::get_pool(&p)).await?;
            show_rollout(ctx, &r)
        }
        RolloutCmd::History { pool } => {
            let r = ctx.send(Call::pool_revisions(&parse_pool_ref(&pool)?)).await?;
            match &ctx.format {
                Format::Table => {
                    let v: Value = r.json()?;
                    let mut t = Table::new(&["REVISION", "CREATED", "ROLLED_OUT", "IMAGE", "CREATE_COMMANDS"]);
                    for rev in v["revisions"].as_array().map(Vec::as_slice).unwrap_or_default() {
                        let spec = &rev["spec"];
                        t.row(vec![
                            cell(&rev["revision"]),
                            cell(&rev["created_at"]),
                            cell(&rev["rolled_out"]),
                            cell(&spec["microvm_template"]["root_volume"]["source"]["container_source"]),
                            spec["create_commands"].as_array().map_or(0, Vec::len).to_string(),
                        ]);
                    }
                    ctx.table(&t)
                }
                f => emit_document(f, &r.body, || {
                    let v: Value = r.json().unwrap_or_default();
                    v["revisions"]
                        .as_array()
                        .map(|a| a.iter().map(|rev| cell(&rev["revision"])).collect())
                        .unwrap_or_default()
                }),
            }
        }
        RolloutCmd::Pause { pool } => {
            let r = ctx.send(Call::rollout_pause(&parse_pool_ref(&pool)?, true)).await?;
            show_rollout(ctx, &r)
        }
        RolloutCmd::Resume { pool } => {
            let r = ctx.send(Call::rollout_pause(&parse_pool_ref(&pool)?, false)).await?;
            show_rollout(ctx, &r)
        }
        RolloutCmd::Undo { pool, to_revision } => {
            if let Some(n) = to_revision.filter(|n| *n < 1) {
                return Err(CliError::usage(format!("--to-revision must be at least 1, got {n}")));
            }
            let r = ctx.send(Call::rollout_undo(&parse_pool_ref(&pool)?, to_revision)).await?;
            show_rollout(ctx, &r)
        }
    }
}

fn show_rollout(ctx: &Ctx, r: &Reply) -> Result<(), CliError> {
    match &ctx.format {
        Format::Table => ctx.table(&rollout_table(&r.json()?)),
        f => emit_document(f, &r.body, || vec![pool_cell(&r.json::<Value>().unwrap_or_default()["spec"])]),
    }
}

/// One row: the pool's rollout (`-` everywhere when none ever ran).
fn rollout_table(pool: &Value) -> Table {
    let ro = &pool["status"]["rollout"];
    let mut t = Table::new(&[
        "POOL",
        "REVISION",
        "STATE",
        "CURRENT",
        "TARGET",
        "BY_REVISION",
        "STALE_LEASED",
        "EXTRA_BOOTS",
        "HALTED_REASON",
    ]);
    let dash = |v: &Value| if v.is_null() { "-".to_owned() } else { cell(v) };
    let by_revision = ro["by_revision"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(rev, counts)| {
                    let parts: Vec<String> = counts
                        .as_object()
                        .map(|c| c.iter().map(|(k, n)| format!("{k}={n}")).collect())
                        .unwrap_or_default();
                    format!("{rev}:{}", parts.join("/"))
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "-".to_owned());
    t.row(vec![
        pool_cell(&pool["spec"]),
        cell(&pool["revision"]),
        dash(&ro["state"]),
        dash(&ro["current_revision"]),
        dash(&ro["target_revision"]),
        by_revision,
        dash(&ro["stale_leased"]),
        dash(&ro["extra_boots"]),
        dash(&ro["halted_reason"]),
    ]);
    t
}

fn status_table(pool: &Value) -> Table {
    let (spec, st) = (&pool["spec"], &pool["status"]);
    let mut t = Table::new(&[
        "POOL",
        "SIZE",
        "DESIRED",
        "REASON",
        "AVAILABLE",
        "CLAIMING",
        "LEASED",
        "PROVISIONING",
        "QUARANTINED",
        "DELETING",
        "CLAIMS/S",
        "REFUSED/S",
        "PROVISION_P90",
        "EXPECTED",
        "BATCH_BUFFER",
    ]);
    let a = &st["autoscaling"];
    let rate = |v: &Value| v.as_f64().map_or_else(|| "-".to_owned(), |x| format!("{x:.2}"));
    let secs = |v: &Value| v.as_f64().map_or_else(|| "-".to_owned(), |x| format!("{x:.1}s"));
    t.row(vec![
        pool_cell(spec),
        cell(&spec["size"]),
        // Older servers send no desired size: the spec's size is what they work towards.
        if st["desired_size"].is_null() { cell(&spec["size"]) } else { cell(&st["desired_size"]) },
        if a.is_null() { "STATIC".to_owned() } else { cell(&a["reason"]) },
        cell(&st["available"]),
        cell(&st["claiming"]),
        cell(&st["leased"]),
        cell(&st["provisioning"]),
        cell(&st["quarantined"]),
        cell(&st["deleting"]),
        rate(&a["claims_per_second"]),
        rate(&a["refused_per_second"]),
        secs(&a["provisioning_seconds"]),
        if a.is_null() { "-".to_owned() } else { cell(&a["expected_claims"]) },
        if a["batch_buffer"].is_null() { "-".to_owned() } else { cell(&a["batch_buffer"]) },
    ]);
    t
}

/// Polls every `interval` and redraws until Ctrl-C. On a terminal the screen is redrawn; into
/// a pipe each poll adds a row (or a JSON line, or a YAML document). Unreachable servers are
/// reported and retried; any other error ends the watch.
async fn watch_status(ctx: &Ctx, p: &PoolRef, interval: Duration, render: fn(&Value) -> Table) -> Result<(), CliError> {
    let tty = std::io::stdout().is_terminal();
    let mut ctrl_c = pin!(tokio::signal::ctrl_c());
    let mut first = true;
    loop {
        let fetch = ctx.send(Call::get_pool(p));
        let r = tokio::select! {
            r = fetch => r,
            _ = &mut ctrl_c => return Ok(()),
        };
        match r {
            Ok(r) => {
                let text = match &ctx.format {
                    Format::Table => {
                        let table = render(&r.json()?).render(!ctx.no_headers);
                        if tty {
                            let now = chrono::Local::now().format("%H:%M:%S");
                            format!(
                                "\x1b[H\x1b[2JEvery {}: pool {p}  {now}  (Ctrl-C to stop)\n\n{table}",
                                humantime::format_duration(interval)
                            )
                        } else if first || ctx.no_headers {
                            table
                        } else {
                            table.lines().skip(1).map(|l| format!("{l}\n")).collect()
                        }
                    }
                    f => stream_document(f, &r.body, || vec![p.to_string()])?,
                };
                emit(&text)?;
                first = false;
            }
            Err(e) if e.exit_code() == EXIT_UNAVAILABLE => eprintln!("{e}; retrying"),
            Err(e) => return Err(e),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = &mut ctrl_c => return Ok(()),
        }
    }
}

/// `pool wait`: polls the pool until `want` VMs are AVAILABLE or the global --timeout passes
/// (each request bounded by what is left). Progress goes to standard error when the counts
/// change; an unreachable server is reported and polled again; any other error ends the wait.
async fn wait(ctx: &Ctx, p: &PoolRef, want: i64, interval: Duration) -> Result<(), CliError> {
    let start = tokio::time::Instant::now();
    let deadline = start + ctx.timeout;
    let mut last_line = String::new();
    let mut last: Option<Value> = None;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, ctx.send(Call::get_pool(p))).await {
            Ok(Ok(r)) => {
                let v: Value = r.json()?;
                let st = &v["status"];
                let available = st["available"].as_i64().unwrap_or(0);
                if available >= want {
                    eprintln!(
                        "pool {p}: {available} AVAILABLE (wanted {want}) after {:.1}s",
                        start.elapsed().as_secs_f64()
                    );
                    return match &ctx.format {
                        Format::Table => emit(&format!("pool {p}: {available} VMs AVAILABLE\n")),
                        f => emit_document(f, &r.body, || vec![p.to_string()]),
                    };
                }
                let line = progress(&v, want);
                if line != last_line {
                    eprintln!("pool {p}: {line}");
                    last_line = line;
                }
                last = Some(v);
            }
            Ok(Err(e)) if e.exit_code() == EXIT_UNAVAILABLE => eprintln!("{e}; retrying"),
            Ok(Err(e)) => return Err(e),
            Err(_) => {}
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            let had = last.as_ref().map_or_else(|| "no answer from the server".to_owned(), |v| progress(v, want));
            return Err(CliError::new(
                "deadline_exceeded",
                format!(
                    "pool {p} did not reach {want} AVAILABLE VMs within {}: it has {had}; wait longer with \
                     --timeout (e.g. --timeout 5m), or see why with `poolmgrctl events tail --pool {p} --no-follow` \
                     and `poolmgrctl vm list --pool {p}`",
                    humantime::format_duration(ctx.timeout)
                ),
            ));
        }
        tokio::time::sleep(interval.min(left)).await;
    }
}

/// `1/3 AVAILABLE, 2 PROVISIONING, …` and a note when the pool does not aim that high.
fn progress(pool: &Value, want: i64) -> String {
    let st = &pool["status"];
    let n = |k: &str| st[k].as_i64().unwrap_or(0);
    let mut line = format!(
        "{}/{want} AVAILABLE, {} PROVISIONING, {} LEASED, {} QUARANTINED",
        n("available"),
        n("provisioning"),
        n("leased"),
        n("quarantined")
    );
    let target = st["desired_size"].as_i64().or_else(|| pool["spec"]["size"].as_i64()).unwrap_or(0);
    if target < want {
        line.push_str(&format!("; the pool works towards {target} VMs in all"));
    }
    line
}

/// Reads a PoolSpec file (JSON or YAML) and checks it locally — its syntax, the type of
/// every field, unknown fields (a typo), and the contract's rules on its own fields — so
/// errors name the field before anything is sent. The template (`microvm_template`) and the
/// hosts are the server's to check.
pub fn load_spec(path: &Path) -> Result<PoolSpec, CliError> {
    let stdin = path.as_os_str() == "-";
    let name = if stdin { "<stdin>".to_owned() } else { path.display().to_string() };
    let text = if stdin {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|e| CliError::usage(format!("cannot read {name}: {e}")))?;
        s
    } else {
        std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("cannot read {name}: {e}")))?
    };
    parse_spec(&name, path.extension().and_then(|e| e.to_str()), &text)
}

fn parse_spec(name: &str, ext: Option<&str>, text: &str) -> Result<PoolSpec, CliError> {
    let json = match ext.map(str::to_ascii_lowercase).as_deref() {
        Some("json") => true,
        Some("yaml" | "yml") => false,
        _ => text.trim_start().starts_with('{'),
    };
    let value: Value = if json {
        serde_json::from_str(text).map_err(|e| CliError::usage(format!("{name}: invalid JSON: {e}")))?
    } else {
        yaml_serde::from_str(text).map_err(|e| CliError::usage(format!("{name}: invalid YAML: {e}")))?
    };
    spec_from_value(name, value)
}

/// One PoolSpec document (`name` says where it came from), checked as [`load_spec`] says.
pub fn spec_from_value(name: &str, value: Value) -> Result<PoolSpec, CliError> {
    if !value.is_object() {
        return Err(CliError::usage(format!("{name}: a PoolSpec must be an object (a mapping)")));
    }
    // The client's types ignore fields they do not know (a newer server's); a file must not
    // have any: each one is a typo the server would refuse.
    let mut unknown = Vec::new();
    let mut note = |p: serde_ignored::Path<'_>| unknown.push(p.to_string());
    let parsed: Result<PoolSpec, _> =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(value, &mut note));
    // Unknown fields first: `sise: 2` is a typo before it is a missing `size`.
    let typo = (!unknown.is_empty()).then(|| format!("unknown field {}", unknown.join(", ")));
    let spec = match (parsed, typo) {
        (Ok(spec), None) => spec,
        (Ok(_), Some(t)) => return Err(CliError::usage(format!("{name}: {t}"))),
        (Err(e), typo) => {
            let at = e.path().to_string();
            let at = if at == "." { String::new() } else { format!("{at}: ") };
            let typo = typo.map(|t| format!("{t}; ")).unwrap_or_default();
            return Err(CliError::usage(format!("{name}: {typo}{at}{}", e.inner())));
        }
    };
    spec.validate().map_err(|e| CliError::usage(format!("{name}: {e}")))?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = r#"
name: ci
size: 2
flintlock_hosts: [sim]
replenishment:
  strategy: MIN_SIZE_THRESHOLD
  min_size: 1
microvm_template:
  root_volume: {id: root, source: {container_source: "ghcr.io/liquidmetal-dev/ubuntu:22.04"}}
  kernel: {image: "ghcr.io/liquidmetal-dev/kernel:6.1", filename: boot/vmlinux, add_network_config: true}
  interfaces: [{device_id: eth1, type: TAP}]
"#;

    #[test]
    fn yaml_spec_is_sent_as_written() {
        let spec = parse_spec("spec.yaml", Some("yaml"), YAML).unwrap();
        assert_eq!(spec.pool_ref().to_string(), "default/ci");
        let v = serde_json::to_value(&spec).unwrap();
        assert_eq!(v["size"], 2);
        assert_eq!(v["microvm_template"], yaml_serde::from_str::<Value>(YAML).unwrap()["microvm_template"]);
        for absent in ["namespace", "hook_failure_policy", "heartbeat_expiry_seconds"] {
            assert!(v.get(absent).is_none(), "defaults are the server's business: {v}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let bad = YAML.replace("min_size: 1", "min_size: 5");
        let e = parse_spec("spec.yaml", Some("yaml"), &bad).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.message.contains("replenishment.min_size"), "{e}");

        let bad = YAML.replace("strategy: MIN_SIZE_THRESHOLD", "strategy: SOMETIMES");
        let e = parse_spec("spec.yaml", Some("yaml"), &bad).unwrap_err();
        assert!(e.message.contains("replenishment.strategy"), "{e}");

        let bad = YAML.replace("size: 2", "sise: 2");
        let e = parse_spec("spec.yaml", None, &bad).unwrap_err();
        assert!(e.message.starts_with("spec.yaml: unknown field sise; missing field `size`"), "{e}");

        let bad = YAML.replace("min_size: 1", "min_size: 1\n  colour: red");
        let e = parse_spec("spec.yaml", None, &bad).unwrap_err();
        assert_eq!(e.message, "spec.yaml: unknown field replenishment.colour");

        let bad = YAML.replace("size: 2", "size: two");
        let e = parse_spec("spec.yaml", None, &bad).unwrap_err();
        assert!(e.message.starts_with("spec.yaml: size: invalid type"), "{e}");

        let e = parse_spec("spec.json", Some("json"), "{\"name\": ").unwrap_err();
        assert!(e.message.starts_with("spec.json: invalid JSON"), "{e}");
    }

    #[test]
    fn json_is_detected_without_an_extension() {
        let v: Value = yaml_serde::from_str(YAML).unwrap();
        let spec = parse_spec("<stdin>", None, &v.to_string()).unwrap();
        assert_eq!(spec.name, "ci");
    }
}
