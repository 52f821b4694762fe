//! One error type for everything the CLI reports: printed as `status: message` on standard
//! error, with an exit code per class.

use std::fmt;
use std::time::Duration;

/// An error: the contract's status in snake_case (`not_found`, `aborted`, …) and a message.
#[derive(Debug, Clone)]
pub struct CliError {
    pub status: String,
    pub message: String,
    /// The server's `Retry-After`, when it sent one.
    pub retry_after: Option<Duration>,
}

pub const EXIT_OTHER: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_NOT_FOUND: u8 = 3;
pub const EXIT_CONFLICT: u8 = 4;
pub const EXIT_EXHAUSTED: u8 = 5;
pub const EXIT_UNAVAILABLE: u8 = 6;

impl CliError {
    pub fn new(status: &str, message: impl Into<String>) -> CliError {
        CliError { status: status.to_owned(), message: message.into(), retry_after: None }
    }

    /// A bad invocation or input caught before anything was sent.
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError::new("invalid_argument", message)
    }

    pub fn unavailable(message: impl Into<String>) -> CliError {
        CliError::new("unavailable", message)
    }

    pub fn exit_code(&self) -> u8 {
        match self.status.as_str() {
            // INVALID_ARGUMENT from the server is the same class as a local usage error: the
            // invocation is wrong and a retry cannot help.
            "invalid_argument" => EXIT_USAGE,
            "not_found" => EXIT_NOT_FOUND,
            "already_exists" | "aborted" | "failed_precondition" => EXIT_CONFLICT,
            "resource_exhausted" => EXIT_EXHAUSTED,
            "unavailable" => EXIT_UNAVAILABLE,
            _ => EXIT_OTHER,
        }
    }

    /// Worth retrying with the same request id.
    pub fn is_transient(&self) -> bool {
        matches!(self.status.as_str(), "unavailable" | "aborted")
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for CliError {}

/// `RESOURCE_EXHAUSTED` → `resource_exhausted`.
pub fn snake(status: &str) -> String {
    status.trim().to_ascii_lowercase()
}

/// The status for an HTTP answer without the contract's error body (a proxy's page, say).
pub fn status_for_http(code: u16) -> &'static str {
    match code {
        400 => "invalid_argument",
        401 => "unauthenticated",
        403 => "permission_denied",
        404 => "not_found",
        409 => "aborted",
        429 => "resource_exhausted",
        500 => "internal",
        502..=504 => "unavailable",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_per_class() {
        for (s, code) in [
            ("invalid_argument", 2),
            ("not_found", 3),
            ("already_exists", 4),
            ("aborted", 4),
            ("failed_precondition", 4),
            ("resource_exhausted", 5),
            ("unavailable", 6),
            ("internal", 1),
            ("unauthenticated", 1),
            ("permission_denied", 1),
            ("unknown", 1),
        ] {
            assert_eq!(CliError::new(s, "m").exit_code(), code, "{s}");
        }
        assert_eq!(snake("RESOURCE_EXHAUSTED"), "resource_exhausted");
        assert_eq!(
            CliError::new("aborted", "lease x is being released, retry").to_string(),
            "aborted: lease x is being released, retry"
        );
    }
}
