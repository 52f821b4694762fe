//! The one error type every HTTP function answers with, and its JSON shape.
//!
//! Each variant is a status of the contract (`shared/http-api.md`, "Errors"). Internal causes
//! are logged here, once, and never sent to the client: an `Internal` or `Unavailable` body
//! carries only a fixed, safe message.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// Seconds a client should wait before retrying a 409 ABORTED, a 429 or a 503.
pub const RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Clone, Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Aborted(String),
    /// A conditional request's precondition failed (`If-Match` names another version): HTTP
    /// 412 with status FAILED_PRECONDITION (the contract's word for "the system is not in the
    /// state the operation needs"; its table gives that status 400 for the other cases).
    #[error("{0}")]
    PreconditionFailed(String),
    #[error("{0}")]
    ResourceExhausted(String),
    /// The message is safe for clients; the cause is logged.
    #[error("{message}")]
    Internal { message: String, cause: String },
    /// The message is safe for clients; the cause is logged.
    #[error("{message}")]
    Unavailable { message: String, cause: String },
    /// A route exists but not with this method (HTTP 405, which the contract's table does
    /// not name: `UNIMPLEMENTED` is the google.rpc code for an unsupported operation).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// Another error with a more specific `reason` than its status's default
    /// ([`ApiError::reason`] makes one).
    #[error("{1}")]
    WithReason(&'static str, Box<ApiError>),
}

tokio::task_local! {
    /// The request's correlation id (`x-request-id`), set around every request by the
    /// router's middleware so an error body can carry it.
    pub static REQUEST_ID: String;
}

impl ApiError {
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        ApiError::Internal { message: "internal error".into(), cause: cause.to_string() }
    }

    pub fn unavailable(message: impl Into<String>, cause: impl std::fmt::Display) -> Self {
        ApiError::Unavailable { message: message.into(), cause: cause.to_string() }
    }

    /// The same error with a specific stable `reason` word (`POOL_EXHAUSTED`, `VM_GONE`, …).
    pub fn reason(self, reason: &'static str) -> Self {
        ApiError::WithReason(reason, Box::new(self.into_base()))
    }

    fn into_base(self) -> ApiError {
        match self {
            ApiError::WithReason(_, inner) => inner.into_base(),
            e => e,
        }
    }

    /// The error without its specific reason.
    pub fn base(&self) -> &ApiError {
        match self {
            ApiError::WithReason(_, inner) => inner.base(),
            e => e,
        }
    }

    /// The body's `reason`: the specific one if set, else the status's default word.
    pub fn reason_word(&self) -> &'static str {
        match self {
            ApiError::WithReason(r, _) => r,
            ApiError::ResourceExhausted(_) => "POOL_EXHAUSTED",
            ApiError::Unauthenticated(_) => "TOKEN_MISSING_OR_UNKNOWN",
            ApiError::PermissionDenied(_) => "ROLE_NOT_ALLOWED",
            ApiError::MethodNotAllowed(_) => "METHOD_NOT_ALLOWED",
            ApiError::PreconditionFailed(_) => "ETAG_MISMATCH",
            e => e.status().1,
        }
    }

    pub fn status(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::WithReason(_, inner) => inner.status(),
            ApiError::InvalidArgument(_) => (StatusCode::BAD_REQUEST, "INVALID_ARGUMENT"),
            ApiError::FailedPrecondition(_) => (StatusCode::BAD_REQUEST, "FAILED_PRECONDITION"),
            ApiError::Unauthenticated(_) => (StatusCode::UNAUTHORIZED, "UNAUTHENTICATED"),
            ApiError::PermissionDenied(_) => (StatusCode::FORBIDDEN, "PERMISSION_DENIED"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "NOT_FOUND"),
            ApiError::AlreadyExists(_) => (StatusCode::CONFLICT, "ALREADY_EXISTS"),
            ApiError::Aborted(_) => (StatusCode::CONFLICT, "ABORTED"),
            ApiError::PreconditionFailed(_) => (StatusCode::PRECONDITION_FAILED, "FAILED_PRECONDITION"),
            ApiError::ResourceExhausted(_) => (StatusCode::TOO_MANY_REQUESTS, "RESOURCE_EXHAUSTED"),
            ApiError::Internal { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL"),
            ApiError::Unavailable { .. } => (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE"),
            ApiError::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "UNIMPLEMENTED"),
        }
    }
}

