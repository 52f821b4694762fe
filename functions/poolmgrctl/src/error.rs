//! One error type for everything the CLI reports: printed as `status: message` on standard
//! error, with an exit code per class.

use std::fmt;

use poolmgr_client::Error;

use crate::output::printable;

/// An error: the contract's status in snake_case (`not_found`, `aborted`, …) and a message.
#[derive(Debug, Clone)]
pub struct CliError {
    pub status: String,
    pub message: String,
    /// An exit code other than the status's class ([`CliError::exit_with`], [`CliError::silent`]).
    exit: Option<u8>,
    /// Printed on standard output before the error is printed on standard error: what must
    /// not be lost ([`CliError::with_output`]).
    pub output: Option<String>,
}

pub const EXIT_OTHER: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_NOT_FOUND: u8 = 3;
pub const EXIT_CONFLICT: u8 = 4;
pub const EXIT_EXHAUSTED: u8 = 5;
pub const EXIT_UNAVAILABLE: u8 = 6;
/// `lease run`: the lease was lost while the command ran (it expired or was released
/// elsewhere); the command was sent SIGTERM.
pub const EXIT_LEASE_LOST: u8 = 7;
/// `pool diff`: an error of class 1 (1 means "differences" there, as for kubectl diff).
pub const EXIT_DIFF_FAILED: u8 = 8;
/// `pool wait`: the condition was not met within --timeout.
pub const EXIT_WAIT_TIMED_OUT: u8 = 9;
/// `--jq`: the request succeeded, but the filter failed on its answer (a jq error, a result
/// that is not JSON, too many results); the answer is printed on standard output as `-o json`
/// prints it instead. Not a failure of the request: a claimed lease stays claimed.
pub const EXIT_FILTER_FAILED: u8 = 10;
/// `pool diff`: the files differ from the pools.
pub const EXIT_DIFFERENCES: u8 = 1;

impl CliError {
    pub fn new(status: &str, message: impl Into<String>) -> CliError {
        CliError { status: status.to_owned(), message: message.into(), exit: None, output: None }
    }

    /// Exit with `code` and print nothing more: what had to be said is on standard error
    /// (`lease run` passes its command's code through this way).
    pub fn silent(code: u8) -> CliError {
        CliError { status: String::new(), message: String::new(), exit: Some(code), output: None }
    }

    /// `pool diff` found differences: exit 1, nothing printed.
    pub fn differences() -> CliError {
        CliError::silent(EXIT_DIFFERENCES)
    }

    /// Not an error to print: only an exit code ([`CliError::silent`]).
    pub fn is_silent(&self) -> bool {
        self.status.is_empty() && self.message.is_empty()
    }

    /// The same error with another exit code.
    pub fn exit_with(mut self, code: u8) -> CliError {
        self.exit = Some(code);
        self
    }

    /// The same error with `text` to print on standard output first (after what it had).
    pub fn with_output(mut self, text: String) -> CliError {
        self.output = Some(self.output.take().unwrap_or_default() + &text);
        self
    }

    /// The same error with `text` printed on standard output before what it had.
    pub fn after_output(mut self, text: String) -> CliError {
        if !text.is_empty() {
            self.output = Some(text + self.output.as_deref().unwrap_or_default());
        }
        self
    }

    /// A bad invocation or input caught before anything was sent.
    pub fn usage(message: impl fmt::Display) -> CliError {
        CliError::new("invalid_argument", message.to_string())
    }

    pub fn unavailable(message: impl Into<String>) -> CliError {
        CliError::new("unavailable", message)
    }

    pub fn exit_code(&self) -> u8 {
        if let Some(code) = self.exit {
            return code;
        }
        match self.status.as_str() {
            // INVALID_ARGUMENT from the server is the same class as a local usage error: the
            // invocation is wrong and a retry cannot help.
            "invalid_argument" => EXIT_USAGE,
            "not_found" => EXIT_NOT_FOUND,
            "already_exists" | "aborted" | "failed_precondition" => EXIT_CONFLICT,
            "resource_exhausted" => EXIT_EXHAUSTED,
            "unavailable" => EXIT_UNAVAILABLE,
            "deadline_exceeded" => EXIT_WAIT_TIMED_OUT,
            _ => EXIT_OTHER,
        }
    }
}

/// The client's errors in the CLI's classes: no answer is `unavailable`, input refused before
/// sending is `invalid_argument`.
impl From<Error> for CliError {
    fn from(e: Error) -> CliError {
        match e {
            Error::Api(a) => CliError::new(&snake(a.status.as_str()), a.message),
            Error::Transport { message, .. } => CliError::unavailable(message),
            Error::InvalidInput(m) => CliError::usage(m),
            Error::Decode(m) => CliError::new("unknown", m),
            e @ Error::LeaseExpired { .. } => CliError::new("deadline_exceeded", e.to_string()),
            other => CliError::new("unknown", other.to_string()),
        }
    }
}

/// `status: message`, the message [`printable`]: it may quote what a client or admin chose
/// (a `request_id`, a reason) or what a server sent.
impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", printable(&self.status), printable(&self.message))
    }
}

impl std::error::Error for CliError {}

/// `RESOURCE_EXHAUSTED` → `resource_exhausted`.
pub fn snake(status: &str) -> String {
    status.trim().to_ascii_lowercase()
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
            ("deadline_exceeded", 9),
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
        assert_eq!(CliError::new("aborted", "request_id \"\x1b[2J\"").to_string(), "aborted: request_id \"\\x1b[2J\"");
    }
}
