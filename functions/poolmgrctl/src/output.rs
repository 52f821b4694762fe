//! Printing: aligned tables, the API's JSON re-indented (key order kept) or as YAML, and
//! the manual pages.
//!
//! Must never print a value as raw terminal input: a `request_id` or a cordon reason is any
//! text a client or admin chose, and an escape sequence in it would clear the screen, retitle
//! the window or rewrite what the table shows. Every value in human-readable output (table
//! cells, the feed's lines, messages, errors) goes through [`printable`].

use std::borrow::Cow;
use std::io::Write;

use serde_json::Value;
use serde_json::ser::{CompactFormatter, Formatter, PrettyFormatter};

use crate::cli::Format;
use crate::error::CliError;

/// Writes to standard output. A closed pipe (`| head`) ends the program quietly.
pub fn emit(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(CliError::new("internal", format!("cannot write to standard output: {e}"))),
    }
}

/// JSON text re-indented, keys in the order the server sent them.
pub fn pretty_json(raw: &[u8]) -> Result<String, CliError> {
    let mut out = Vec::with_capacity(raw.len() * 2);
    let mut de = serde_json::Deserializer::from_slice(raw);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Inert(PrettyFormatter::new()));
    serde_transcode::transcode(&mut de, &mut ser).map_err(|e| bad_json(&e))?;
    let mut s = String::from_utf8(out).map_err(|e| bad_json(&e))?;
    s.push('\n');
    Ok(s)
}

/// JSON text on one line, keys in the order the server sent them.
pub fn compact_json(raw: &[u8]) -> Result<String, CliError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut de = serde_json::Deserializer::from_slice(raw);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Inert(CompactFormatter));
    serde_transcode::transcode(&mut de, &mut ser).map_err(|e| bad_json(&e))?;
    let mut s = String::from_utf8(out).map_err(|e| bad_json(&e))?;
    s.push('\n');
    Ok(s)
}

/// A JSON formatter that also writes DEL, the C1 controls and the bidirectional formatting
/// characters as `\uXXXX` escapes (serde_json escapes only C0), so `-o json` on a terminal is
/// as inert as a table. The same JSON value: a parser reads the characters back.
struct Inert<F>(F);

impl<F: Formatter> Formatter for Inert<F> {
    fn write_string_fragment<W: ?Sized + Write>(&mut self, w: &mut W, fragment: &str) -> std::io::Result<()> {
        let mut rest = fragment;
        while let Some((i, c)) = rest.char_indices().find(|&(_, c)| needs_escape(c)) {
            w.write_all(&rest.as_bytes()[..i])?;
            // Every such character is in the Basic Multilingual Plane: one escape.
            write!(w, "\\u{:04x}", c as u32)?;
            rest = &rest[i + c.len_utf8()..];
        }
        w.write_all(rest.as_bytes())
    }

