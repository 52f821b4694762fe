//! Script-friendly output: `--jq EXPR` and `-o jsonpath=TEMPLATE`, both over the JSON that
//! `-o json` prints.
//!
//! - `--jq`: a jq program run by jaq (`jaq-core`, `jaq-std`, `jaq-json`), a maintained jq
//!   implementation in Rust. Each result on its own line, like `jq -r`: a string as its text,
//!   anything else as indented JSON.
//! - `-o jsonpath=`: kubectl's template syntax — text, and `{EXPR}` where EXPR is a JSONPath
//!   (RFC 9535, evaluated by `serde_json_path`) written as kubectl writes it (`.a.b`, `.a[*].b`,
//!   `..b`, `.a[?(@.b=="x")]`; a leading `$` is allowed) or a quoted string (`{"\n"}`). An
//!   expression's matches are joined by a space; a string is its text, anything else compact
//!   JSON. A template without braces that starts with `.`, `$` or `[` is one expression.
//!   kubectl's `{range}`/`{end}` are not supported (use `--jq`).
//!
//! Both are checked before anything is sent (a bad expression is a usage error, exit 2).
//! Must never write what a value holds to a terminal as raw control characters: strings go
//! through [`crate::output::printable`] when standard output is a terminal (into a pipe they
//! are exact), JSON through the inert formatter.

use jaq_core::load::{Arena, File, Loader};
use jaq_core::{Compiler, Vars, data, unwrap_valr};
use jaq_json::Val;
use serde_json::Value;
use serde_json_path::JsonPath;

/// One value a filter produced: a string's text, or any other value as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Json(Vec<u8>),
}

/// Offset of `part` (a slice of `code`) in `code`, for error messages.
fn offset(code: &str, part: &str) -> usize {
    (part.as_ptr() as usize).saturating_sub(code.as_ptr() as usize).min(code.len())
}

fn near(code: &str, at: usize) -> String {
    let rest: String = code[at..].chars().take(20).collect();
    if rest.is_empty() { "at the end".to_owned() } else { format!("at {at} (near `{rest}`)") }
}

/// Runs jq program `code` on the JSON document `input`; `Err` says what is wrong with the
/// program (it does not parse or compile, or failed on this input).
pub fn jq(code: &str, input: &[u8]) -> Result<Vec<Piece>, String> {
    let defs = jaq_core::defs().chain(jaq_std::defs()).chain(jaq_json::defs());
    let funs = jaq_core::funs().chain(jaq_std::funs()).chain(jaq_json::funs());
    let loader = Loader::new(defs);
    let arena = Arena::default();
    let modules = loader.load(&arena, File { code, path: () }).map_err(|errs| {
        let mut msgs = Vec::new();
        for (_, e) in errs {
            match e {
                jaq_core::load::Error::Io(v) => msgs.extend(v.into_iter().map(|(_, m)| m)),
                jaq_core::load::Error::Lex(v) => msgs.extend(
                    v.into_iter()
                        .map(|(expect, at)| format!("expected {} {}", expect.as_str(), near(code, offset(code, at)))),
                ),
                jaq_core::load::Error::Parse(v) => msgs.extend(
                    v.into_iter()
                        .map(|(expect, at)| format!("expected {} {}", expect.as_str(), near(code, offset(code, at)))),
                ),
            }
        }
        msgs.join("; ")
    })?;
    let filter = Compiler::default().with_funs(funs).compile(modules).map_err(|errs| {
        let msgs: Vec<String> = errs
            .into_iter()
            .flat_map(|(_, v)| v)
            .map(|(name, undefined)| format!("undefined {} `{name}`", undefined.as_str()))
            .collect();
        msgs.join("; ")
    })?;
    let input = jaq_json::read::parse_single(input).map_err(|e| format!("cannot read the answer as JSON: {e}"))?;
    let ctx = jaq_core::Ctx::<data::JustLut<Val>>::new(&filter.lut, Vars::new([]));
    let mut out = Vec::new();
    for r in filter.id.run((ctx, input)).map(unwrap_valr) {
        let v = r.map_err(|e| e.to_string())?;
        out.push(match &v {
            Val::TStr(b) => Piece::Text(String::from_utf8_lossy(b).into_owned()),
            other => Piece::Json(other.to_string().into_bytes()),
        });
    }
    Ok(out)
}

