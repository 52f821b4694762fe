//! The client's one error type: the contract's errors (status, HTTP code, message,
//! `Retry-After`), and the failures that happen before an answer exists.

use std::fmt;
use std::time::Duration;

/// The contract's error statuses (`shared/http-api.md`, "Errors").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Status {
    InvalidArgument,
    FailedPrecondition,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    AlreadyExists,
    Aborted,
    ResourceExhausted,
    Internal,
    Unavailable,
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
pub struct ApiError {
    /// The HTTP status code (the body's `code`).
    pub code: u16,
    pub status: Status,
    pub message: String,
    /// The body's stable `reason` word (`POOL_EXHAUSTED`, `QUOTA_EXCEEDED`, `HOOK_FAILED`, …),
    /// when the server sent one.
    pub reason: Option<String>,
    /// The server's correlation id for the request (`x-request-id`): quote it to an admin.
    pub request_id: Option<String>,
    /// The server's `Retry-After` (whole seconds), when it sent one.
    pub retry_after: Option<Duration>,
}

/// Why no usable answer arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// No connection: the request was never sent.
    Connect,
    /// No complete answer within the time-out: the request may have taken effect.
    Timeout,
    /// The connection broke after the request was sent (reset, closed, answer cut off): the
    /// request may have taken effect.
    Interrupted,
}

#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server answered with an error.
    #[error("{}: {}", .0.status, .0.message)]
    Api(ApiError),
    /// No answer, or only part of one.
    #[error("{message}")]
    Transport { kind: TransportKind, message: String },
    /// A success answer whose body is not the object the contract promises.
    #[error("{0}")]
    Decode(String),
    /// Refused before anything was sent (a malformed endpoint, pool name or request id).
    #[error("{0}")]
    InvalidInput(String),
}

impl Error {
    /// The server's status, for an error answer.
    pub fn status(&self) -> Option<&Status> {
        match self {
            Error::Api(e) => Some(&e.status),
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
        Error::Api(ApiError { code: 0, status, message: "m".into(), reason: None, request_id: None, retry_after: None })
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
        let t = |kind| Error::Transport { kind, message: "x".into() };
        assert!(t(TransportKind::Connect).is_transient() && !t(TransportKind::Connect).outcome_unknown());
        assert!(t(TransportKind::Timeout).outcome_unknown());
        assert!(t(TransportKind::Interrupted).outcome_unknown());
        assert!(!Error::InvalidInput("x".into()).is_transient());
        assert_eq!(api(Status::NotFound).to_string(), "NOT_FOUND: m");
    }
}
