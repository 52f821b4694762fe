//! Logging: JSON lines on stderr through `tracing`, level from `RUST_LOG` (default info).
//!
//! Must never let `RUST_LOG` open a secret's way into the log. Some dependencies log what
//! they carry below info: tokio-postgres every statement with its parameters at debug (the
//! store's typed queries escape it, but not the claim's prepared statement, nor a host's
//! `basic_auth_token` the day its insert goes through `query`/`execute`), `lambda_runtime` the raw API Gateway event, its `Authorization: Bearer …` header
//! included, at trace. The targets of [`PINNED`] therefore log at `info` at most, whatever
//! `RUST_LOG` says: `RUST_LOG=trace`, `tokio_postgres=trace` or `tokio_postgres::query=debug`
//! open everything else and leave them at info.
//!
//! The pin is a second filter in front of the `RUST_LOG` one (both must let an event
//! through), not directives appended to `RUST_LOG`: `EnvFilter` lets the most specific
//! directive win, so an appended `tokio_postgres=info` would lose to
//! `tokio_postgres::query=debug`, and a span directive (`[request]=trace`) enables every
//! event inside the span whatever its target.
//!
//! What was checked and left open: hyper, h2, tonic, tower-http, rustls, reqwest and
//! aws_lambda_events log no header value, body or key below info (h2 leaves header fields
//! out of its frame logs on purpose, tower-http's request spans are ours and name method,
//! path and request id); reqwest's byte dump of a connection logs only for a client built
//! with `connection_verbose`, which none is, and is pinned all the same.

use tracing::Subscriber;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{FilterExt as _, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::prelude::*;

/// Targets (and everything under them) that never log below info: each logs secrets at
/// debug or trace (statement parameters, raw events with their Authorization header, raw
/// connection bytes).
pub const PINNED: &[&str] =
    &["tokio_postgres", "lambda_runtime", "lambda_runtime_api_client", "lambda_http", "reqwest::connect::verbose"];

/// Installs the JSON log subscriber. Safe to call more than once (later calls do nothing).
pub fn init() {
    init_with(std::env::var("RUST_LOG").ok().as_deref());
}

/// [`init`] with the filter given (`poolmgr-local --rust-log`, which wins over `RUST_LOG`);
/// `None` or a filter that does not parse is `info`.
pub fn init_with(directives: Option<&str>) {
    let filter = directives
        .filter(|d| !d.trim().is_empty())
        .and_then(|d| EnvFilter::try_new(d).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let _ = subscriber(filter, std::io::stderr).try_init();
}

/// The subscriber [`init`] installs: `filter` (from `RUST_LOG`) and the pin of [`PINNED`],
/// writing JSON lines to `writer`.
fn subscriber<W>(filter: EnvFilter, writer: W) -> impl Subscriber + Send + Sync
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let pin = PINNED.iter().fold(Targets::new().with_default(LevelFilter::TRACE), |pin, target| {
        pin.with_target(*target, LevelFilter::INFO)
    });
    tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_writer(writer)
            .with_filter(filter.and(pin)),
    )
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A `MakeWriter` into a shared buffer.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buf {
        type Writer = Buf;
        fn make_writer(&'w self) -> Buf {
            self.clone()
        }
    }

    /// What the subscriber writes for `RUST_LOG=directives` when each pinned target (and one
    /// not pinned) logs at every level, inside a span named `request`.
    fn logged(directives: &str) -> String {
        let buf = Buf::default();
        tracing::subscriber::with_default(subscriber(EnvFilter::new(directives), buf.clone()), || {
            let _span = tracing::info_span!("request").entered();
            tracing::trace!(target: "tokio_postgres::query", "pg trace");
            tracing::debug!(target: "tokio_postgres::query", "pg debug");
            tracing::info!(target: "tokio_postgres::query", "pg info");
            tracing::trace!(target: "lambda_runtime::layers::api_response", "runtime trace");
            tracing::debug!(target: "lambda_http", "http debug");
            tracing::trace!(target: "lambda_runtime_api_client", "client trace");
            tracing::trace!(target: "reqwest::connect::verbose", "bytes trace");
            tracing::warn!(target: "lambda_runtime", "runtime warn");
            tracing::debug!(target: "poolmgr_core::db", "ours debug");
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn no_rust_log_directive_lifts_a_pinned_target_above_info() {
        for directives in [
            "trace",
            "debug",
            "tokio_postgres=trace,lambda_runtime=trace,lambda_http=trace",
            "info,tokio_postgres::query=trace,lambda_runtime::layers=trace,lambda_runtime_api_client=trace",
            "info,reqwest=trace,reqwest::connect::verbose=trace",
            "[request]=trace",
            "info,tokio_postgres[request]=trace",
            "trace,tokio_postgres=info,tokio_postgres::query=trace",
        ] {
            let out = logged(directives);
            for line in ["pg trace", "pg debug", "runtime trace", "http debug", "client trace", "bytes trace"] {
                assert!(!out.contains(line), "RUST_LOG={directives} let {line:?} through:\n{out}");
            }
            for line in ["pg info", "runtime warn"] {
                assert!(out.contains(line), "RUST_LOG={directives} lost {line:?}:\n{out}");
            }
        }
    }

    #[test]
    fn rust_log_still_opens_and_closes_everything_else() {
        assert!(logged("trace").contains("ours debug"));
        assert!(logged("[request]=debug").contains("ours debug"));
        let quiet = logged("warn");
        assert!(!quiet.contains("ours debug") && !quiet.contains("pg info"), "{quiet}");
        assert!(quiet.contains("runtime warn"), "{quiet}");
        assert!(!logged("lambda_runtime=error").contains("runtime warn"));
    }
}