    // The layout is the wrapped formatter's (PrettyFormatter overrides these).
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

/// JSON text as a YAML document, keys in the order the server sent them. The emitter
/// double-quotes and escapes C0, DEL and C1; bidirectional formatting characters are
/// printable to YAML and stay as they are.
pub fn yaml(raw: &[u8]) -> Result<String, CliError> {
    let mut out = Vec::with_capacity(raw.len() * 2);
    let mut de = serde_json::Deserializer::from_slice(raw);
    let mut ser = yaml_serde::Serializer::new(&mut out);
    serde_transcode::transcode(&mut de, &mut ser).map_err(|e| bad_json(&e))?;
    String::from_utf8(out).map_err(|e| bad_json(&e))
}

fn bad_json(e: &dyn std::fmt::Display) -> CliError {
    CliError::new("unknown", format!("cannot re-encode the server's answer: {e}"))
}

/// The output format of `-o` and `--jq` together: `--jq` filters the JSON, so it goes with
/// `-o json` or no `-o` at all. A jq program is checked here, before anything is sent.
pub fn resolve_format(g: &crate::cli::Global) -> Result<Format, CliError> {
    match (&g.output, &g.jq) {
        (None, None) => Ok(Format::Table),
        (Some(f), None) => Ok(f.clone()),
        (None | Some(Format::Json), Some(code)) => {
            crate::filter::check_jq(code).map_err(|e| CliError::usage(format!("--jq: {e}")))?;
            Ok(Format::Jq(code.clone()))
        }
        (Some(_), Some(_)) => Err(CliError::usage("--jq filters the JSON output: use it without -o, or with -o json")),
    }
}

/// Prints an API answer in any format but `table` (the caller's business): `names` are what
/// `-o name` prints, one per line (computed only then).
pub fn emit_document(format: &Format, raw: &[u8], names: impl FnOnce() -> Vec<String>) -> Result<(), CliError> {
    emit(&document(format, raw, names, false)?)
}

/// [`emit_document`] for one document of a stream (a watch's poll, an event): JSON on one
/// line, YAML as a `---` document.
pub fn stream_document(format: &Format, raw: &[u8], names: impl FnOnce() -> Vec<String>) -> Result<String, CliError> {
    document(format, raw, names, true)
}

fn document(
    format: &Format,
    raw: &[u8],
    names: impl FnOnce() -> Vec<String>,
    stream: bool,
) -> Result<String, CliError> {
    match format {
        Format::Json if stream => compact_json(raw),
        Format::Json => pretty_json(raw),
        Format::Yaml if stream => Ok(format!("---\n{}", yaml(raw)?)),
        Format::Yaml => yaml(raw),
        Format::Name => Ok(names().iter().map(|n| format!("{}\n", printable(n))).collect()),
        Format::Jq(code) => {
            let pieces = crate::filter::jq(code, raw).map_err(|e| match e {
                crate::filter::JqError::Program(e) => CliError::usage(format!("--jq: {e}")),
                // The request was made and may have changed something (a claimed lease, a
                // created pool): its answer is printed as `-o json` would, not lost.
                crate::filter::JqError::Run(e) => {
                    let answer = if stream { compact_json(raw) } else { pretty_json(raw) }
                        .unwrap_or_else(|_| format!("{}\n", printable(&String::from_utf8_lossy(raw))));
                    CliError::usage(format!(
                        "--jq: {e} (the request succeeded: its answer is on standard output as JSON instead)"
                    ))
                    .exit_with(crate::error::EXIT_FILTER_FAILED)
                    .with_output(answer)
                }
            })?;
            let mut out = String::new();
            for p in pieces {
                out.push_str(&piece(p, true)?);
                out.push('\n');
            }
            Ok(out)
        }
        Format::JsonPath(t) => {
            let t = crate::filter::Template::parse(t).map_err(|e| CliError::usage(format!("-o jsonpath: {e}")))?;
            let doc: Value = serde_json::from_slice(raw).map_err(|e| bad_json(&e))?;
            let mut out = String::new();
            for p in t.render(&doc) {
                out.push_str(&piece(p, false)?);
            }
            // Unlike kubectl, the output ends with a line break (`$(…)` drops it).
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            Ok(out)
        }
        Format::Table => unreachable!("tables are rendered by each command"),
    }
}

/// A filter's result as text: a string as it is into a pipe (a script gets the exact value)
/// and [`printable`] on a terminal; any other value as inert JSON, indented when `pretty`.
fn piece(p: crate::filter::Piece, pretty: bool) -> Result<String, CliError> {
    use std::io::IsTerminal;
    match p {
        crate::filter::Piece::Text(s) if std::io::stdout().is_terminal() => Ok(printable(&s).into_owned()),
        crate::filter::Piece::Text(s) => Ok(s),
        crate::filter::Piece::Json(b) => {
            let mut text = if pretty { pretty_json(&b)? } else { compact_json(&b)? };
            text.pop(); // the line break the JSON printers add
            Ok(text)
        }
    }
}

/// Aligned columns, two spaces apart, the last one unpadded.
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Table {
        Table { headers: headers.to_vec(), rows: Vec::new() }
    }

    /// A row; each cell is made [`printable`] (a control character would break the row).
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells.into_iter().map(|c| printable(&c).into_owned()).collect());
    }

    /// The rows, after the header line when `headers`.
    pub fn render(&self, headers: bool) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
            let cells: Vec<&str> = cells.collect();
            let last = cells.len().saturating_sub(1);
            let mut l = String::new();
            for (i, c) in cells.iter().enumerate() {
                l.push_str(c);
                if i != last {
                    l.extend(std::iter::repeat_n(' ', widths[i] - c.chars().count() + 2));
                }
            }
            out.push_str(l.trim_end());
            out.push('\n');
        };
        if headers {
            line(&mut out, &mut self.headers.iter().copied());
        }
        for r in &self.rows {
            line(&mut out, &mut r.iter().map(String::as_str));
        }
        out
    }
}

