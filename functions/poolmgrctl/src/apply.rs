//! `poolmgrctl pool apply|diff -f FILE|DIR`: pools from files, kubectl `apply`/`diff` style.
//!
//! Every file is read and checked (as `pool create` checks one) before anything is sent, so
//! a bad document changes nothing. A file holds one PoolSpec or several: YAML documents
//! separated by `---`, or a JSON array; a directory stands for its `*.yaml`, `*.yml` and
//! `*.json` files, sorted by name. A pool may be named once in all of them.
//!
//! Apply reads each pool with its ETag, compares its spec with the file's ([`normalized`]:
//! the server's defaults written out on neither side), and creates it, leaves it, or PUTs the
//! file's spec with `If-Match: <that ETag>`. It must never update a pool without the ETag it
//! compared against: a pool someone changed since the read answers 412, and apply says so
//! instead of overwriting their change.

use std::io::Read;
use std::path::Path;

use poolmgr_client::{Call, PoolRef, PoolSpec};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Ctx;
use crate::cli::Format;
use crate::error::CliError;
use crate::output::{emit, emit_document, printable};
use crate::pool::spec_from_value;

/// One PoolSpec document and where it came from (`ci.yaml`, `pools.yaml (document 2)`).
pub struct Doc {
    pub source: String,
    pub spec: PoolSpec,
}

/// Every document of `path` (a file, `-` for standard input, or a directory), checked.
pub fn load(path: &Path) -> Result<Vec<Doc>, CliError> {
    let mut docs = Vec::new();
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map_err(|e| CliError::usage(format!("cannot read <stdin>: {e}")))?;
        docs.extend(parse("<stdin>", None, &text)?);
    } else if path.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(path)
            .map_err(|e| CliError::usage(format!("cannot read directory {}: {e}", path.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && matches!(ext(p).as_deref(), Some("yaml" | "yml" | "json")))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(CliError::usage(format!("{} has no *.yaml, *.yml or *.json file", path.display())));
        }
        for f in files {
            docs.extend(read_file(&f)?);
        }
    } else {
        docs.extend(read_file(path)?);
    }
    if docs.is_empty() {
        return Err(CliError::usage(format!("{}: no PoolSpec in it", path.display())));
    }
    let mut seen: Vec<(PoolRef, &str)> = Vec::new();
    for d in &docs {
        let p = d.spec.pool_ref();
        if let Some((_, first)) = seen.iter().find(|(q, _)| *q == p) {
            return Err(CliError::usage(format!("pool {p} is named twice: in {first} and in {}", d.source)));
        }
        seen.push((p, &d.source));
    }
    Ok(docs)
}

fn ext(p: &Path) -> Option<String> {
    p.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase)
}

fn read_file(p: &Path) -> Result<Vec<Doc>, CliError> {
    let name = p.display().to_string();
    let text = std::fs::read_to_string(p).map_err(|e| CliError::usage(format!("cannot read {name}: {e}")))?;
    parse(&name, ext(p).as_deref(), &text)
}

/// The documents of one file: a JSON object or array, or YAML documents (empty ones skipped).
fn parse(name: &str, ext: Option<&str>, text: &str) -> Result<Vec<Doc>, CliError> {
    let json = match ext {
        Some("json") => true,
        Some("yaml" | "yml") => false,
        _ => matches!(text.trim_start().chars().next(), Some('{' | '[')),
    };
    let values: Vec<Value> = if json {
        match serde_json::from_str(text).map_err(|e| CliError::usage(format!("{name}: invalid JSON: {e}")))? {
            Value::Array(a) => a,
            v => vec![v],
        }
    } else {
        let mut out = Vec::new();
        for (i, d) in yaml_serde::Deserializer::from_str(text).enumerate() {
            let v = Value::deserialize(d)
                .map_err(|e| CliError::usage(format!("{name}: document {}: invalid YAML: {e}", i + 1)))?;
            out.push(v);
        }
        out
    };
    let several = values.len() > 1;
    values
        .into_iter()
        .enumerate()
        .filter(|(_, v)| !v.is_null())
        .map(|(i, v)| {
            let source = if several { format!("{name} (document {})", i + 1) } else { name.to_owned() };
            Ok(Doc { spec: spec_from_value(&source, v)?, source })
        })
        .collect()
}

