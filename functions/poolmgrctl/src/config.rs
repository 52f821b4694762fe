//! Where the endpoint and the token come from: flags, then environment, then the config
//! file's context, then defaults (as kubectl and gh do); and the config file itself,
//! `$XDG_CONFIG_HOME/poolmgr/config.yaml` (`~/.config/poolmgr/config.yaml` without it):
//!
//! ```yaml
//! current_context: dev
//! contexts:
//!   dev:  {endpoint: "http://127.0.0.1:8080", token_file: ~/.config/poolmgr/dev.token}
//!   prod: {endpoint: "https://poolmgr.example.com", token: "…"}
//! ```
//!
//! The file is read only when something is left to it (no `--endpoint`/`POOLMGR_ENDPOINT`,
//! or no token from flags or environment, or `--context`), so a broken file never blocks an
//! explicit invocation. It is written (by `context use` / `context set`) through a new
//! temporary file of mode 0600 in its directory, synced and renamed over it: it may hold
//! tokens, and must never be readable by others or half-written, even for a moment.
//!
//! Must never use a token other users may read: a token file (or a config file whose
//! `token` is used) that grants any permission to group or others is refused, with the
//! `chmod 600` that fixes it, as ssh refuses such a private key. The CLI writes no token
//! file of its own (`context set --token-file` stores the path).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cli::Global;
use crate::error::CliError;

pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:8080";

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_context: Option<String>,
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

/// A named endpoint and how to authenticate to it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Context {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// A file holding the token (surrounding whitespace ignored); `~/` is the home directory,
    /// a relative path is relative to the config file's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// A PEM file of CA certificates to trust for this endpoint (a private CA); `~/` and
    /// relative paths as for `token_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
}

/// A lookup of one environment variable.
type Lookup = Box<dyn Fn(&str) -> Option<String>>;

/// The variables of the environment this run reads, so tests can give their own.
pub struct Env {
    get: Lookup,
}

impl Env {
    pub fn process() -> Env {
        Env { get: Box::new(|k| std::env::var(k).ok()) }
    }

    /// A variable, empty counting as unset.
    pub fn var(&self, k: &str) -> Option<String> {
        (self.get)(k).filter(|v| !v.is_empty())
    }
}

/// The config file's path: `--config` / `POOLMGR_CONFIG`, else the XDG location.
pub fn config_path(g: &Global, env: &Env) -> Result<PathBuf, CliError> {
    if let Some(p) = &g.config {
        return Ok(p.clone());
    }
    if let Some(p) = env.var("POOLMGR_CONFIG") {
        return Ok(PathBuf::from(p));
    }
    if let Some(x) = env.var("XDG_CONFIG_HOME") {
        return Ok(Path::new(&x).join("poolmgr/config.yaml"));
    }
    match env.var("HOME") {
        Some(h) => Ok(Path::new(&h).join(".config/poolmgr/config.yaml")),
        None => Err(CliError::usage("neither XDG_CONFIG_HOME nor HOME is set: give the config file with --config")),
    }
}

/// Reads the config file; a missing file is an empty one.
pub fn load(path: &Path) -> Result<ConfigFile, CliError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ConfigFile::default()),
        Err(e) => return Err(CliError::usage(format!("cannot read the config file {}: {e}", path.display()))),
    };
    if text.trim().is_empty() {
        return Ok(ConfigFile::default());
    }
    let cfg: ConfigFile = yaml_serde::from_str(&text)
        .map_err(|e| CliError::usage(format!("config file {}: {e}; fix or remove it", path.display())))?;
    for (name, c) in &cfg.contexts {
        if c.token.is_some() && c.token_file.is_some() {
            return Err(CliError::usage(format!(
                "config file {}: context {name:?} sets both token and token_file; keep one",
                path.display()
            )));
        }
    }
    Ok(cfg)
}

/// Writes the config file atomically, mode 0600 ([`write_private`]); a missing directory is
/// created private (0700).
pub fn save(path: &Path, cfg: &ConfigFile) -> Result<(), CliError> {
    let fail = |what: &str, e: std::io::Error| CliError::usage(format!("cannot {what} {}: {e}", path.display()));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(dir).map_err(|e| fail("create the directory of", e))?;
    }
    let text = yaml_serde::to_string(cfg).map_err(|e| CliError::new("internal", e.to_string()))?;
    write_private(path, text.as_bytes()).map_err(|e| fail("write", e))
}