/// Checks a jq program without running it on anything that matters.
pub fn check_jq(code: &str) -> Result<(), String> {
    jq(code, b"null").map(|_| ()).or_else(|e| {
        // A program that compiles may still fail on `null` (`.[0] | keys`): only parse and
        // compile errors count here, and those are the ones `jq` reports on `null` too.
        if e.starts_with("expected ") || e.starts_with("undefined ") { Err(e) } else { Ok(()) }
    })
}

/// One part of a kubectl-style JSONPath template.
#[derive(Debug)]
enum Part {
    Text(String),
    Path(JsonPath),
}

/// A parsed `-o jsonpath=` template.
#[derive(Debug)]
pub struct Template(Vec<Part>);

impl Template {
    pub fn parse(t: &str) -> Result<Template, String> {
        if t.trim().is_empty() {
            return Err("an empty template; e.g. -o jsonpath='{.lease.lease_id}'".into());
        }
        let trimmed = t.trim();
        if !t.contains('{') && (trimmed.starts_with('.') || trimmed.starts_with('$') || trimmed.starts_with('[')) {
            return Ok(Template(vec![Part::Path(path(trimmed)?)]));
        }
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut rest = t;
        while let Some(open) = rest.find('{') {
            text.push_str(&rest[..open]);
            let body = &rest[open + 1..];
            let close =
                closing_brace(body).ok_or_else(|| format!("`{{` at {} has no closing `}}`", offset(t, body) - 1))?;
            let expr = body[..close].trim();
            if !text.is_empty() {
                parts.push(Part::Text(std::mem::take(&mut text)));
            }
            if let Some(lit) = quoted(expr) {
                parts.push(Part::Text(lit?));
            } else if expr == "end" || expr.starts_with("range ") || expr == "range" {
                return Err("{range}…{end} is not supported; use --jq (e.g. --jq '.pools[] | .spec.name')".into());
            } else {
                parts.push(Part::Path(path(expr)?));
            }
            rest = &body[close + 1..];
        }
        text.push_str(rest);
        if text.contains('}') {
            return Err("a `}` without its `{`".into());
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        Ok(Template(parts))
    }

    /// The template applied to `doc`: text as it is, each expression's matches joined by a
    /// space.
    pub fn render(&self, doc: &Value) -> Vec<Piece> {
        let mut out = Vec::new();
        for part in &self.0 {
            match part {
                Part::Text(s) => out.push(Piece::Text(s.clone())),
                Part::Path(p) => {
                    for (i, v) in p.query(doc).all().into_iter().enumerate() {
                        if i > 0 {
                            out.push(Piece::Text(" ".into()));
                        }
                        out.push(match v {
                            Value::String(s) => Piece::Text(s.clone()),
                            other => Piece::Json(other.to_string().into_bytes()),
                        });
                    }
                }
            }
        }
        out
    }
}

/// The index of the `}` that closes an expression, skipping quoted strings (a filter may
/// compare with `"}"`).
fn closing_brace(s: &str) -> Option<usize> {
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                }
            }
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == '}' => return Some(i),
            None => {}
        }
    }
    None
}

/// A whole-expression string literal (`{"\n"}`, `{'-'}`), with `\n`, `\t`, `\r`, `\\` and
/// the quote escaped; `None` if the expression is not one.
fn quoted(expr: &str) -> Option<Result<String, String>> {
    let q = expr.chars().next().filter(|c| *c == '"' || *c == '\'')?;
    if expr.len() < 2 || !expr.ends_with(q) {
        return Some(Err(format!("unterminated string {expr}")));
    }
    let mut out = String::new();
    let mut chars = expr[1..expr.len() - 1].chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some(c @ ('\\' | '"' | '\'')) => out.push(c),
            other => {
                return Some(Err(format!(
                    "unknown escape \\{} in {expr}",
                    other.map(String::from).unwrap_or_default()
                )));
            }
        }
    }
    Some(Ok(out))
}

