//! The client's one error type: the contract's errors (status, HTTP code, `reason`, message,
//! `Retry-After`), the failures that happen before an answer exists (with their cause chain),
//! and [`ValidationError`] for input refused before anything is sent.
//!
//! Must never hide a cause: a transport failure keeps the underlying error as its
//! [`std::error::Error::source`], so a caller can walk the chain (or downcast it).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The `reason` of a failed pre-lease hook (`shared/http-api.md`, "Errors").
pub const REASON_HOOK_FAILED: &str = "HOOK_FAILED";

/// The contract's error statuses (`shared/http-api.md`, "Errors").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// 400: a malformed or invalid request; retrying it unchanged cannot help.
    InvalidArgument,
    /// 400: the request is valid but the state forbids it (delete of a pool with leases, …).
    FailedPrecondition,
    /// 401: no token, or an unknown one.
    Unauthenticated,
    /// 403: the token's role may not do this.
    PermissionDenied,
    /// 404: no such pool, lease, host or VM (or one outside the token's scope).
    NotFound,
    /// 409: a create of something that exists.
    AlreadyExists,
    /// 409: the request raced another change; retrying is correct.
    Aborted,
    /// 429: no AVAILABLE VM, or the live-lease quota is used up (see `reason`).
    ResourceExhausted,
    /// 500: a failed pre-lease hook (`reason` `HOOK_FAILED`) or an unexpected server error.
    Internal,
    /// 503: flintlock or the database could not be reached; retry.
    Unavailable,
    /// 405: a known path with a method it does not serve.
    Unimplemented,
    /// A status this client does not know, as the server wrote it.
    Other(String),
}

impl Status {
    /// The wire name (`RESOURCE_EXHAUSTED`).
    pub fn as_str(&self) -> &str {
        match self {
            Status::InvalidArgument => "INVALID_ARGUMENT",
            Status::FailedPrecondition => "FAILED_PRECONDITION",
            Status::Unauthenticated => "UNAUTHENTICATED",
            Status::PermissionDenied => "PERMISSION_DENIED",
            Status::NotFound => "NOT_FOUND",
            Status::AlreadyExists => "ALREADY_EXISTS",
            Status::Aborted => "ABORTED",
            Status::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Status::Internal => "INTERNAL",
            Status::Unavailable => "UNAVAILABLE",
            Status::Unimplemented => "UNIMPLEMENTED",
            Status::Other(s) => s,
        }
    }

    /// From the wire name; an unknown one is kept as [`Status::Other`].
    pub fn parse(s: &str) -> Status {
        match s {
            "INVALID_ARGUMENT" => Status::InvalidArgument,
            "FAILED_PRECONDITION" => Status::FailedPrecondition,
            "UNAUTHENTICATED" => Status::Unauthenticated,
            "PERMISSION_DENIED" => Status::PermissionDenied,
            "NOT_FOUND" => Status::NotFound,
            "ALREADY_EXISTS" => Status::AlreadyExists,
            "ABORTED" => Status::Aborted,
            "RESOURCE_EXHAUSTED" => Status::ResourceExhausted,
            "INTERNAL" => Status::Internal,
            "UNAVAILABLE" => Status::Unavailable,
            "UNIMPLEMENTED" => Status::Unimplemented,
            other => Status::Other(other.to_owned()),
        }
    }

