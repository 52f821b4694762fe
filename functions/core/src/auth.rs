//! Bearer-token authentication: which principal is calling, and in which role.
//!
//! Tokens come from configuration. A presented token is hashed and compared with every
//! configured token's hash in constant time, so neither the comparison nor the loop leaks
//! which prefix matched. The principal name scopes `request_id`s; it is never the token.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Client,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
}

impl Principal {
    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self.role {
            Role::Admin => Ok(()),
            Role::Client => Err(ApiError::PermissionDenied(format!(
                "principal {} has role client; this route needs an admin token",
                self.name
            ))),
        }
    }

    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }

    /// Whose leases this caller reaches: `None` for an admin (every lease), else only the
    /// leases its own principal claimed. A lease id is not a capability on its own (it appears
    /// in request and access logs): lease routes filter by this in the same statement.
    pub fn lease_owner(&self) -> Option<&str> {
        (!self.is_admin()).then_some(self.name.as_str())
    }
}

#[derive(Clone)]
pub struct TokenEntry {
    digest: [u8; 32],
    principal: Principal,
}

impl std::fmt::Debug for TokenEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEntry").field("principal", &self.principal).finish_non_exhaustive()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl TokenEntry {
    /// `token`, or `name:token` to give the principal a readable name. Without a name the
    /// principal is `<role>-<first 12 hex digits of the token's SHA-256>`.
    pub fn parse(entry: &str, role: Role) -> TokenEntry {
        let (name, token) = match entry.split_once(':') {
            Some((n, t)) if !n.is_empty() && !t.is_empty() => (Some(n.to_owned()), t),
            _ => (None, entry),
        };
        let d = digest(token);
        let name = name.unwrap_or_else(|| {
            let hex: String = d.iter().take(6).map(|b| format!("{b:02x}")).collect();
            let prefix = if role == Role::Admin { "admin" } else { "client" };
            format!("{prefix}-{hex}")
        });
        TokenEntry { digest: d, principal: Principal { name, role } }
    }
}

#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    pub disabled: bool,
    pub tokens: Vec<TokenEntry>,
}

impl AuthConfig {
    /// Resolves an `Authorization` header value to a principal.
    pub fn authenticate(&self, header: Option<&str>) -> Result<Principal, ApiError> {
        if self.disabled {
            return Ok(Principal { name: "anonymous".into(), role: Role::Admin });
        }
        let header = header.ok_or_else(|| {
            ApiError::Unauthenticated("missing Authorization header: send `Authorization: Bearer <token>`".into())
        })?;
        let token = match header.split_once(' ') {
            Some((scheme, t)) if scheme.eq_ignore_ascii_case("bearer") && !t.trim().is_empty() => t.trim(),
            _ => {
                return Err(ApiError::Unauthenticated(
                    "malformed Authorization header: expected `Bearer <token>`".into(),
                ));
            }
        };
        let presented = digest(token);
        let mut found: Option<&Principal> = None;
        for entry in &self.tokens {
            // No early exit: every entry is compared whatever matched before.
            if bool::from(entry.digest.ct_eq(&presented)) && found.is_none() {
                found = Some(&entry.principal);
            }
        }
        found.cloned().ok_or_else(|| ApiError::Unauthenticated("invalid token".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AuthConfig {
        AuthConfig {
            disabled: false,
            tokens: vec![TokenEntry::parse("ops:s3cret", Role::Admin), TokenEntry::parse("tok-c", Role::Client)],
        }
    }

    #[test]
    fn resolves_principals() {
        let c = cfg();
        let p = c.authenticate(Some("Bearer s3cret")).unwrap();
        assert_eq!(p, Principal { name: "ops".into(), role: Role::Admin });
        let p = c.authenticate(Some("bearer tok-c")).unwrap();
        assert_eq!(p.role, Role::Client);
        assert!(p.name.starts_with("client-") && !p.name.contains("tok-c"));
    }

    #[test]
    fn rejects_bad_headers() {
        let c = cfg();
        for h in [None, Some("Bearer"), Some("Basic s3cret"), Some("Bearer nope"), Some("s3cret")] {
            assert!(matches!(c.authenticate(h), Err(ApiError::Unauthenticated(_))), "{h:?}");
        }
    }
}