/// The contract's error body (`Error` in the OpenAPI document).
#[derive(Serialize, ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    /// The HTTP status.
    code: u16,
    #[schema(value_type = ErrorStatus)]
    status: &'static str,
    /// A stable machine-readable word: `POOL_EXHAUSTED`, `QUOTA_EXCEEDED`, `HOOK_FAILED`,
    /// `VM_GONE`, `LEASE_ENDING`, …; otherwise the status itself.
    #[schema(example = "POOL_EXHAUSTED")]
    reason: &'static str,
    message: String,
    /// The correlation id the server also sends as `x-request-id`.
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
}

/// The `status` of an error (schema only: [`ApiError::status`] produces them).
#[derive(ToSchema)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types, dead_code)]
pub enum ErrorStatus {
    INVALID_ARGUMENT,
    FAILED_PRECONDITION,
    UNAUTHENTICATED,
    PERMISSION_DENIED,
    NOT_FOUND,
    ALREADY_EXISTS,
    ABORTED,
    RESOURCE_EXHAUSTED,
    INTERNAL,
    UNAVAILABLE,
    UNIMPLEMENTED,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (code, status) = self.status();
        let reason = self.reason_word();
        match self.base() {
            ApiError::Internal { cause, .. } => tracing::error!(%cause, reason, "internal error"),
            ApiError::Unavailable { cause, .. } => tracing::warn!(%cause, reason, "dependency unavailable"),
            _ => tracing::info!(status, reason, message = %self, "request refused"),
        }
        let request_id = REQUEST_ID.try_with(Clone::clone).ok();
        let body = ErrorBody {
            error: ErrorDetail { code: code.as_u16(), status, reason, message: self.to_string(), request_id },
        };
        let mut resp = (code, axum::Json(body)).into_response();
        // ABORTED means "retrying is correct" (the contract): it says when, too.
        if matches!(self.base(), ApiError::Aborted(_) | ApiError::ResourceExhausted(_) | ApiError::Unavailable { .. }) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        resp
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError as S;
        match e {
            S::Unavailable(cause) => {
                ApiError::unavailable("database unavailable, retry", cause).reason("DATABASE_UNAVAILABLE")
            }
            // A deadlock, serialization failure, cancelled statement or lock timeout: nothing
            // was changed, and the same request may well succeed in a moment.
            e @ S::Busy { .. } => ApiError::unavailable("database busy, retry", e).reason("DATABASE_BUSY"),
            e @ (S::UniqueViolation { .. } | S::Db(_)) => ApiError::internal(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_is_in_the_error_status_schema() {
        use utoipa::PartialSchema;
        let schema = serde_json::to_value(ErrorStatus::schema()).unwrap();
        let listed: Vec<&str> = schema["enum"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let all = [
            ApiError::InvalidArgument(String::new()),
            ApiError::FailedPrecondition(String::new()),
            ApiError::Unauthenticated(String::new()),
            ApiError::PermissionDenied(String::new()),
            ApiError::NotFound(String::new()),
            ApiError::AlreadyExists(String::new()),
            ApiError::Aborted(String::new()),
            ApiError::PreconditionFailed(String::new()),
            ApiError::ResourceExhausted(String::new()),
            ApiError::internal(""),
            ApiError::unavailable("", ""),
            ApiError::MethodNotAllowed(String::new()),
        ];
        // FAILED_PRECONDITION twice: 400 and, for a failed If-Match, 412.
        assert_eq!(listed.len() + 1, all.len(), "{schema}");
        for e in all {
            assert!(listed.contains(&e.status().1), "{} missing from {schema}", e.status().1);
        }
    }
}
