//! `poolmgrctl pool apply|diff -f FILE|DIR`: pools from files, kubectl `apply`/`diff` style.
//!
//! Every file is read and checked (as `pool create` checks one) before anything is sent, so
//! a bad document changes nothing. A file holds one PoolSpec or several: YAML documents
//! separated by `---`, or a JSON array; a directory stands for its `*.yaml`, `*.yml` and
//! `*.json` files, sorted by name. A pool may be named once in all of them.
//!
//! Apply reads each pool with its ETag, compares its spec with the file's ([`normalized`]:
//! the server's defaults, at the paths where the server fills them in, written out on neither
//! side; a block present with defaults only is not the same as no block), and creates it,
//! leaves it, or PUTs the
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

/// What the server writes for a field left out (`functions/core/src/domain/`
/// and `template.rs`: every `serde(default)` it serializes back), by path. `[*]` stands for every
/// element of an array. A field at its default is left out on both sides of a comparison, so
/// a file that names it and one that does not compare equal — and only there: a block the
/// server keeps as absent or present (`rollout`, `autoscaling`, `initrd`, an interface's
/// `address`) is never dropped for holding nothing but defaults, because `rollout: {}` turns
/// rollouts on and no `rollout` leaves them off.
const DEFAULTS: &[(&str, &str)] = &[
    // PoolSpec (domain/): the client leaves these out; the server always writes them.
    ("namespace", r#""default""#),
    ("flintlock_hosts", "[]"),
    ("create_commands", "[]"),
    ("pre_lease_commands", "[]"),
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
    // The template (template.rs): written even when left out...
    ("microvm_template.interfaces", "[]"),
    ("microvm_template.interfaces[*].type", r#""TAP""#),
    ("microvm_template.kernel.image", r#""""#),
    ("microvm_template.kernel.add_network_config", "false"),
    ("microvm_template.initrd.image", r#""""#),
    ("microvm_template.root_volume.id", r#""""#),
    ("microvm_template.root_volume.is_read_only", "false"),
    ("microvm_template.root_volume.source", "{}"),
    ("microvm_template.additional_volumes[*].id", r#""""#),
    ("microvm_template.additional_volumes[*].is_read_only", "false"),
    ("microvm_template.additional_volumes[*].source", "{}"),
    // ... and left out when empty (`skip_serializing_if`), whether the file names them or not.
    ("microvm_template.additional_volumes", "[]"),
    ("microvm_template.metadata", "{}"),
    ("microvm_template.labels", "{}"),
    ("microvm_template.kernel.cmdline", "{}"),
    ("microvm_template.interfaces[*].address.nameservers", "[]"),
];

/// Maps whose keys are the user's (`quiet: ""` is a kernel flag, not an empty field): what
/// they hold is compared exactly, never trimmed.
const USER_MAPS: &[&str] = &["microvm_template.metadata", "microvm_template.labels", "microvm_template.kernel.cmdline"];

/// A spec as the server keeps it, for comparing and showing: a field at its server default
/// ([`DEFAULTS`], at that path only) is left out, and so is a member that is `null` (how a
/// field is left out: the server writes none). Nothing else is: empty strings, `false`, `[]`
/// and `{}` elsewhere are values, and an object emptied of its defaults stays (`rollout: {}`).
pub fn normalized(spec: &Value) -> Value {
    fn walk(v: &Value, path: &str) -> Value {
        match v {
            Value::Object(m) if USER_MAPS.contains(&path) => Value::Object(m.clone()),
            Value::Object(m) => Value::Object(
                m.iter()
                    .filter_map(|(k, x)| {
                        let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                        let x = walk(x, &p);
                        let default = DEFAULTS
                            .iter()
                            .find(|(d, _)| *d == p)
                            .map(|(_, d)| serde_json::from_str::<Value>(d).expect("defaults are JSON"));
                        (!x.is_null() && default.as_ref() != Some(&x)).then(|| (k.clone(), x))
                    })
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().map(|x| walk(x, &format!("{path}[*]"))).collect()),
            other => other.clone(),
        }
    }
    walk(spec, "")
}

/// `normalized(spec)` as YAML lines, keys sorted (whatever order the server or the file had
/// them in, and whether or not serde_json keeps insertion order in this build).
fn yaml_text(spec: &Value) -> String {
    fn sorted(v: Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut kv: Vec<(String, Value)> = m.into_iter().collect();
                kv.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(kv.into_iter().map(|(k, v)| (k, sorted(v))).collect())
            }
            Value::Array(a) => Value::Array(a.into_iter().map(sorted).collect()),
            other => other,
        }
    }
    yaml_serde::to_string(&sorted(normalized(spec))).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
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

/// The diff of the pool as it is (`None`: there is none) against the document, or `None` when
/// they are the same. Sameness is decided on the [`normalized`] values; the YAML text only
/// shows the difference.
fn difference(current: Option<&Value>, d: &Doc) -> Option<String> {
    let want = desired(d);
    let Some(spec) = current else {
        return unified("", &yaml_text(&want), "/dev/null", &d.source);
    };
    if normalized(spec) == normalized(&want) {
        return None;
    }
    let old_name = format!("pool {} (current)", d.spec.pool_ref());
    Some(unified(&yaml_text(spec), &yaml_text(&want), &old_name, &d.source).unwrap_or_else(|| {
        // Values that print alike (`1` and `1.0`): still a difference, and said so.
        format!("--- {old_name}\n+++ {}\n# differs in a way the YAML does not show\n", d.source)
    }))
}

/// `pool diff`: each document's pool as it is against the file. `Ok(true)` when any differs.
pub async fn diff(ctx: &Ctx, path: &Path) -> Result<bool, CliError> {
    let docs = load(path)?;
    let mut text = String::new();
    for d in &docs {
        let p = d.spec.pool_ref();
        let current = read(ctx, &p).await?;
        if let Some(u) = difference(current.as_ref().map(|(spec, _)| spec), d) {
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
    let Some((spec, etag)) = read(ctx, &p).await? else {
        let diff = difference(None, d);
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
    let Some(diff) = difference(Some(&spec), d) else {
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

    /// A pool as the real server answers it: every field it fills in written out (domain/,
    /// template.rs), including each interface's `type`.
    fn server_spec() -> Value {
        json!({"namespace": "default", "name": "ci", "size": 0, "flintlock_hosts": ["a"],
            "replenishment": {"strategy": "REPLACE_ON_DELETE"}, "create_commands": [], "pre_lease_commands": [],
            "hook_failure_policy": "DELETE_AND_REPLACE", "heartbeat_interval_seconds": 30, "heartbeat_expiry_seconds": 120,
            "microvm_template": {"kernel": {"image": "k", "add_network_config": false},
                "root_volume": {"id": "root", "is_read_only": false, "source": {"container_source": "img"}},
                "interfaces": [{"device_id": "eth1", "type": "TAP"}, {"device_id": "eth2", "type": "TAP"}]},
            "rollout": {"max_surge": "25%", "max_unavailable": 0, "claim_preference": "CURRENT", "window_seconds": 120,
                        "progress_deadline_seconds": 600, "failure_threshold": 3, "auto_rollback": false}})
    }

    /// The same pool as a person writes it: the server's defaults left out.
    fn file_spec() -> Value {
        json!({"name": "ci", "size": 0, "flintlock_hosts": ["a"], "replenishment": {"strategy": "REPLACE_ON_DELETE"},
            "microvm_template": {"kernel": {"image": "k"}, "root_volume": {"id": "root", "source": {"container_source": "img"}},
                "interfaces": [{"device_id": "eth1"}, {"device_id": "eth2", "type": "TAP"}]},
            "rollout": {"auto_rollback": false}})
    }

    #[test]
    fn normalized_leaves_out_the_servers_defaults_and_nothing_else() {
        let (server, file) = (server_spec(), file_spec());
        assert_eq!(normalized(&server), normalized(&file));
        // A value at a non-zero default's zero is a change, and a size of 0 is kept.
        assert_eq!(normalized(&server)["rollout"], json!({"auto_rollback": false}));
        assert_eq!(normalized(&server)["size"], json!(0));
        let mut other = file.clone();
        other["heartbeat_expiry_seconds"] = json!(300);
        assert_ne!(normalized(&server), normalized(&other));
        // An interface's type other than the default is a change, in any element.
        let mut other = file.clone();
        other["microvm_template"]["interfaces"][1]["type"] = json!("MACVTAP");
        assert_ne!(normalized(&server), normalized(&other));
        // `null` is a field left out.
        let mut other = file.clone();
        other["max_lease_seconds"] = Value::Null;
        other["microvm_template"]["vcpu"] = Value::Null;
        assert_eq!(normalized(&server), normalized(&other));
    }

    #[test]
    fn a_block_with_only_defaults_is_not_the_same_as_no_block() {
        // `rollout: {}` turns rollouts on with every default; no `rollout` leaves them off.
        let mut server = server_spec();
        server["rollout"]["auto_rollback"] = json!(true);
        let mut file = file_spec();
        file["rollout"] = json!({});
        assert_eq!(normalized(&server), normalized(&file));
        assert_eq!(normalized(&server)["rollout"], json!({}));
        file.as_object_mut().unwrap().remove("rollout");
        assert_ne!(normalized(&server), normalized(&file));
        server.as_object_mut().unwrap().remove("rollout");
        assert_eq!(normalized(&server), normalized(&file));
        // autoscaling with its default stabilization only: still autoscaling.
        let mut with = file.clone();
        with["autoscaling"] = json!({"min": 0, "max": 5, "buffer": 0});
        assert_ne!(normalized(&server), normalized(&with));
        server["autoscaling"] = json!({"min": 0, "max": 5, "buffer": 0, "scale_down_stabilization_seconds": 300});
        assert_eq!(normalized(&server), normalized(&with));
        // An initrd or a static address of defaults only is still there.
        let mut with = file.clone();
        with["microvm_template"]["initrd"] = json!({});
        assert_ne!(normalized(&file), normalized(&with));
    }

    #[test]
    fn empty_values_in_maps_of_the_users_keys_are_kept() {
        let file = file_spec();
        for (path, entry) in [("kernel", "cmdline"), ("", "metadata"), ("", "labels")] {
            let mut other = file.clone();
            let at =
                if path.is_empty() { &mut other["microvm_template"] } else { &mut other["microvm_template"][path] };
            at[entry] = json!({"quiet": ""});
            assert_ne!(normalized(&file), normalized(&other), "{entry}");
            assert_eq!(yaml_text(&other).matches("quiet: ''").count(), 1, "{entry}: {}", yaml_text(&other));
            // The server leaves an empty map out: `{}` and none are the same.
            let at =
                if path.is_empty() { &mut other["microvm_template"] } else { &mut other["microvm_template"][path] };
            at[entry] = json!({});
            assert_eq!(normalized(&file), normalized(&other), "{entry}");
        }
        // Elsewhere an empty string is a value too (a guest_mac of "" is written back as it is).
        let mut other = file.clone();
        other["microvm_template"]["interfaces"][0]["guest_mac"] = json!("");
        assert_ne!(normalized(&file), normalized(&other));
    }

    #[test]
    fn the_yaml_is_the_same_whatever_order_the_keys_came_in() {
        let a = json!({"b": 1, "a": {"y": 1, "x": 2}});
        let b = json!({"a": {"x": 2, "y": 1}, "b": 1});
        assert_eq!(yaml_text(&a), yaml_text(&b));
        assert_eq!(yaml_text(&a), "a:\n  x: 2\n  y: 1\nb: 1\n");
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