/// Replaces `path` with `bytes` so that nobody else can read them at any moment and no reader
/// ever sees half a file: a temporary file of a name not in use, in the same directory (a
/// rename does not cross file systems), created with mode 0600 (`create_new`: never an
/// existing file, whose mode would be kept, nor a symbolic link), synced to disk, renamed
/// over `path`; then the directory is synced so the rename outlives a crash. On failure the
/// temporary file is removed and `path` is as it was.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| std::io::Error::other("the path names no file"))?;
    let tmp = dir.join(format!(".{}.{}.tmp", name.to_string_lossy(), uuid::Uuid::new_v4().simple()));
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    let written = o.open(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The new content is in place; a directory that cannot be synced (some file systems
    // refuse) only loses the rename's durability, not the write.
    #[cfg(unix)]
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Refuses `path` (`label` names it in the error) when group or others have any permission
/// on it, as ssh refuses such a private key. A regular file only: a pipe such as
/// `--token-file <(pass show poolmgr)` is not a file anyone reads later.
fn check_private(meta: &std::fs::Metadata, path: &Path, label: &str) -> Result<(), CliError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_file() && mode & 0o077 != 0 {
            return Err(CliError::usage(format!(
                "{label} holds a token and is open to other users (mode {mode:04o}): run `chmod 600 {}`",
                shell_word(&path.to_string_lossy())
            )));
        }
    }
    #[cfg(not(unix))]
    let _ = (meta, path, label);
    Ok(())
}

