//! `poolmgrctl events tail`: follows the cursor feed with long-polls.

use std::pin::pin;
use std::time::Duration;

use poolmgr_client::EventQuery;
use poolmgr_client::events::MAX_WAIT_SECONDS;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::cli::{EventsCmd, Format};
use crate::error::{CliError, EXIT_UNAVAILABLE};
use crate::output::{Table, cell, emit, pool_cell, stream_document};
use crate::{Ctx, parse_pool_ref};

const RETRY_DELAY: Duration = Duration::from_secs(2);
const HEADERS: [&str; 6] = ["ID", "TIME", "TYPE", "POOL", "VM", "LEASE_ID"];

pub async fn run(ctx: &Ctx, cmd: EventsCmd) -> Result<(), CliError> {
    let EventsCmd::Tail { pool, since, no_follow, limit } = cmd;
    if since < 0 {
        return Err(CliError::usage("--since must not be negative"));
    }
    let pool = pool.as_deref().map(parse_pool_ref).transpose()?;
    let follow = !no_follow;
    // The library's feed keeps the cursor; the events stay as the server wrote them.
    let q = EventQuery::after(since)
        .with_pool(pool)
        .with_limit(limit)
        .with_wait_seconds(follow.then_some(MAX_WAIT_SECONDS));
    let mut feed = ctx.client.event_feed::<Box<RawValue>>(q);
    let mut ctrl_c = pin!(tokio::signal::ctrl_c());
    let mut collected: Vec<Value> = Vec::new();
    let mut header_done = false;
    loop {
        let r = tokio::select! {
            r = feed.next_batch() => r.map_err(|e| ctx.explain(e)),
            _ = &mut ctrl_c => return stopped(feed.cursor()),
        };
        let events = match r {
            Ok(events) => events,
            Err(e) if follow && e.exit_code() == EXIT_UNAVAILABLE => {
                eprintln!("{e}; retrying in {}s", RETRY_DELAY.as_secs());
                tokio::select! {
                    _ = tokio::time::sleep(RETRY_DELAY) => continue,
                    _ = &mut ctrl_c => return stopped(feed.cursor()),
                }
            }
            Err(e) => return Err(e),
        };
        let n = events.len();
        let mut text = String::new();
        for raw in &events {
            match &ctx.format {
                Format::Table => {
                    let v: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
                    if follow {
                        if !header_done && !ctx.no_headers {
                            text.push_str(&stream_line(&HEADERS.map(String::from)));
                            header_done = true;
                        }
                        text.push_str(&stream_line(&row(&v)));
                    } else {
                        collected.push(v);
                    }
                }
                // One document per event: JSON on a line, a YAML document, a filter's output.
                f => match stream_document(f, raw.get().as_bytes(), || {
                    let v: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
                    vec![cell(&v["id"])]
                }) {
                    Ok(t) => text.push_str(&t),
                    // The events before this one are printed before the error.
                    Err(e) => return Err(e.after_output(std::mem::take(&mut text))),
                },
            }
        }
        emit(&text)?;
        if !follow && (n as i64) < limit {
            if ctx.format == Format::Table {
                let mut t = Table::new(&HEADERS);
                for v in &collected {
                    t.row(row(v).to_vec());
                }
                ctx.table(&t)?;
            }
            return Ok(());
        }
    }
}

fn stopped(after: i64) -> Result<(), CliError> {
    eprintln!("stopped after event {after}: resume with --since {after}");
    Ok(())
}

fn row(v: &Value) -> [String; 6] {
    [
        cell(&v["id"]),
        cell(&v["created_at"]),
        cell(&v["type"]),
        pool_cell(&v["pool"]),
        cell(&v["vm_id"]),
        cell(&v["lease_id"]),
    ]
}

/// A row of a table whose width is not known in advance (a followed feed): fixed columns wide
/// enough for the usual values.
fn stream_line(cells: &[String; 6]) -> String {
    let [id, time, kind, pool, vm, lease] = cells;
    format!("{id:<8}  {time:<27}  {kind:<25}  {pool:<24}  {vm:<36}  {lease}\n")
}
