//! Logging: JSON lines on stderr through `tracing`, level from `RUST_LOG` (default info).

use tracing_subscriber::EnvFilter;

/// Installs the JSON log subscriber. Safe to call more than once (later calls do nothing).
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_current_span(true)
        .with_writer(std::io::stderr)
        .try_init();
}