    /// The status of an HTTP answer without the contract's error body (a proxy's page).
    pub fn for_http(code: u16) -> Status {
        match code {
            400 => Status::InvalidArgument,
            401 => Status::Unauthenticated,
            403 => Status::PermissionDenied,
            404 => Status::NotFound,
            405 => Status::Unimplemented,
            409 => Status::Aborted,
            429 => Status::ResourceExhausted,
            500 => Status::Internal,
            502..=504 => Status::Unavailable,
            _ => Status::Other("UNKNOWN".into()),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answer of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApiError {
    /// The HTTP status code (the body's `code`).
    pub code: u16,
    /// The body's `status`.
    pub status: Status,
    /// The body's `message`, for people: never parse it, use `status` and `reason`.
    pub message: String,
    /// The body's stable `reason` word (`POOL_EXHAUSTED`, `QUOTA_EXCEEDED`, `HOOK_FAILED`, …),
    /// when the server sent one.
    pub reason: Option<String>,
    /// The server's correlation id for the request (`x-request-id`): quote it to an admin.
    pub request_id: Option<String>,
    /// The server's `Retry-After` (whole seconds), when it sent one.
    pub retry_after: Option<Duration>,
}

impl ApiError {
    /// An error answer (for tests and for callers that wrap the client).
    pub fn new(code: u16, status: Status, message: impl Into<String>) -> ApiError {
        ApiError { code, status, message: message.into(), reason: None, request_id: None, retry_after: None }
    }

    /// With the body's `reason`.
    pub fn with_reason(mut self, reason: impl Into<String>) -> ApiError {
        self.reason = Some(reason.into());
        self
    }

    /// A failed pre-lease hook (500 with `reason` `HOOK_FAILED`).
    pub fn is_hook_failure(&self) -> bool {
        self.reason.as_deref() == Some(REASON_HOOK_FAILED)
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for ApiError {}

/// The cause of a transport failure: the HTTP library's error, shared so [`Error`] stays
/// `Clone`.
pub type TransportSource = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Input refused before anything was sent: a malformed name, spec or bound. Its message
/// names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationError {
    message: String,
}

impl ValidationError {
    /// An error with this message (it should name the field).
    pub fn new(message: impl Into<String>) -> ValidationError {
        ValidationError { message: message.into() }
    }

    /// What is wrong, naming the field.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<&str> for ValidationError {
    fn from(m: &str) -> ValidationError {
        ValidationError::new(m)
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ValidationError {}

impl From<ValidationError> for Error {
    fn from(e: ValidationError) -> Error {
        Error::InvalidInput(e.message)
    }
}

/// Why no usable answer arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// No connection: the request was never sent.
    Connect,
    /// No complete answer within the time-out: the request may have taken effect.
    Timeout,
    /// The connection broke after the request was sent (reset, closed, answer cut off): the
    /// request may have taken effect.
    Interrupted,
}

/// Everything a call can fail with. Match on the kind of failure, then on
/// [`ApiError::status`] and [`ApiError::reason`] (stable words), never on message text.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// The server answered with an error.
    Api(ApiError),
    /// No answer, or only part of one. `source` is the HTTP library's error (its own chain
    /// goes down to the I/O or TLS error).
    #[non_exhaustive]
    Transport {
        /// Whether the request can have taken effect.
        kind: TransportKind,
        /// What happened, for people.
        message: String,
        /// The underlying error.
        source: Option<TransportSource>,
    },
    /// A success answer whose body is not the object the contract promises.
    Decode(String),
    /// Refused before anything was sent (a malformed endpoint, pool name or request id).
    InvalidInput(String),
    /// A kept-alive lease ([`crate::LeaseGuard`]) reached its `expires_at` without a
    /// successful heartbeat: the server ends it (its VM is deleted) even if it has not said
    /// so yet.
    #[non_exhaustive]
    LeaseExpired {
        /// The lease.
        lease_id: String,
        /// When it expired, as its last successful heartbeat (or the claim) set it.
        expires_at: chrono::DateTime<chrono::Utc>,
        /// Why the heartbeats before it failed, if one was answered or timed out.
        last_error: Option<Box<Error>>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Api(e) => write!(f, "{}: {}", e.status, e.message),
            Error::Transport { message, .. } => f.write_str(message),
            Error::Decode(m) | Error::InvalidInput(m) => f.write_str(m),
            Error::LeaseExpired { lease_id, expires_at, last_error } => {
                write!(f, "lease {lease_id} expired at {expires_at} without a successful heartbeat")?;
                match last_error {
                    Some(e) => write!(f, " (the last one failed: {e})"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl std::error::Error for Error {
    /// For a transport failure, the HTTP library's error itself (`downcast_ref::<reqwest::Error>`
    /// works), whose own chain goes down to the I/O or TLS error.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Transport { source, .. } => source.as_deref().map(|e| e as &(dyn std::error::Error + 'static)),
            _ => None,
        }
    }
}

impl Error {
    /// The server's status, for an error answer.
    pub fn status(&self) -> Option<&Status> {
        match self {
            Error::Api(e) => Some(&e.status),
            _ => None,
        }
    }

    /// A transport failure of `kind`, caused by `source`.
    pub fn transport(
        kind: TransportKind,
        message: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Error {
        Error::Transport { kind, message: message.into(), source: source.map(Arc::from) }
    }

    /// The error answer's `reason` (`POOL_EXHAUSTED`, `HOOK_FAILED`, …), when the server sent
    /// one.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Error::Api(e) => e.reason.as_deref(),
            _ => None,
        }
    }

    /// The server's correlation id of the failed request (`x-request-id`), when it answered.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            Error::Api(e) => e.request_id.as_deref(),
            _ => None,
        }
    }

    /// The server's `Retry-After`, for an error answer that carried one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Api(e) => e.retry_after,
            _ => None,
        }
    }

    /// A later identical request may succeed: no answer came (connection, time-out, cut-off
    /// answer), or the server said UNAVAILABLE (503) or ABORTED (409, "retrying is correct").
    /// RESOURCE_EXHAUSTED is not counted: an empty pool is worth waiting for only when the
    /// caller says so ([`crate::ClaimOptions::wait_for_vm`]).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Transport { .. } => true,
            Error::Api(e) => matches!(e.status, Status::Unavailable | Status::Aborted),
            _ => false,
        }
    }

