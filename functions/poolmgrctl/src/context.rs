//! `poolmgrctl context list|use|set`: the config file's named contexts. Local only: nothing
//! is sent to a server.

use serde_json::json;

use crate::cli::{ContextCmd, Format, Global};
use crate::config::{self, Context, Env};
use crate::error::CliError;
use crate::output::{Table, emit, emit_document, printable};

pub fn run(g: &Global, format: Format, cmd: ContextCmd) -> Result<(), CliError> {
    let env = Env::process();
    let path = config::config_path(g, &env)?;
    let mut cfg = config::load(&path)?;
    match cmd {
        ContextCmd::List => {
            let current = cfg.current_context.as_deref();
            match &format {
                Format::Table => {
                    let mut t = Table::new(&["CURRENT", "NAME", "ENDPOINT", "TOKEN"]);
                    for (name, c) in &cfg.contexts {
                        let token = match (&c.token, &c.token_file) {
                            (Some(_), _) => "<in config>".to_owned(),
                            (None, Some(f)) => format!("file {f}"),
                            (None, None) => "<none>".to_owned(),
                        };
                        t.row(vec![
                            if current == Some(name) { "*".into() } else { String::new() },
                            name.clone(),
                            c.endpoint.clone().unwrap_or_else(|| "<none>".into()),
                            token,
                        ]);
                    }
                    emit(&t.render(!g.no_headers))
                }
                f => {
                    // Tokens never leave the file: only whether one is there.
                    let contexts: Vec<_> = cfg
                        .contexts
                        .iter()
                        .map(|(name, c)| {
                            json!({"name": name, "current": current == Some(name.as_str()), "endpoint": c.endpoint,
                                   "token_file": c.token_file, "ca_file": c.ca_file, "has_token": c.token.is_some() || c.token_file.is_some()})
                        })
                        .collect();
                    let doc = json!({"config": path, "current_context": current, "contexts": contexts});
                    emit_document(f, doc.to_string().as_bytes(), || cfg.contexts.keys().cloned().collect())
                }
            }
        }
        ContextCmd::Use { name } => {
            let Some(c) = cfg.contexts.get(&name) else {
                let known: Vec<&str> = cfg.contexts.keys().map(String::as_str).collect();
                return Err(CliError::new(
                    "not_found",
                    format!(
                        "{} has no context {name:?}{}; create it with `poolmgrctl --endpoint URL --token-file FILE context set {name}`",
                        path.display(),
                        if known.is_empty() { String::new() } else { format!(" (it has: {})", known.join(", ")) }
                    ),
                ));
            };
            let endpoint = c.endpoint.clone().unwrap_or_else(|| config::DEFAULT_ENDPOINT.into());
            cfg.current_context = Some(name.clone());
            config::save(&path, &cfg)?;
            if format == Format::Table {
                emit(&format!("current context: {} ({})\n", printable(&name), printable(&endpoint)))?;
            }
            Ok(())
        }
        ContextCmd::Set { name, current } => {
            if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(CliError::usage(format!("context name {name:?}: use a non-empty name without spaces")));
            }
            let entry = cfg.contexts.entry(name.clone()).or_insert_with(Context::default);
            if let Some(e) = &g.endpoint {
                // Checked now, not on first use.
                poolmgr_client::Client::new(e)?;
                entry.endpoint = Some(e.clone());
            }
            match (&g.token, &g.token_file) {
                (Some(t), _) => (entry.token, entry.token_file) = (Some(t.clone()), None),
                (None, Some(f)) => {
                    let abs = std::path::absolute(f)
                        .map_err(|e| CliError::usage(format!("--token-file {}: {e}", f.display())))?;
                    config::read_token_file(&abs, "--token-file")?;
                    (entry.token, entry.token_file) = (None, Some(abs.to_string_lossy().into_owned()));
                }
                (None, None) => {}
            }
            if let Some(f) = &g.server_ca_file {
                let abs = std::path::absolute(f)
                    .map_err(|e| CliError::usage(format!("--server-ca-file {}: {e}", f.display())))?;
                // Checked now, not on first use.
                poolmgr_client::Client::builder("https://localhost").ca_file(&abs).build()?;
                entry.ca_file = Some(abs.to_string_lossy().into_owned());
            }
            if current || cfg.current_context.is_none() {
                cfg.current_context = Some(name.clone());
            }
            config::save(&path, &cfg)?;
            if format == Format::Table {
                emit(&format!("context {} saved in {}\n", printable(&name), printable(&path.display().to_string())))?;
            }
            Ok(())
        }
    }
}