/// `s` as one word of a POSIX shell command line, quoted when it needs to be.
fn shell_word(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+,:@%=~".contains(c);
    if !s.is_empty() && s.chars().all(plain) && !s.starts_with('~') {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `~/x` → `$HOME/x`; a relative path → relative to `base`.
fn resolve_path(p: &str, base: &Path, env: &Env) -> PathBuf {
    if let Some(rest) = p.strip_prefix("~/")
        && let Some(h) = env.var("HOME")
    {
        return Path::new(&h).join(rest);
    }
    let p = Path::new(p);
    if p.is_relative() { base.join(p) } else { p.to_path_buf() }
}

/// The token in `path`, trimmed; `what` says where the path came from. Refused when other
/// users may read the file ([`check_private`]).
pub fn read_token_file(path: &Path, what: &str) -> Result<String, CliError> {
    use std::io::Read;
    let cannot =
        |e: std::io::Error| CliError::usage(format!("cannot read the token file {} ({what}): {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(cannot)?;
    // The permissions of the file opened, not of whatever the path names a moment later.
    check_private(&f.metadata().map_err(cannot)?, path, &format!("the token file {} ({what})", path.display()))?;
    let mut t = String::new();
    f.read_to_string(&mut t).map_err(cannot)?;
    let t = t.trim();
    if t.is_empty() {
        return Err(CliError::usage(format!("the token file {} ({what}) is empty", path.display())));
    }
    Ok(t.to_owned())
}

/// What this run talks to.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub endpoint: String,
    pub token: Option<String>,
    /// The context used, if any.
    pub context: Option<String>,
    /// Extra CA certificates to trust (PEM file).
    pub ca_file: Option<PathBuf>,
}

/// Resolves endpoint, token and CA file: flags > environment (`POOLMGR_ENDPOINT`,
/// `POOLMGR_TOKEN`, `POOLMGR_TOKEN_FILE`, `POOLMGR_CA_FILE`) > the context (`--context`,
/// `POOLMGR_CONTEXT`, else the file's `current_context`) > the default endpoint, no token and
/// the system's trust store only.
pub fn resolve(g: &Global, env: &Env) -> Result<Target, CliError> {
    let mut endpoint = g.endpoint.clone().or_else(|| env.var("POOLMGR_ENDPOINT"));
    let mut token = match (&g.token, &g.token_file) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(f)) => Some(read_token_file(f, "--token-file")?),
        (None, None) => match (env.var("POOLMGR_TOKEN"), env.var("POOLMGR_TOKEN_FILE")) {
            (Some(t), _) => Some(t),
            (None, Some(f)) => Some(read_token_file(Path::new(&f), "POOLMGR_TOKEN_FILE")?),
            (None, None) => None,
        },
    };
    let mut ca_file = g.server_ca_file.clone().or_else(|| env.var("POOLMGR_CA_FILE").map(PathBuf::from));
    let wanted = g.context.clone().or_else(|| env.var("POOLMGR_CONTEXT"));
    let mut used = None;
    if endpoint.is_none() || token.is_none() || wanted.is_some() {
        let path = config_path(g, env)?;
        let cfg = load(&path)?;
        let name = wanted.clone().or(cfg.current_context.clone());
        if let Some(name) = name {
            let Some(ctx) = cfg.contexts.get(&name) else {
                let known: Vec<&str> = cfg.contexts.keys().map(String::as_str).collect();
                let how = if wanted.is_some() { "--context (or POOLMGR_CONTEXT)" } else { "current_context" };
                return Err(CliError::usage(format!(
                    "{how} names context {name:?}, which {} does not define{}",
                    path.display(),
                    if known.is_empty() { String::new() } else { format!(" (it has: {})", known.join(", ")) }
                )));
            };
            if endpoint.is_none() {
                endpoint = ctx.endpoint.clone();
            }
            if token.is_none() {
                token = match (&ctx.token, &ctx.token_file) {
                    (Some(t), _) => {
                        let meta = std::fs::metadata(&path).map_err(|e| {
                            CliError::usage(format!("cannot read the config file {}: {e}", path.display()))
                        })?;
                        let label = format!("the config file {} (context {name})", path.display());
                        check_private(&meta, &path, &label)?;
                        Some(t.clone())
                    }
                    (None, Some(f)) => {
                        let base = path.parent().unwrap_or(Path::new("."));
                        Some(read_token_file(&resolve_path(f, base, env), &format!("context {name}"))?)
                    }
                    (None, None) => None,
                };
            }
            if ca_file.is_none()
                && let Some(f) = &ctx.ca_file
            {
                ca_file = Some(resolve_path(f, path.parent().unwrap_or(Path::new(".")), env));
            }
            used = Some(name);
        }
    }
    Ok(Target {
        endpoint: endpoint.unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned()),
        token: token.filter(|t| !t.is_empty()),
        context: used,
        ca_file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn global(args: &[&str]) -> Global {
        let mut all = vec!["poolmgrctl"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["pool", "list"]);
        crate::cli::Cli::try_parse_from(all).unwrap().global
    }

    fn env(vars: &[(&str, &str)]) -> Env {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Env { get: Box::new(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())) }
    }

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir() -> Dir {
        let d = std::env::temp_dir().join(format!("poolmgrctl-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    /// Writes `text` to `p` with permissions `mode`.
    fn write_mode(p: &Path, text: &str, mode: u32) {
        // Replaced, not rewritten: the file before may be read-only.
        let _ = std::fs::remove_file(p);
        std::fs::write(p, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        #[cfg(not(unix))]
        let _ = mode;
    }

    /// A private config file (tokens in it are used) in `d`; returns `d` for XDG_CONFIG_HOME.
    fn write_config(d: &Path, text: &str) -> String {
        let p = d.join("poolmgr/config.yaml");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        write_mode(&p, text, 0o600);
        d.to_str().unwrap().to_owned()
    }

    #[cfg(unix)]
    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn flags_beat_environment_beats_context_beats_defaults() {
        let d = dir();
        write_mode(&d.0.join("poolmgr-dev.token"), "tok-from-file\n", 0o600);
        let xdg = write_config(
            &d.0,
            "current_context: dev\ncontexts:\n  dev: {endpoint: 'http://dev:1', token_file: ../poolmgr-dev.token}\n  prod: {endpoint: 'http://prod:1', token: tok-prod}\n",
        );
        let x = [("XDG_CONFIG_HOME", xdg.as_str())];
        // The current context alone; its relative token_file is relative to the config file.
        let t = resolve(&global(&[]), &env(&x)).unwrap();
        assert_eq!(
            t,
            Target {
                endpoint: "http://dev:1".into(),
                token: Some("tok-from-file".into()),
                context: Some("dev".into()),
                ca_file: None,
            }
        );
        // --context, or POOLMGR_CONTEXT, picks another.
        let t = resolve(&global(&["--context", "prod"]), &env(&x)).unwrap();
        assert_eq!((t.endpoint.as_str(), t.token.as_deref()), ("http://prod:1", Some("tok-prod")));
        let t = resolve(&global(&[]), &env(&[x[0], ("POOLMGR_CONTEXT", "prod")])).unwrap();
        assert_eq!(t.endpoint, "http://prod:1");
        // The environment beats the context, one field at a time.
        let t = resolve(&global(&[]), &env(&[x[0], ("POOLMGR_ENDPOINT", "http://env:1")])).unwrap();
        assert_eq!((t.endpoint.as_str(), t.token.as_deref()), ("http://env:1", Some("tok-from-file")));
        let t = resolve(&global(&[]), &env(&[x[0], ("POOLMGR_TOKEN", "tok-env")])).unwrap();
        assert_eq!((t.endpoint.as_str(), t.token.as_deref()), ("http://dev:1", Some("tok-env")));
        // Flags beat the environment.
        let e = env(&[x[0], ("POOLMGR_ENDPOINT", "http://env:1"), ("POOLMGR_TOKEN", "tok-env")]);
        let t = resolve(&global(&["--endpoint", "http://flag:1", "--token", "tok-flag"]), &e).unwrap();
        assert_eq!((t.endpoint.as_str(), t.token.as_deref()), ("http://flag:1", Some("tok-flag")));
        let f = d.0.join("flag.token");
        write_mode(&f, "  tok-flag-file \n", 0o400);
        let t = resolve(&global(&["--token-file", f.to_str().unwrap()]), &e).unwrap();
        assert_eq!(t.token.as_deref(), Some("tok-flag-file"));
        // POOLMGR_TOKEN_FILE below POOLMGR_TOKEN, above the context.
        let t = resolve(&global(&[]), &env(&[x[0], ("POOLMGR_TOKEN_FILE", f.to_str().unwrap())])).unwrap();
        assert_eq!(t.token.as_deref(), Some("tok-flag-file"));
        // Nothing anywhere: the default endpoint, no token, and no file needed.
        let none = env(&[("XDG_CONFIG_HOME", "/nonexistent/poolmgrctl")]);
        assert_eq!(
            resolve(&global(&[]), &none).unwrap(),
            Target { endpoint: DEFAULT_ENDPOINT.into(), token: None, context: None, ca_file: None }
        );
    }

    #[test]
    fn the_ca_file_comes_from_the_flag_then_the_environment_then_the_context() {
        let d = dir();
        let xdg =
            write_config(&d.0, "current_context: a\ncontexts:\n  a: {endpoint: 'https://a:1', ca_file: corp.pem}\n");
        let x = [("XDG_CONFIG_HOME", xdg.as_str())];
        // The context's, relative to the config file.
        let t = resolve(&global(&[]), &env(&x)).unwrap();
        assert_eq!(t.ca_file, Some(d.0.join("poolmgr/corp.pem")));
        let e = env(&[x[0], ("POOLMGR_CA_FILE", "/env.pem")]);
        assert_eq!(resolve(&global(&[]), &e).unwrap().ca_file, Some(PathBuf::from("/env.pem")));
        let t = resolve(&global(&["--server-ca-file", "/flag.pem"]), &e).unwrap();
        assert_eq!(t.ca_file, Some(PathBuf::from("/flag.pem")));
        // None anywhere: the system's trust store alone.
        let none = env(&[("XDG_CONFIG_HOME", "/nonexistent/poolmgrctl")]);
        assert_eq!(resolve(&global(&[]), &none).unwrap().ca_file, None);
    }

    #[test]
    fn bad_contexts_and_files_are_usage_errors_that_say_what_to_fix() {
        let d = dir();
        let xdg = write_config(&d.0, "contexts:\n  dev: {endpoint: 'http://dev:1'}\n");
        let x = env(&[("XDG_CONFIG_HOME", xdg.as_str())]);
        let e = resolve(&global(&["--context", "nope"]), &x).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.message.contains("\"nope\"") && e.message.contains("it has: dev"), "{e}");
        let e = resolve(&global(&["--token-file", "/nonexistent/t"]), &x).unwrap_err();
        assert!(e.message.contains("/nonexistent/t") && e.message.contains("--token-file"), "{e}");
        write_config(&d.0, "contexts: [oops");
        let e = resolve(&global(&[]), &x).unwrap_err();
        assert!(e.message.contains("config.yaml") && e.message.contains("fix or remove"), "{e}");
        // A broken file does not matter when flags say everything.
        resolve(&global(&["--endpoint", "http://h:1", "--token", "t"]), &x).unwrap();
        write_config(&d.0, "contexts:\n  dev: {token: a, token_file: b}\n");
        assert!(resolve(&global(&[]), &x).unwrap_err().message.contains("both token and token_file"));
        write_config(&d.0, "contexts:\n  dev: {endpoint: x, colour: red}\n");
        assert!(resolve(&global(&[]), &x).unwrap_err().message.contains("colour"));
    }

    #[test]
    fn saved_files_read_back_and_are_private() {
        let d = dir();
        let p = d.0.join("sub/config.yaml");
        let mut cfg = ConfigFile { current_context: Some("a".into()), ..Default::default() };
        cfg.contexts.insert(
            "a".into(),
            Context {
                endpoint: Some("http://a:1".into()),
                token: Some("t".into()),
                token_file: None,
                ca_file: Some("ca.pem".into()),
            },
        );
        save(&p, &cfg).unwrap();
        assert_eq!(load(&p).unwrap(), cfg);
        #[cfg(unix)]
        {
            assert_eq!(mode(&p), 0o600);
            assert_eq!(mode(p.parent().unwrap()), 0o700, "a directory it creates is private too");
        }
        assert_eq!(load(&d.0.join("missing.yaml")).unwrap(), ConfigFile::default());
    }

    #[test]
    #[cfg(unix)]
    fn saving_goes_through_a_new_private_file_whatever_lies_in_the_directory() {
        let d = dir();
        let p = d.0.join("config.yaml");
        let cfg = ConfigFile { current_context: Some("a".into()), ..Default::default() };
        // A config file others may read, and a leftover temporary file others may read at
        // the name a fixed-name writer would reuse (keeping its mode): both end up private.
        write_mode(&p, "contexts: {}\n", 0o644);
        let stale = d.0.join("config.yaml.tmp");
        write_mode(&stale, "stale", 0o644);
        save(&p, &cfg).unwrap();
        assert_eq!(mode(&p), 0o600);
        assert_eq!(load(&p).unwrap(), cfg);
        assert_eq!(std::fs::read_to_string(&stale).unwrap(), "stale", "another file is never reused");
        // No temporary file is left behind.
        let mut names: Vec<String> =
            std::fs::read_dir(&d.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, ["config.yaml", "config.yaml.tmp"]);
        // A write that cannot happen leaves the file as it was and nothing else.
        let ro = d.0.join("ro");
        std::fs::create_dir(&ro).unwrap();
        let q = ro.join("config.yaml");
        write_mode(&q, "contexts: {}\n", 0o600);
        std::fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o500)).unwrap();
        let refused = save(&q, &cfg);
        std::fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        // (root may write anyway; then it simply succeeded.)
        if let Err(e) = refused {
            assert!(e.message.contains("cannot write"), "{e}");
            assert_eq!(std::fs::read_to_string(&q).unwrap(), "contexts: {}\n");
            assert_eq!(std::fs::read_dir(&ro).unwrap().count(), 1);
        }
    }

    #[test]
    #[cfg(unix)]
    fn tokens_other_users_may_read_are_refused_with_the_chmod_that_fixes_it() {
        let d = dir();
        let f = d.0.join("my token");
        for m in [0o644, 0o640, 0o604, 0o620] {
            write_mode(&f, "tok\n", m);
            let e = read_token_file(&f, "--token-file").unwrap_err();
            assert_eq!(e.exit_code(), 2);
            let quoted = format!("`chmod 600 '{}'`", f.display());
            assert!(e.message.contains(&quoted) && e.message.contains(&format!("{m:04o}")), "{e}");
            assert!(e.message.contains("--token-file"), "{e}");
        }
        for m in [0o600, 0o400] {
            write_mode(&f, "tok\n", m);
            assert_eq!(read_token_file(&f, "--token-file").unwrap(), "tok");
        }
        // Every way to name a token file is checked, and a token in the config file is held
        // to the same rule.
        write_mode(&f, "tok\n", 0o644);
        let path = f.to_str().unwrap();
        assert!(resolve(&global(&["--token-file", path]), &env(&[])).is_err());
        assert!(resolve(&global(&[]), &env(&[("POOLMGR_TOKEN_FILE", path)])).is_err());
        let xdg = write_config(&d.0, "current_context: a\ncontexts:\n  a: {token_file: '../my token'}\n");
        let x = env(&[("XDG_CONFIG_HOME", xdg.as_str())]);
        assert!(resolve(&global(&[]), &x).unwrap_err().message.contains("chmod 600"));
        write_config(&d.0, "current_context: a\ncontexts:\n  a: {token: tok}\n");
        assert_eq!(resolve(&global(&[]), &x).unwrap().token.as_deref(), Some("tok"));
        let config = d.0.join("poolmgr/config.yaml");
        write_mode(&config, "current_context: a\ncontexts:\n  a: {token: tok}\n", 0o644);
        let e = resolve(&global(&[]), &x).unwrap_err();
        assert!(e.message.contains(&format!("`chmod 600 {}`", config.display())), "{e}");
        // ... only when its token is used: flags that say everything leave it unread.
        resolve(&global(&["--endpoint", "http://h:1", "--token", "t"]), &x).unwrap();
        write_mode(&config, "current_context: a\ncontexts:\n  a: {endpoint: 'http://a:1'}\n", 0o644);
        assert_eq!(resolve(&global(&[]), &x).unwrap().endpoint, "http://a:1");
    }

    #[test]
    fn shell_words_are_quoted_when_they_need_it() {
        assert_eq!(shell_word("/home/me/.config/poolmgr/dev.token"), "/home/me/.config/poolmgr/dev.token");
        assert_eq!(shell_word("/tmp/my token"), "'/tmp/my token'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word("~x"), "'~x'");
    }
}
