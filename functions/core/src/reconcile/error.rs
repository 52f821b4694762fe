//! The reconcile pass's own error: what stopped a step (or the pass), and whether trying again
//! can help.
//!
//! A pass never answers HTTP, so it never speaks `ApiError`; and a caller should not have to
//! know the store's or the flintlock client's vocabulary to decide about a retry. Per-pool
//! failures end up as text in [`super::PassReport::errors`] (the next pass retries them
//! anyway); [`super::run_pass`] returns one only when the pass could not run at all, and the
//! `reconcile` Lambda turns [`ReconcileError::is_retryable`] into its `errorType`
//! (conventions.md: scheduled-function errors say whether a retry can help).

use crate::flintlock::FlintlockError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A statement or a connection checkout failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A flintlock host failed a call the step cannot do without (`call` names it).
    #[error("flintlock {call} failed: {source}")]
    Flintlock {
        call: &'static str,
        #[source]
        source: FlintlockError,
    },
}

impl ReconcileError {
    pub fn flintlock(call: &'static str, source: FlintlockError) -> ReconcileError {
        ReconcileError::Flintlock { call, source }
    }

    /// Whether the same work can succeed later without anyone changing anything.
    ///
    /// Retryable: the database unreachable, a dropped connection or a statement timeout
    /// ([`StoreError::Unavailable`]), a deadlock, serialization failure, cancelled statement
    /// or lock timeout ([`StoreError::Busy`]); a flintlock host that is down, slow or answered an
    /// error for this call. Not retryable: a statement the database rejects
    /// ([`StoreError::Db`], [`StoreError::UniqueViolation`]: a schema or a bug a new deploy fixes), a host whose stored
    /// settings are unusable or whose flintlockd lacks the API, and a spec flintlock refuses
    /// as invalid: each needs an operator first.
    pub fn is_retryable(&self) -> bool {
        match self {
            ReconcileError::Store(StoreError::Unavailable(_) | StoreError::Busy { .. }) => true,
            ReconcileError::Store(StoreError::Db(_) | StoreError::UniqueViolation { .. }) => false,
            ReconcileError::Flintlock { source, .. } => match source {
                FlintlockError::Unavailable { .. } | FlintlockError::Exec { .. } => true,
                FlintlockError::Rpc { code, .. } => *code != tonic::Code::InvalidArgument,
                FlintlockError::Config { .. } | FlintlockError::Unsupported { .. } => false,
                // Needs the key configured first.
                FlintlockError::Credentials { .. } => false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_error(make: fn(String, String) -> FlintlockError) -> ReconcileError {
        ReconcileError::flintlock("list", make("h1".into(), "boom".into()))
    }

    #[test]
    fn an_unreachable_or_slow_database_is_retryable_and_a_rejected_statement_is_not() {
        assert!(ReconcileError::from(StoreError::Unavailable("connection refused".into())).is_retryable());
        assert!(ReconcileError::from(StoreError::Unavailable("statement timed out after 5 ms".into())).is_retryable());
        assert!(!ReconcileError::from(StoreError::Db("relation \"vms\" does not exist".into())).is_retryable());
    }

    /// Issue 14 item 10: what PostgreSQL answers when it rolled a statement back for now.
    #[test]
    fn a_busy_database_is_retryable_and_a_refused_duplicate_is_not() {
        for code in ["40P01", "40001", "57014", "55P03"] {
            let e = StoreError::Busy { code: code.into(), message: "m".into() };
            assert_eq!(e.retry_at_once(), code.starts_with("40"), "{code}");
            assert!(ReconcileError::from(e).is_retryable(), "{code}");
        }
        let dup = StoreError::UniqueViolation { constraint: "hosts_address_key".into(), message: "m".into() };
        assert!(!dup.retry_at_once());
        assert!(!ReconcileError::from(dup).is_retryable());
    }

    #[test]
    fn a_failing_flintlock_host_is_retryable_and_a_bad_spec_or_host_config_is_not() {
        assert!(host_error(|host, message| FlintlockError::Unavailable { host, message }).is_retryable());
        assert!(host_error(|host, message| FlintlockError::Exec { host, message }).is_retryable());
        assert!(
            host_error(|host, message| FlintlockError::Rpc { host, code: tonic::Code::Unknown, message })
                .is_retryable()
        );
        assert!(
            !host_error(|host, message| FlintlockError::Rpc { host, code: tonic::Code::InvalidArgument, message })
                .is_retryable()
        );
        assert!(!host_error(|host, message| FlintlockError::Config { host, message }).is_retryable());
        assert!(!host_error(|host, message| FlintlockError::Unsupported { host, message }).is_retryable());
    }

    #[test]
    fn the_message_names_the_failed_call_and_its_cause() {
        let e = host_error(|host, message| FlintlockError::Unavailable { host, message });
        assert_eq!(e.to_string(), "flintlock list failed: flintlock host h1 unavailable: boom");
        let e = ReconcileError::from(StoreError::Unavailable("x".into()));
        assert_eq!(e.to_string(), "database unavailable: x", "store errors read as before");
    }
}
