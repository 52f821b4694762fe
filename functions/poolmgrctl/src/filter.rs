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
//! Both are checked before anything is sent (a bad expression is a usage error, exit 2); a jq
//! program is only parsed and compiled then, never run: a program that does not end must not
//! run before the request. Run on the answer, it stops after [`MAX_RESULTS`] results or
//! [`MAX_RESULT_BYTES`] (a full guard against non-termination it is not: deep recursion still
//! aborts), and a result that is not JSON is an error naming that result.
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

/// At most this many results from one program: `repeat(.)` or `range(infinite)` stops here
/// with an error instead of filling the memory. No jq command prints that much on purpose.
pub const MAX_RESULTS: usize = 100_000;
/// At most this many bytes of results from one program, for the same reason.
pub const MAX_RESULT_BYTES: usize = 64 << 20;

/// A compiled jq program.
type Program = jaq_core::Filter<data::JustLut<Val>>;

/// Why a jq program printed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JqError {
    /// The program does not parse or compile: nothing was run.
    Program(String),
    /// The program failed on the document (a jq error, too many results, a result that is not
    /// JSON).
    Run(String),
}

impl std::fmt::Display for JqError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JqError::Program(m) | JqError::Run(m) => f.write_str(m),
        }
    }
}

/// Parses and compiles jq program `code` (modules and data imports included: none can be
/// loaded), without running it. `Err` says what is wrong with it.
fn compile(code: &str) -> Result<Program, String> {
    let defs = jaq_core::defs().chain(jaq_std::defs()).chain(jaq_json::defs());
    let funs = jaq_core::funs().chain(jaq_std::funs()).chain(jaq_json::funs());
    // The loader's default reader refuses every `include`/`import` of a module ("module
    // loading not supported"): they are reported here, with the parse errors.
    let loader = Loader::new(defs);
    let arena = Arena::default();
    let load_errors = |errs: jaq_core::load::Errors<&str, ()>| {
        let mut msgs = Vec::new();
        for (_, e) in errs {
            match e {
                jaq_core::load::Error::Io(v) => {
                    msgs.extend(v.into_iter().map(|(path, m)| format!("cannot load {path:?}: {m}")))
                }
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
    };
    let modules = loader.load(&arena, File { code, path: () }).map_err(load_errors)?;
    // Data imports (`import "x" as $x;`) are not read by the loader: refused here, before they
    // become variables nothing binds.
    jaq_core::load::import(&modules, |_| Err("importing data files is not supported".into())).map_err(load_errors)?;
    Compiler::default().with_funs(funs).compile(modules).map_err(|errs| {
        let msgs: Vec<String> = errs
            .into_iter()
            .flat_map(|(_, v)| v)
            .map(|(name, undefined)| format!("undefined {} `{name}`", undefined.as_str()))
            .collect();
        msgs.join("; ")
    })
}

/// Runs jq program `code` on the JSON document `input`: every result, or why there is none.
/// At most [`MAX_RESULTS`] results and [`MAX_RESULT_BYTES`] bytes of them; each must be JSON
/// (jaq also makes NaN, infinities, byte strings and objects with other keys than strings).
pub fn jq(code: &str, input: &[u8]) -> Result<Vec<Piece>, JqError> {
    let filter = compile(code).map_err(JqError::Program)?;
    let input = jaq_json::read::parse_single(input)
        .map_err(|e| JqError::Run(format!("cannot read the answer as JSON: {e}")))?;
    let ctx = jaq_core::Ctx::<data::JustLut<Val>>::new(&filter.lut, Vars::new([]));
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for (i, r) in filter.id.run((ctx, input)).map(unwrap_valr).enumerate() {
        if i == MAX_RESULTS || bytes > MAX_RESULT_BYTES {
            return Err(JqError::Run(format!(
                "the filter gave more than {} results or {} MiB; stopped there (does it loop, like `repeat(.)`?)",
                MAX_RESULTS,
                MAX_RESULT_BYTES >> 20
            )));
        }
        let v = r.map_err(|e| JqError::Run(e.to_string()))?;
        let piece = match &v {
            Val::TStr(b) => Piece::Text(String::from_utf8_lossy(b).into_owned()),
            other => {
                // jaq writes a value as JSON exactly when it has a JSON form.
                let text = other.to_string();
                if serde_json::from_str::<serde::de::IgnoredAny>(&text).is_err() {
                    let shown: String = text.chars().take(60).collect();
                    let more = if shown.len() < text.len() { "…" } else { "" };
                    return Err(JqError::Run(format!(
                        "result {} of the filter is not JSON: {shown}{more} — NaN, infinite numbers, byte \
                         strings and object keys that are not strings cannot be printed as JSON",
                        i + 1
                    )));
                }
                Piece::Json(text.into_bytes())
            }
        };
        bytes += match &piece {
            Piece::Text(t) => t.len(),
            Piece::Json(b) => b.len(),
        };
        out.push(piece);
    }
    Ok(out)
}

/// Checks a jq program before anything is sent: parses and compiles it, and never runs it
/// (a program that loops or recurses for ever must not run before the request is made).
pub fn check_jq(code: &str) -> Result<(), String> {
    compile(code).map(|_| ())
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
        let program = |r: Result<Vec<Piece>, JqError>| match r {
            Err(JqError::Program(m)) => m,
            other => panic!("expected a program error: {other:?}"),
        };
        let run = |r: Result<Vec<Piece>, JqError>| match r {
            Err(JqError::Run(m)) => m,
            other => panic!("expected a run error: {other:?}"),
        };
        let e = program(jq(".pools[", b"{}"));
        assert!(e.starts_with("expected "), "{e}");
        let e = program(jq("frobnicate", b"{}"));
        assert!(e.contains("undefined") && e.contains("frobnicate"), "{e}");
        let e = run(jq(".a.b", br#"{"a":"text"}"#));
        assert!(e.contains("index"), "{e}");
        assert!(check_jq(".pools[").is_err());
        assert!(check_jq("nosuchfilter(1)").is_err());
        // Fails on null only at run time: fine to check.
        check_jq(".[0] | keys").unwrap();
    }

    #[test]
    fn check_jq_compiles_and_never_runs_the_program() {
        // These loop or recurse for ever when run: checking them must only compile them.
        check_jq("repeat(.)").unwrap();
        check_jq("def f: 1 + f; f").unwrap();
        check_jq("error(\"boom\")").unwrap();
        // Modules and data files cannot be loaded: said before anything is sent.
        let e = check_jq(r#"include "mylib"; ."#).unwrap_err();
        assert!(e.contains("mylib"), "{e}");
        let e = check_jq(r#"import "mylib" as m; m::f"#).unwrap_err();
        assert!(e.contains("mylib"), "{e}");
        let e = check_jq(r#"import "data" as $d; $d"#).unwrap_err();
        assert!(e.contains("data") && e.contains("not supported"), "{e}");
    }

    #[test]
    fn a_filter_that_does_not_end_is_stopped_after_many_results() {
        let e = jq("repeat(.)", br#"{"a":1}"#).unwrap_err();
        assert!(matches!(&e, JqError::Run(m) if m.contains(&MAX_RESULTS.to_string())), "{e:?}");
        let e = jq(r#"repeat("x" * 1000000)"#, b"null").unwrap_err();
        assert!(matches!(&e, JqError::Run(m) if m.contains("MiB")), "{e:?}");
        // Many results, but fewer than the cap: all of them.
        assert_eq!(jq("range(1000)", b"null").unwrap().len(), 1000);
    }

    #[test]
    fn results_that_are_not_json_are_named_not_blamed_on_the_answer() {
        for (code, shown) in [
            ("nan", "NaN"),
            ("infinite", "Infinity"),
            ("[1, -infinite]", "-Infinity"),
            ("{(1): 2}", "{1:2}"),
            ("\"é\" | tobytes", "b\""),
        ] {
            let e = jq(code, b"null").unwrap_err();
            let JqError::Run(m) = &e else { panic!("{code}: {e:?}") };
            assert!(m.contains("result 1 of the filter is not JSON") && m.contains(shown), "{code}: {m}");
            assert!(!m.contains("server"), "{code}: {m}");
        }
        // The second result is the bad one, and says so.
        let e = jq("1, nan", b"null").unwrap_err();
        assert!(e.to_string().contains("result 2"), "{e}");
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