/// Defaults the server fills in for a field left out (`shared/http-api.md`, PoolSpec), by path.
/// A field at its default is left out on both sides of a comparison.
const DEFAULTS: &[(&str, &str)] = &[
    ("namespace", r#""default""#),
    ("hook_failure_policy", r#""DELETE_AND_REPLACE""#),
    ("heartbeat_interval_seconds", "30"),
    ("heartbeat_expiry_seconds", "120"),
    ("autoscaling.scale_down_stabilization_seconds", "300"),
    ("rollout.max_surge", r#""25%""#),
    ("rollout.max_unavailable", "0"),
    ("rollout.claim_preference", r#""CURRENT""#),
    ("rollout.window_seconds", "120"),
    ("rollout.progress_deadline_seconds", "600"),
    ("rollout.failure_threshold", "3"),
    ("rollout.auto_rollback", "true"),
];

/// A spec as the server keeps it, for comparing and showing: what is at its default is left
/// out — the listed defaults, and elsewhere `null`, `false`, `""`, `[]` and `{}`, which is
/// what the server (and its template) stores for a field left out.
pub fn normalized(spec: &Value) -> Value {
    fn walk(v: &Value, path: &str) -> Option<Value> {
        if let Some((_, d)) = DEFAULTS.iter().find(|(p, _)| *p == path) {
            let d: Value = serde_json::from_str(d).expect("defaults are JSON");
            return (*v != d && !v.is_null()).then(|| v.clone());
        }
        match v {
            Value::Null | Value::Bool(false) => None,
            Value::String(s) if s.is_empty() => None,
            Value::Array(a) if a.is_empty() => None,
            Value::Array(a) => Some(Value::Array(
                a.iter().enumerate().map(|(i, x)| walk(x, &format!("{path}[{i}]")).unwrap_or(Value::Null)).collect(),
            )),
            Value::Object(m) => {
                let kept: serde_json::Map<String, Value> = m
                    .iter()
                    .filter_map(|(k, x)| {
                        let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                        walk(x, &p).map(|x| (k.clone(), x))
                    })
                    .collect();
                (!kept.is_empty()).then_some(Value::Object(kept))
            }
            other => Some(other.clone()),
        }
    }
    walk(spec, "").unwrap_or_else(|| json!({}))
}

/// `normalized(spec)` as YAML lines, keys sorted.
fn yaml_text(spec: &Value) -> String {
    yaml_serde::to_string(&normalized(spec)).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
}

/// A unified diff of `old` and `new` (lines), three lines of context; `None` when equal.
pub fn unified(old: &str, new: &str, old_name: &str, new_name: &str) -> Option<String> {
    let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    // The longest common subsequence, from the end, then walked from the start.
    let (n, m) = (a.len(), b.len());
    let mut lcs = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    // (tag, line, old index, new index): ' ' kept, '-' removed, '+' added.
    let mut ops: Vec<(char, &str, usize, usize)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            ops.push((' ', a[i], i, j));
            (i, j) = (i + 1, j + 1);
        } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
            // Removals before additions, as diff -u prints them.
            ops.push(('-', a[i], i, j));
            i += 1;
        } else {
            ops.push(('+', b[j], i, j));
            j += 1;
        }
    }
    if ops.iter().all(|o| o.0 == ' ') {
        return None;
    }
    const CONTEXT: usize = 3;
    let mut out = format!("--- {old_name}\n+++ {new_name}\n");
    let changed: Vec<usize> = ops.iter().enumerate().filter(|(_, o)| o.0 != ' ').map(|(k, _)| k).collect();
    let mut k = 0;
    while k < changed.len() {
        let start = changed[k].saturating_sub(CONTEXT);
        let mut end = changed[k];
        while k < changed.len() && changed[k] <= end + 2 * CONTEXT {
            end = changed[k];
            k += 1;
        }
        let end = (end + CONTEXT).min(ops.len() - 1);
        let hunk = &ops[start..=end];
        let (old_len, new_len) =
            (hunk.iter().filter(|o| o.0 != '+').count(), hunk.iter().filter(|o| o.0 != '-').count());
        let (old_start, new_start) = (hunk[0].2 + usize::from(old_len > 0), hunk[0].3 + usize::from(new_len > 0));
        out.push_str(&format!("@@ -{old_start},{old_len} +{new_start},{new_len} @@\n"));
        for (tag, line, _, _) in hunk {
            out.push_str(&format!("{tag}{}\n", printable(line)));
        }
    }
    Some(out)
}

/// What apply did (or would do) to one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Created,
    Configured,
    Unchanged,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Action::Created => "created",
            Action::Configured => "configured",
            Action::Unchanged => "unchanged",
        }
    }
}