    /// The request may have taken effect although no answer said so.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Error::Transport { kind: TransportKind::Timeout | TransportKind::Interrupted, .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(status: Status) -> Error {
        Error::Api(ApiError::new(0, status, "m"))
    }

    #[test]
    fn a_transport_error_keeps_its_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = Error::transport(TransportKind::Interrupted, "cut off", Some(Box::new(io)));
        let src = std::error::Error::source(&e).expect("a source");
        assert_eq!(src.to_string(), "reset by peer");
        assert!(src.downcast_ref::<std::io::Error>().is_some());
        let hook = Error::Api(ApiError::new(500, Status::Internal, "hook").with_reason(REASON_HOOK_FAILED));
        assert_eq!(hook.reason(), Some("HOOK_FAILED"));
        assert!(matches!(&hook, Error::Api(a) if a.is_hook_failure()));
    }

    #[test]
    fn statuses_round_trip_and_unknown_ones_are_kept() {
        for s in [
            "INVALID_ARGUMENT",
            "FAILED_PRECONDITION",
            "UNAUTHENTICATED",
            "PERMISSION_DENIED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "ABORTED",
            "RESOURCE_EXHAUSTED",
            "INTERNAL",
            "UNAVAILABLE",
            "UNIMPLEMENTED",
            "TEAPOT",
        ] {
            assert_eq!(Status::parse(s).as_str(), s);
        }
        assert_eq!(Status::parse("TEAPOT"), Status::Other("TEAPOT".into()));
        assert_eq!(Status::for_http(502), Status::Unavailable);
        assert_eq!(Status::for_http(429), Status::ResourceExhausted);
    }

    #[test]
    fn what_is_transient() {
        assert!(api(Status::Unavailable).is_transient());
        assert!(api(Status::Aborted).is_transient());
        assert!(!api(Status::ResourceExhausted).is_transient());
        assert!(!api(Status::Internal).is_transient());
        assert!(!api(Status::NotFound).is_transient());
        let t = |kind| Error::transport(kind, "x", None);
        assert!(t(TransportKind::Connect).is_transient() && !t(TransportKind::Connect).outcome_unknown());
        assert!(t(TransportKind::Timeout).outcome_unknown());
        assert!(t(TransportKind::Interrupted).outcome_unknown());
        assert!(!Error::InvalidInput("x".into()).is_transient());
        assert_eq!(api(Status::NotFound).to_string(), "NOT_FOUND: m");
    }
}
