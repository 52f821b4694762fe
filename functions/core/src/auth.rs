//! Bearer-token authentication: which principal is calling, and in which role.
//!
//! Tokens come from configuration, refused at start when weak or ambiguous
//! ([`TokenEntry::parse`], [`check_distinct`]). A presented token is hashed and compared with
//! every configured token's hash in constant time, so neither the comparison nor the loop
//! leaks which prefix matched. The principal name scopes `request_id`s and owns leases; it is
//! never the token.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Everything.
    Admin,
    /// Every GET an admin may make, `/metrics` and `/v1/events`; no write. For dashboards,
    /// scrapers and event consumers, whose stolen token must not be fleet root.
    Viewer,
    /// Claims, leases and demand hints only.
    Client,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Viewer => "viewer",
            Role::Client => "client",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
}

impl Principal {
    /// A change to pools, hosts or VMs: admins only.
    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self.role {
            Role::Admin => Ok(()),
            Role::Viewer => Err(ApiError::PermissionDenied(format!(
                "principal {} has role viewer, which may only read; this change needs an admin token",
                self.name
            ))),
            Role::Client => Err(ApiError::PermissionDenied(format!(
                "principal {} has role client; this route needs an admin token",
                self.name
            ))),
        }
    }

    /// A read of the fleet (pools, hosts, VMs, events, metrics): admins and viewers.
    pub fn require_reader(&self) -> Result<(), ApiError> {
        match self.role {
            Role::Admin | Role::Viewer => Ok(()),
            Role::Client => Err(ApiError::PermissionDenied(format!(
                "principal {} has role client; this route needs an admin or viewer token",
                self.name
            ))),
        }
    }

    /// A claim, heartbeat, release or demand hint: clients and admins, not viewers.
    pub fn require_consumer(&self) -> Result<(), ApiError> {
        match self.role {
            Role::Admin | Role::Client => Ok(()),
            Role::Viewer => Err(ApiError::PermissionDenied(format!(
                "principal {} has role viewer, which may only read; claims, heartbeats, releases and demand \
                 hints need a client token",
                self.name
            ))),
        }
    }

    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }

    /// Whose leases this caller reaches: `None` for an admin or a viewer (every lease; a
    /// viewer only reads them), else only the leases its own principal claimed. A lease id is
    /// not a capability on its own (it appears in request and access logs): lease routes
    /// filter by this in the same statement.
    pub fn lease_owner(&self) -> Option<&str> {
        (self.role == Role::Client).then_some(self.name.as_str())
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

/// The shortest token accepted at start: shorter ones can be guessed or typed by hand.
pub const MIN_TOKEN_LEN: usize = 16;
/// The longest principal name (it is stored with every lease and logged with every request).
pub const MAX_NAME_LEN: usize = 64;

/// How to write an entry, for every refusal of one.
const ENTRY_FORM: &str = "write `token` or `name:token`, with exactly one `:` between a name of letters, digits, \
     `.`, `_` and `-` (starting with a letter or digit, at most 64) and a token of visible ASCII characters \
     other than `:` and `,`";

/// A principal name: letters, digits, `.`, `_`, `-`, starting with a letter or digit, at most
/// [`MAX_NAME_LEN`].
pub fn valid_name(name: &str) -> bool {
    name.len() <= MAX_NAME_LEN
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl TokenEntry {
    /// `token`, or `name:token` to give the principal a readable name. Without a name the
    /// principal is `<role>-<first 12 hex digits of the token's SHA-256>`.
    ///
    /// Refuses, saying how to write it and never echoing the token (the error is logged): an
    /// entry whose split is not obvious (an empty side, a second `:`), a name that is not a
    /// plain identifier, a token with whitespace, control or non-ASCII characters (no
    /// `Authorization` header could carry it), and a token shorter than [`MIN_TOKEN_LEN`].
    pub fn parse(entry: &str, role: Role) -> Result<TokenEntry, String> {
        let (name, token) = match entry.split_once(':') {
            None => (None, entry),
            Some((n, t)) if !n.is_empty() && !t.is_empty() && !t.contains(':') => (Some(n), t),
            Some(_) => return Err(format!("is ambiguous: {ENTRY_FORM}")),
        };
        if name.is_some_and(|n| !valid_name(n)) {
            return Err(format!("has a name that is not allowed: {ENTRY_FORM}"));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "has a token with whitespace, a control or a non-ASCII character, which no Authorization header \
                 can carry: {ENTRY_FORM}"
            ));
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "has a token shorter than {MIN_TOKEN_LEN} characters: tokens must be at least {MIN_TOKEN_LEN} characters \
                 long; generate one with `openssl rand -hex 32`"
            ));
        }
        let d = digest(token);
        let name = name.map(str::to_owned).unwrap_or_else(|| {
            let hex: String = d.iter().take(6).map(|b| format!("{b:02x}")).collect();
            format!("{}-{hex}", role.as_str())
        });
        Ok(TokenEntry { digest: d, principal: Principal { name, role } })
    }

    pub fn principal(&self) -> &Principal {
        &self.principal
    }
}

/// Refuses configured tokens that would make two callers one principal or one caller two:
/// two entries with one principal name would share its `request_id`s and its leases, and one
/// token in two entries would resolve to whichever comes first. `entries` are the parsed
/// tokens with where each was configured (`POOLMGR_CLIENT_TOKENS entry 2`); the error names
/// those places and the principal, never a token.
pub fn check_distinct(entries: &[(String, TokenEntry)]) -> Result<(), String> {
    for (i, (at, entry)) in entries.iter().enumerate() {
        for (first_at, first) in &entries[..i] {
            if first.digest == entry.digest {
                return Err(format!(
                    "{at} is the same token as {first_at}: give each principal its own token (a token stands \
                     for one principal in one role)"
                ));
            }
            if first.principal.name == entry.principal.name {
                return Err(format!(
                    "{at} names principal {:?}, as {first_at} does: give each token its own name (the tokens of \
                     one name would share its request_ids and its leases)",
                    entry.principal.name
                ));
            }
        }
    }
    Ok(())
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
            tokens: vec![
                TokenEntry::parse("ops:s3cret-s3cret-s3cret", Role::Admin).unwrap(),
                TokenEntry::parse("tok-c-0123456789abcdef", Role::Client).unwrap(),
            ],
        }
    }

    #[test]
    fn resolves_principals() {
        let c = cfg();
        let p = c.authenticate(Some("Bearer s3cret-s3cret-s3cret")).unwrap();
        assert_eq!(p, Principal { name: "ops".into(), role: Role::Admin });
        let p = c.authenticate(Some("bearer tok-c-0123456789abcdef")).unwrap();
        assert_eq!(p.role, Role::Client);
        assert!(p.name.starts_with("client-") && !p.name.contains("tok-c"));
        assert_eq!(c.tokens[1].principal(), &p);
    }

    #[test]
    fn rejects_bad_headers() {
        let c = cfg();
        for h in [
            None,
            Some("Bearer"),
            Some("Basic s3cret-s3cret-s3cret"),
            Some("Bearer s3cret"),
            Some("s3cret-s3cret-s3cret"),
        ] {
            assert!(matches!(c.authenticate(h), Err(ApiError::Unauthenticated(_))), "{h:?}");
        }
    }
}