/// `poolmgrctl man`: the top page on standard output, or with `dir` one page per command
/// (`poolmgrctl.1`, `poolmgrctl-pool.1`, `poolmgrctl-pool-create.1`, …) written there.
pub fn man_pages(cmd: clap::Command, dir: Option<&std::path::Path>) -> Result<(), CliError> {
    let render = |c: &clap::Command| -> Result<Vec<u8>, CliError> {
        let mut out = Vec::new();
        clap_mangen::Man::new(c.clone())
            .render(&mut out)
            .map_err(|e| CliError::new("internal", format!("cannot render the manual page: {e}")))?;
        Ok(out)
    };
    let mut cmd = cmd;
    cmd.build();
    let Some(dir) = dir else {
        return emit(&String::from_utf8_lossy(&render(&cmd)?));
    };
    std::fs::create_dir_all(dir).map_err(|e| CliError::usage(format!("cannot create {}: {e}", dir.display())))?;
    // Each page is named after its command path, as `man poolmgrctl-lease-claim` expects.
    fn walk(c: &clap::Command, name: String, pages: &mut Vec<(String, clap::Command)>) {
        let page = c.clone().name(name.clone()).display_name(name.clone()).bin_name(name.replace('-', " "));
        pages.push((name.clone(), page));
        for sub in c.get_subcommands().filter(|s| s.get_name() != "help") {
            walk(sub, format!("{name}-{}", sub.get_name()), pages);
        }
    }
    let mut pages = Vec::new();
    walk(&cmd, cmd.get_name().to_owned(), &mut pages);
    for (name, page) in &pages {
        let path = dir.join(format!("{name}.1"));
        std::fs::write(&path, render(page)?)
            .map_err(|e| CliError::usage(format!("cannot write {}: {e}", path.display())))?;
    }
    eprintln!("wrote {} manual pages into {}", pages.len(), dir.display());
    Ok(())
}

/// A cell: strings as they are ([`printable`]), null and empty as `<none>`, anything else as
/// JSON.
pub fn cell(v: &Value) -> String {
    match v {
        Value::Null => "<none>".into(),
        Value::String(s) if s.is_empty() => "<none>".into(),
        Value::String(s) => printable(s).into_owned(),
        other => printable(&other.to_string()).into_owned(),
    }
}

/// `namespace/name` of a PoolRef object.
pub fn pool_cell(v: &Value) -> String {
    let part = |k: &str| printable(v[k].as_str().unwrap_or("?")).into_owned();
    format!("{}/{}", part("namespace"), part("name"))
}