/// The pool as it is (its spec and ETag), or `None` if there is none.
async fn read(ctx: &Ctx, p: &PoolRef) -> Result<Option<(Value, Option<String>)>, CliError> {
    match ctx.send(Call::get_pool(p)).await {
        Ok(r) => {
            let v: Value = r.json()?;
            Ok(Some((v["spec"].clone(), r.etag().map(str::to_owned))))
        }
        Err(e) if e.status == "not_found" => Ok(None),
        Err(e) => Err(e),
    }
}

fn desired(d: &Doc) -> Value {
    serde_json::to_value(&d.spec).unwrap_or(Value::Null)
}

/// `pool diff`: each document's pool as it is against the file. `Ok(true)` when any differs.
pub async fn diff(ctx: &Ctx, path: &Path) -> Result<bool, CliError> {
    let docs = load(path)?;
    let mut text = String::new();
    for d in &docs {
        let p = d.spec.pool_ref();
        let current = read(ctx, &p).await?;
        let old = current.as_ref().map_or_else(String::new, |(spec, _)| yaml_text(spec));
        let old_name = if current.is_some() { format!("pool {p} (current)") } else { "/dev/null".to_owned() };
        if let Some(u) = unified(&old, &yaml_text(&desired(d)), &old_name, &d.source) {
            text.push_str(&u);
        }
    }
    emit(&text)?;
    Ok(!text.is_empty())
}

/// `pool apply`: creates, updates (with `If-Match`) or leaves each document's pool; with
/// `dry_run` only says what it would do, and shows the diff. Every document is tried; the
/// first failure is the answer.
pub async fn apply(ctx: &Ctx, path: &Path, dry_run: bool) -> Result<(), CliError> {
    let docs = load(path)?;
    let suffix = if dry_run { " (dry run)" } else { "" };
    let mut done = Vec::new();
    let mut failed: Option<CliError> = None;
    let mut failures = 0;
    for d in &docs {
        let p = d.spec.pool_ref();
        match apply_one(ctx, d, dry_run).await {
            Ok((action, diff)) => {
                if ctx.format == Format::Table {
                    if dry_run && let Some(diff) = diff {
                        emit(&diff)?;
                    }
                    emit(&format!("pool {p} {}{suffix}\n", action.as_str()))?;
                }
                done.push(json!({"pool": p.to_string(), "action": action.as_str(), "source": d.source}));
            }
            Err(e) => {
                eprintln!("pool {p} ({}): {e}", printable(&d.source));
                failures += 1;
                failed.get_or_insert(e);
            }
        }
    }
    if ctx.format != Format::Table {
        let doc = json!({"applied": done, "dry_run": dry_run});
        let names = || done.iter().map(|a| a["pool"].as_str().unwrap_or_default().to_owned()).collect();
        emit_document(&ctx.format, doc.to_string().as_bytes(), names)?;
    }
    match failed {
        None => Ok(()),
        Some(mut e) => {
            e.message = format!("{failures} of {} pools not applied (above); the first: {}", docs.len(), e.message);
            Err(e)
        }
    }
}