/// kubectl's JSONPath (`.a.b`, `..b`, `[0]`) as RFC 9535 (`$.a.b`, `$..b`, `$[0]`).
fn path(expr: &str) -> Result<JsonPath, String> {
    let rfc = if expr.starts_with('$') { expr.to_owned() } else { format!("${expr}") };
    JsonPath::parse(&rfc).map_err(|e| format!("invalid JSONPath {expr:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn texts(p: Vec<Piece>) -> String {
        p.into_iter()
            .map(|p| match p {
                Piece::Text(s) => s,
                Piece::Json(b) => String::from_utf8(b).unwrap(),
            })
            .collect()
    }

    #[test]
    fn jq_runs_jq_programs() {
        let doc = br#"{"pools":[{"spec":{"namespace":"default","name":"ci","size":3}},{"spec":{"namespace":"t","name":"x","size":1}}]}"#;
        let out = jq(r#".pools[] | "\(.spec.namespace)/\(.spec.name)""#, doc).unwrap();
        assert_eq!(out, [Piece::Text("default/ci".into()), Piece::Text("t/x".into())]);
        let out = jq("[.pools[].spec.size] | add", doc).unwrap();
        assert_eq!(out, [Piece::Json(b"4".to_vec())]);
        let out = jq(".pools | map(select(.spec.size > 2)) | length", doc).unwrap();
        assert_eq!(out, [Piece::Json(b"1".to_vec())]);
        assert_eq!(jq(".missing", doc).unwrap(), [Piece::Json(b"null".to_vec())]);
    }

    #[test]
    fn jq_errors_say_what_is_wrong() {
        let e = jq(".pools[", b"{}").unwrap_err();
        assert!(e.starts_with("expected "), "{e}");
        let e = jq("frobnicate", b"{}").unwrap_err();
        assert!(e.contains("undefined") && e.contains("frobnicate"), "{e}");
        let e = jq(".a.b", br#"{"a":"text"}"#).unwrap_err();
        assert!(e.contains("index"), "{e}");
        assert!(check_jq(".pools[").is_err());
        assert!(check_jq("nosuchfilter(1)").is_err());
        // Fails on null only at run time: fine to check.
        check_jq(".[0] | keys").unwrap();
    }

    #[test]
    fn jsonpath_templates_are_kubectls() {
        let doc = json!({"lease": {"lease_id": "l-1", "pool": {"namespace": "default", "name": "ci"}},
                         "vms": [{"id": "a", "phase": "AVAILABLE"}, {"id": "b", "phase": "LEASED"}]});
        let t = |s: &str| texts(Template::parse(s).unwrap().render(&doc));
        assert_eq!(t("{.lease.lease_id}"), "l-1");
        assert_eq!(t("$.lease.lease_id"), "l-1");
        assert_eq!(t(".lease.lease_id"), "l-1");
        assert_eq!(t("{.vms[*].id}"), "a b");
        assert_eq!(t(r#"{.vms[?(@.phase=="LEASED")].id}"#), "b");
        assert_eq!(t(r#"{.vms[?(@.phase=="}")].id}"#), "");
        assert_eq!(t(r#"{.lease.pool.namespace}/{.lease.pool.name}{"\n"}"#), "default/ci\n");
        assert_eq!(t("id={.vms[0].id}"), "id=a");
        // Objects as compact JSON, keys sorted (as kubectl prints maps).
        assert_eq!(t("{.lease.pool}"), r#"{"name":"ci","namespace":"default"}"#);
        assert_eq!(t("{..id}"), "a b");
    }

    #[test]
    fn jsonpath_errors_are_caught_at_parse() {
        for bad in ["", "{.a", "{.a[}", "{range .vms[*]}{.id}{end}", "{.a}}", r#"{"\q"}"#, "{.a-b}"] {
            assert!(Template::parse(bad).is_err(), "{bad:?}");
        }
    }
}