/// `s` with what a terminal would act on instead of showing written out as escapes: the C0
/// controls (`\t`, `\n`, `\r`, else `\x1b` and the like), DEL (`\x7f`), the C1 controls
/// (`\u{9b}`: a terminal may read U+009B as the start of a sequence, as ESC `[`) and the
/// bidirectional embeddings, overrides, isolates and marks (`\u{202e}`), which reorder what
/// follows them on the line. A backslash stays as it is: this is for reading, not parsing.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c.is_ascii_control() => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if needs_escape(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// C0, DEL, C1, and the bidirectional formatting characters (U+061C, U+200E, U+200F,
/// U+202A–U+202E, U+2066–U+2069).
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_filter_failing_on_the_answer_keeps_the_answer_and_exits_10() {
        let raw = br#"{"lease":{"lease_id":"l-1"}}"#;
        let jq = Format::Jq(".lease.lease_id.first".into());
        let e = document(&jq, raw, Vec::new, false).unwrap_err();
        assert_eq!(e.exit_code(), crate::error::EXIT_FILTER_FAILED);
        assert!(e.message.starts_with("--jq: ") && e.message.contains("request succeeded"), "{e}");
        assert_eq!(e.output.as_deref(), Some(pretty_json(raw).unwrap().as_str()));
        // In a stream, the document on one line.
        let e = document(&jq, raw, Vec::new, true).unwrap_err();
        assert_eq!(e.output.as_deref(), Some("{\"lease\":{\"lease_id\":\"l-1\"}}\n"));
        // A result that is not JSON: the filter's, named as such.
        let e = document(&Format::Jq("nan".into()), raw, Vec::new, false).unwrap_err();
        assert!(e.message.contains("not JSON") && !e.message.contains("re-encode"), "{e}");
        assert_eq!(e.exit_code(), crate::error::EXIT_FILTER_FAILED);
    }

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["A", "LONGER", "C"]);
        t.row(vec!["xxxx".into(), "y".into(), "z".into()]);
        t.row(vec!["é".into(), "".into(), "<none>".into()]);
        assert_eq!(t.render(true), "A     LONGER  C\nxxxx  y       z\né             <none>\n");
        assert_eq!(t.render(false), "xxxx  y       z\né             <none>\n");
    }

    #[test]
    fn json_keeps_key_order() {
        let raw = br#"{"z":1,"a":{"y":null,"b":[1,2]}}"#;
        let p = pretty_json(raw).unwrap();
        assert!(p.find("\"z\"").unwrap() < p.find("\"a\"").unwrap(), "{p}");
        assert_eq!(serde_json::from_str::<Value>(&p).unwrap(), serde_json::from_slice::<Value>(raw).unwrap());
        assert_eq!(compact_json(raw).unwrap(), format!("{}\n", std::str::from_utf8(raw).unwrap()));
        let y = yaml(raw).unwrap();
        assert!(y.starts_with("z: 1\n"), "{y}");
        let back: Value = yaml_serde::from_str(&y).unwrap();
        assert_eq!(back, json!({"z": 1, "a": {"y": null, "b": [1, 2]}}));
    }

    #[test]
    fn json_escapes_what_a_terminal_would_act_on_and_keeps_the_value() {
        let v = json!({"k\u{202e}": ["x\u{1b}[2J\u{7f}\u{9b}\u{2066}é✓"]});
        let raw = serde_json::to_vec(&v).unwrap();
        for text in [pretty_json(&raw).unwrap(), compact_json(&raw).unwrap()] {
            assert!(!text.chars().any(|c| c != '\n' && needs_escape(c)), "{text:?}");
            assert!(text.contains(r"x\u001b[2J\u007f\u009b\u2066é✓") && text.contains(r"k\u202e"), "{text}");
            assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), v);
        }
        assert_eq!(compact_json(br#"{"a":[1,{"b":"c"}]}"#).unwrap(), "{\"a\":[1,{\"b\":\"c\"}]}\n");
        assert!(yaml(&raw).unwrap().contains(r"\e[2J\x7F\x9B"));
    }

    #[test]
    fn cells() {
        assert_eq!(cell(&json!(null)), "<none>");
        assert_eq!(cell(&json!("")), "<none>");
        assert_eq!(cell(&json!("x")), "x");
        assert_eq!(cell(&json!(3)), "3");
        assert_eq!(pool_cell(&json!({"namespace": "default", "name": "ci"})), "default/ci");
    }

    #[test]
    fn control_and_bidi_characters_are_written_out() {
        assert!(matches!(printable("job-1 é ✓ \\x1b"), Cow::Borrowed("job-1 é ✓ \\x1b")));
        assert_eq!(printable("\x1b[2J\x07\0"), "\\x1b[2J\\x07\\x00");
        assert_eq!(printable("a\tb\nc\rd\x7f"), "a\\tb\\nc\\rd\\x7f");
        assert_eq!(printable("\u{9b}31m\u{85}"), "\\u{9b}31m\\u{85}");
        assert_eq!(printable("\u{202e}gpj.exe\u{2066}\u{200f}\u{61c}"), "\\u{202e}gpj.exe\\u{2066}\\u{200f}\\u{61c}");
        // Escaping twice changes nothing: the escapes are printable.
        let once = printable("\x1b]0;title\x07\u{202e}").into_owned();
        assert_eq!(printable(&once), once);
        // In cells and rows alike, and the width counts what is shown.
        assert_eq!(cell(&json!("\x1b[2J")), "\\x1b[2J");
        assert_eq!(cell(&json!(["\u{7f}"])), "[\"\\x7f\"]");
        assert_eq!(pool_cell(&json!({"namespace": "a\x1b", "name": "b"})), "a\\x1b/b");
        let mut t = Table::new(&["A", "B"]);
        t.row(vec!["\x1b[2J".into(), "x".into()]);
        assert_eq!(t.render(true), "A        B\n\\x1b[2J  x\n");
    }
}