/// One document: what was done, and (for a change) the diff.
async fn apply_one(ctx: &Ctx, d: &Doc, dry_run: bool) -> Result<(Action, Option<String>), CliError> {
    let p = d.spec.pool_ref();
    let new = yaml_text(&desired(d));
    let Some((spec, etag)) = read(ctx, &p).await? else {
        let diff = unified("", &new, "/dev/null", &d.source);
        if !dry_run {
            ctx.send(Call::create_pool(&d.spec)).await.map_err(|e| {
                if e.status == "already_exists" {
                    CliError::new(
                        "already_exists",
                        format!(
                            "pool {p} was created by someone else while apply ran; re-run apply to compare with it"
                        ),
                    )
                } else {
                    e
                }
            })?;
        }
        return Ok((Action::Created, diff));
    };
    let Some(diff) = unified(&yaml_text(&spec), &new, &format!("pool {p} (current)"), &d.source) else {
        return Ok((Action::Unchanged, None));
    };
    if !dry_run {
        let etag = etag.ok_or_else(|| {
            CliError::new(
                "failed_precondition",
                format!("the server sent no ETag for pool {p}, so apply cannot update it safely; use `pool update -f`"),
            )
        })?;
        match ctx.client.send(Call::update_pool(&d.spec).if_match(&etag)).await {
            Ok(_) => {}
            // 412: the pool's ETag is no longer the one read (FAILED_PRECONDITION, ETAG_MISMATCH).
            Err(poolmgr_client::Error::Api(a)) if a.code == 412 => {
                return Err(CliError::new(
                    "failed_precondition",
                    format!(
                        "pool {p} was changed by someone else after apply read it (ETag {etag}); nothing was \
                         written to it: re-run `poolmgrctl pool diff -f …` or `pool apply -f …` to compare with what \
                         it is now"
                    ),
                ));
            }
            Err(e) => return Err(ctx.explain(e)),
        }
    }
    Ok((Action::Configured, Some(diff)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalized_leaves_out_the_servers_defaults_and_nothing_else() {
        let server = json!({"namespace": "default", "name": "ci", "size": 0, "flintlock_hosts": ["a"],
            "replenishment": {"strategy": "REPLACE_ON_DELETE"}, "create_commands": [], "pre_lease_commands": [],
            "hook_failure_policy": "DELETE_AND_REPLACE", "heartbeat_interval_seconds": 30, "heartbeat_expiry_seconds": 120,
            "microvm_template": {"kernel": {"image": "k", "add_network_config": false}, "interfaces": [{"device_id": "eth1"}]},
            "rollout": {"max_surge": "25%", "max_unavailable": 0, "claim_preference": "CURRENT", "window_seconds": 120,
                        "progress_deadline_seconds": 600, "failure_threshold": 3, "auto_rollback": false}});
        let file = json!({"name": "ci", "size": 0, "flintlock_hosts": ["a"], "replenishment": {"strategy": "REPLACE_ON_DELETE"},
            "microvm_template": {"kernel": {"image": "k"}, "interfaces": [{"device_id": "eth1"}]},
            "rollout": {"auto_rollback": false}});
        assert_eq!(normalized(&server), normalized(&file));
        // A value at a non-zero default's zero is a change, and a size of 0 is kept.
        assert_eq!(normalized(&server)["rollout"], json!({"auto_rollback": false}));
        assert_eq!(normalized(&server)["size"], json!(0));
        let mut other = file.clone();
        other["heartbeat_expiry_seconds"] = json!(300);
        assert_ne!(normalized(&server), normalized(&other));
    }

    #[test]
    fn unified_diffs_show_what_changes_with_context() {
        assert_eq!(unified("a\nb\n", "a\nb\n", "x", "y"), None);
        let old = "a\nb\nc\nd\ne\nf\ng\nh\n";
        let new = "a\nb\nc\nD\ne\nf\ng\nh\n";
        assert_eq!(
            unified(old, new, "x", "y").unwrap(),
            "--- x\n+++ y\n@@ -1,7 +1,7 @@\n a\n b\n c\n-d\n+D\n e\n f\n g\n"
        );
        assert_eq!(unified("", "a\n", "/dev/null", "f").unwrap(), "--- /dev/null\n+++ f\n@@ -0,0 +1,1 @@\n+a\n");
        // Changes far apart: two hunks.
        let old: String = (0..20).map(|i| format!("{i}\n")).collect();
        let new = old.replace("2\n", "two\n").replace("17\n", "seventeen\n");
        let u = unified(&old, &new, "x", "y").unwrap();
        assert_eq!(u.matches("@@ ").count(), 2, "{u}");
        assert!(u.contains("-17\n+seventeen\n") && u.contains("-2\n+two\n"), "{u}");
    }

    #[test]
    fn files_hold_several_documents() {
        let one =
            "name: a\nsize: 1\nreplenishment: {strategy: REPLACE_ON_DELETE}\nmicrovm_template: {interfaces: []}\n";
        let two = format!("{one}---\n{}", one.replace("name: a", "name: b"));
        let docs = parse("p.yaml", Some("yaml"), &two).unwrap();
        assert_eq!(docs.iter().map(|d| d.spec.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(docs[1].source, "p.yaml (document 2)");
        let v: Value = yaml_serde::from_str(one).unwrap();
        let arr = json!([v, {"name": "c", "size": 1, "replenishment": {"strategy": "REPLACE_ON_DELETE"}, "microvm_template": {}}]);
        let docs = parse("p.json", Some("json"), &arr.to_string()).unwrap();
        assert_eq!(docs.len(), 2);
        // A bad document names itself, and nothing is loaded.
        let bad = format!("{one}---\n{}", one.replace("size: 1", "size: lots"));
        let e = parse("p.yaml", Some("yaml"), &bad).err().unwrap();
        assert!(e.message.starts_with("p.yaml (document 2): size"), "{e}");
    }
}
