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
//! explicit invocation. It is written (by `context use` / `context set`) with mode 0600:
//! it may hold tokens.

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

/// Writes the config file atomically (a temporary file renamed over it), mode 0600.
pub fn save(path: &Path, cfg: &ConfigFile) -> Result<(), CliError> {
    let fail = |what: &str, e: std::io::Error| CliError::usage(format!("cannot {what} {}: {e}", path.display()));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| fail("create the directory of", e))?;
    }
    let text = yaml_serde::to_string(cfg).map_err(|e| CliError::new("internal", e.to_string()))?;
    let tmp = path.with_extension("yaml.tmp");
    {
        use std::io::Write;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        let mut f = o.open(&tmp).map_err(|e| fail("write", e))?;
        f.write_all(text.as_bytes()).map_err(|e| fail("write", e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| fail("write", e))
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

/// The token in `path`, trimmed; `what` says where the path came from.
pub fn read_token_file(path: &Path, what: &str) -> Result<String, CliError> {
    let t = std::fs::read_to_string(path)
        .map_err(|e| CliError::usage(format!("cannot read the token file {} ({what}): {e}", path.display())))?;
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
}

/// Resolves endpoint and token: flags > environment (`POOLMGR_ENDPOINT`, `POOLMGR_TOKEN`,
/// `POOLMGR_TOKEN_FILE`) > the context (`--context`, `POOLMGR_CONTEXT`, else the file's
/// `current_context`) > the default endpoint and no token.
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
                    (Some(t), _) => Some(t.clone()),
                    (None, Some(f)) => {
                        let base = path.parent().unwrap_or(Path::new("."));
                        Some(read_token_file(&resolve_path(f, base, env), &format!("context {name}"))?)
                    }
                    (None, None) => None,
                };
            }
            used = Some(name);
        }
    }
    Ok(Target {
        endpoint: endpoint.unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned()),
        token: token.filter(|t| !t.is_empty()),
        context: used,
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

    fn write_config(d: &Path, text: &str) -> String {
        let p = d.join("poolmgr/config.yaml");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        d.to_str().unwrap().to_owned()
    }

    #[test]
    fn flags_beat_environment_beats_context_beats_defaults() {
        let d = dir();
        std::fs::write(d.0.join("poolmgr-dev.token"), "tok-from-file\n").unwrap();
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
                context: Some("dev".into())
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
        std::fs::write(&f, "  tok-flag-file \n").unwrap();
        let t = resolve(&global(&["--token-file", f.to_str().unwrap()]), &e).unwrap();
        assert_eq!(t.token.as_deref(), Some("tok-flag-file"));
        // POOLMGR_TOKEN_FILE below POOLMGR_TOKEN, above the context.
        let t = resolve(&global(&[]), &env(&[x[0], ("POOLMGR_TOKEN_FILE", f.to_str().unwrap())])).unwrap();
        assert_eq!(t.token.as_deref(), Some("tok-flag-file"));
        // Nothing anywhere: the default endpoint, no token, and no file needed.
        let none = env(&[("XDG_CONFIG_HOME", "/nonexistent/poolmgrctl")]);
        assert_eq!(
            resolve(&global(&[]), &none).unwrap(),
            Target { endpoint: DEFAULT_ENDPOINT.into(), token: None, context: None }
        );
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
            Context { endpoint: Some("http://a:1".into()), token: Some("t".into()), token_file: None },
        );
        save(&p, &cfg).unwrap();
        assert_eq!(load(&p).unwrap(), cfg);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        }
        assert_eq!(load(&d.0.join("missing.yaml")).unwrap(), ConfigFile::default());
    }
}
