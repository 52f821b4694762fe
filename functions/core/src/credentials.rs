//! Host credentials at rest (issue 25 item 4): envelope encryption of the secrets a host row
//! carries (`key_pem`, the mTLS client key, and `basic_auth_token`), so that a dump, a replica
//! or a restored snapshot of the database reveals neither.
//!
//! - A **key-encryption key** (KEK) comes from the deployment, never from the database:
//!   `POOLMGR_CREDENTIALS_KEY` (at least 32 random characters), or the `credentials_key` of
//!   the secret `POOLMGR_CREDENTIALS_SECRET_ARN` names (the AWS template generates one).
//!   The AES-256 key is derived from it with HKDF-SHA256; its id is a fingerprint from the
//!   same derivation (16 hex characters, which tell nothing of the key).
//! - Each host gets a random **data key** (DEK). The DEK encrypts the host's secrets
//!   (AES-256-GCM, a random nonce each, the host's name and the column as associated data, so
//!   a ciphertext copied to another host or column does not open) and the KEK wraps the DEK
//!   (associated data: the host and the KEK's id). The row stores the ciphertexts in the
//!   secrets' own columns, the wrapped DEK in `credentials_dek` and the KEK's id in
//!   `credentials_key_id` (V24). `ca_pem` and `cert_pem` are public certificates and stay
//!   as they are.
//! - **Rotation**, in two deploys: the new key first joins `POOLMGR_CREDENTIALS_OLD_KEYS`
//!   (comma-separated; decrypt only) everywhere, then becomes `POOLMGR_CREDENTIALS_KEY` with
//!   the old one among the old keys. Each reconcile pass re-wraps the DEK of every row under an
//!   old key ([`Keyring::reseal`]; the ciphertexts stay) and seals rows stored before this
//!   existed (`credentials_key_id` NULL). When no row names the old key, drop it.
//! - Without a key, a host with secrets is refused (400: set the key); rows stored in
//!   plaintext before the upgrade keep working, and are encrypted once a key is set.
//!
//! Plaintext exists only in memory: in the host write that seals it and in the flintlock
//! client's channel build that opens it ([`crate::flintlock::Flintlock::with_keyring`]).
//! Nothing here logs, or puts in an error, a key or a secret.

use std::fmt;
use std::sync::Arc;

use base64::Engine;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};

/// The current key: encrypts, and decrypts.
pub const KEY_VAR: &str = "POOLMGR_CREDENTIALS_KEY";
/// Earlier keys, comma-separated: decrypt only, until the passes have re-wrapped every row.
pub const OLD_KEYS_VAR: &str = "POOLMGR_CREDENTIALS_OLD_KEYS";
/// The shortest key accepted: 32 characters of `openssl rand -base64 32` carry 192 bits.
pub const MIN_KEY_CHARS: usize = 32;

/// HKDF salt: ties the derived keys to this use, whatever else the secret is used for.
const SALT: &[u8] = b"poolmgr host credentials v1";
const DEK_LEN: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CredentialsError {
    #[error(
        "host {host}: this deployment has no credentials key, so its secrets (key_pem, basic_auth_token) cannot be \
         stored encrypted: set {KEY_VAR} (at least {MIN_KEY_CHARS} random characters, e.g. `openssl rand -base64 32`) \
         on every function, or register the host without secrets"
    )]
    NoKey { host: String },
    #[error(
        "host {host}: its credentials are encrypted under key {id}, which this function does not hold: set that key \
         in {KEY_VAR} or {OLD_KEYS_VAR} (the passes re-wrap the row under the current key), or register the host's \
         secrets again"
    )]
    UnknownKey { host: String, id: String },
    #[error(
        "host {host}: its stored {field} does not decrypt (altered, or copied from another host): register the \
         host's secrets again"
    )]
    Corrupt { host: String, field: &'static str },
}

/// One key-encryption key.
struct Kek {
    id: String,
    key: LessSafeKey,
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

impl Kek {
    fn derive(secret: &str) -> Kek {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(secret.as_bytes());
        let mut key = [0u8; 32];
        prk.expand(&[b"aes-256-gcm key"], Len(32))
            .and_then(|okm| okm.fill(&mut key))
            .expect("HKDF-SHA256 gives 32 bytes");
        let mut id = [0u8; 8];
        prk.expand(&[b"key id"], Len(8)).and_then(|okm| okm.fill(&mut id)).expect("HKDF-SHA256 gives 8 bytes");
        Kek {
            id: id.iter().map(|b| format!("{b:02x}")).collect(),
            key: LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).expect("a 32-byte AES-256 key")),
        }
    }
}

/// The keys a function holds: the current one (if any) and the old ones. Its `Debug` shows
/// their ids only.
#[derive(Clone)]
pub struct Keyring {
    current: Option<Arc<Kek>>,
    old: Vec<Arc<Kek>>,
    rng: SystemRandom,
}

impl Default for Keyring {
    fn default() -> Keyring {
        Keyring::new(None, &[])
    }
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current.as_ref().map(|k| k.id.as_str()))
            .field("old", &self.old.iter().map(|k| k.id.as_str()).collect::<Vec<_>>())
            .finish()
    }
}

/// A host's secrets in plaintext. Its `Debug` says only which are present.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets {
    pub key_pem: Option<String>,
    pub basic_auth_token: Option<String>,
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = |v: &Option<String>| v.as_ref().map(|_| "<redacted>");
        f.debug_struct("Secrets")
            .field("key_pem", &shown(&self.key_pem))
            .field("basic_auth_token", &shown(&self.basic_auth_token))
            .finish()
    }
}

/// A host's secrets as its row stores them: ciphertexts with the wrapped data key and the
/// KEK's id, or (`key_id` None) plaintext from before encryption, or nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Stored {
    pub key_pem: Option<String>,
    pub basic_auth_token: Option<String>,
    pub key_id: Option<String>,
    pub dek: Option<String>,
}

impl Stored {
    fn has_secrets(&self) -> bool {
        self.key_pem.is_some() || self.basic_auth_token.is_some()
    }
}

fn check_key(var: &str, n: usize, secret: &str) -> Result<(), String> {
    let chars = secret.chars().count();
    if chars < MIN_KEY_CHARS {
        return Err(format!(
            "{var} entry {n} has {chars} characters; a credentials key needs at least {MIN_KEY_CHARS} random ones \
             (e.g. `openssl rand -base64 32`)"
        ));
    }
    if secret.chars().any(|c| c.is_control() || c == ',') {
        // A comma would split the key once it moves to the comma-separated old keys.
        return Err(format!("{var} entry {n} contains a comma or control characters"));
    }
    Ok(())
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

impl Keyring {
    /// `POOLMGR_CREDENTIALS_KEY` and `POOLMGR_CREDENTIALS_OLD_KEYS`; none set: an empty
    /// keyring (hosts with secrets are refused). The error names the variable, never a key.
    pub fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<Keyring, String> {
        let current = lookup(KEY_VAR).map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
        let old = lookup(OLD_KEYS_VAR).unwrap_or_default();
        let old: Vec<&str> = old.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        if current.is_none() && !old.is_empty() {
            return Err(format!(
                "{OLD_KEYS_VAR} is set but {KEY_VAR} is not: old keys only decrypt; set the current key too"
            ));
        }
        if let Some(c) = &current {
            check_key(KEY_VAR, 1, c)?;
        }
        for (i, k) in old.iter().enumerate() {
            check_key(OLD_KEYS_VAR, i + 1, k)?;
        }
        Ok(Keyring::new(current.as_deref(), &old))
    }

    /// A keyring of `current` (encrypts) and `old` (decrypt only); keys are not checked.
    pub fn new(current: Option<&str>, old: &[&str]) -> Keyring {
        let current = current.map(|c| Arc::new(Kek::derive(c)));
        let mut kept: Vec<Arc<Kek>> = vec![];
        for k in old.iter().map(|k| Kek::derive(k)) {
            let repeated = current.iter().chain(&kept).any(|c| c.id == k.id);
            if !repeated {
                kept.push(Arc::new(k));
            }
        }
        Keyring { current, old: kept, rng: SystemRandom::new() }
    }

    /// The current key's id, if there is a current key.
    pub fn current_id(&self) -> Option<&str> {
        self.current.as_deref().map(|k| k.id.as_str())
    }

    fn find(&self, id: &str) -> Option<&Kek> {
        self.current.iter().chain(&self.old).map(Arc::as_ref).find(|k| k.id == id)
    }

    fn seal_with(&self, key: &LessSafeKey, aad: &[u8], plain: &[u8]) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).expect("the system's random source");
        let mut buf = plain.to_vec();
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), &mut buf)
            .expect("AES-GCM seals any input under 64 GiB");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&buf);
        b64().encode(out)
    }

    fn open_with(key: &LessSafeKey, aad: &[u8], sealed: &str) -> Option<Vec<u8>> {
        let raw = b64().decode(sealed).ok()?;
        if raw.len() < NONCE_LEN {
            return None;
        }
        let (nonce, ct) = raw.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = ct.to_vec();
        let plain = key.open_in_place(nonce, Aad::from(aad), &mut buf).ok()?;
        Some(plain.to_vec())
    }

    fn dek_aad(host: &str, kek_id: &str) -> Vec<u8> {
        format!("poolmgr hosts.credentials_dek\0{host}\0{kek_id}").into_bytes()
    }

    fn field_aad(host: &str, field: &str) -> Vec<u8> {
        format!("poolmgr hosts.{field}\0{host}").into_bytes()
    }

    fn dek_key(dek: &[u8]) -> Option<LessSafeKey> {
        UnboundKey::new(&AES_256_GCM, dek).ok().map(LessSafeKey::new)
    }

    /// `secrets` of host `host` as its row stores them: under a fresh data key wrapped by the
    /// current key. No secrets: nothing stored (no key needed). Secrets without a current key:
    /// [`CredentialsError::NoKey`].
    pub fn seal(&self, host: &str, secrets: &Secrets) -> Result<Stored, CredentialsError> {
        if secrets.key_pem.is_none() && secrets.basic_auth_token.is_none() {
            return Ok(Stored::default());
        }
        let kek = self.current.as_deref().ok_or_else(|| CredentialsError::NoKey { host: host.to_owned() })?;
        let mut dek = [0u8; DEK_LEN];
        self.rng.fill(&mut dek).expect("the system's random source");
        let key = Self::dek_key(&dek).expect("a 32-byte data key");
        let field = |name: &str, v: &Option<String>| {
            v.as_ref().map(|v| self.seal_with(&key, &Self::field_aad(host, name), v.as_bytes()))
        };
        Ok(Stored {
            key_pem: field("key_pem", &secrets.key_pem),
            basic_auth_token: field("basic_auth_token", &secrets.basic_auth_token),
            dek: Some(self.seal_with(&kek.key, &Self::dek_aad(host, &kek.id), &dek)),
            key_id: Some(kek.id.clone()),
        })
    }

    /// The data key of a sealed row, unwrapped.
    fn unwrap_dek(&self, host: &str, id: &str, dek: Option<&str>) -> Result<Vec<u8>, CredentialsError> {
        let kek =
            self.find(id).ok_or_else(|| CredentialsError::UnknownKey { host: host.to_owned(), id: id.to_owned() })?;
        let corrupt = || CredentialsError::Corrupt { host: host.to_owned(), field: "credentials_dek" };
        let dek = Self::open_with(&kek.key, &Self::dek_aad(host, id), dek.ok_or_else(corrupt)?).ok_or_else(corrupt)?;
        if dek.len() != DEK_LEN {
            return Err(corrupt());
        }
        Ok(dek)
    }

    /// The plaintext of a row's stored secrets (rows from before encryption pass through).
    pub fn open(&self, host: &str, stored: &Stored) -> Result<Secrets, CredentialsError> {
        let Some(id) = &stored.key_id else {
            return Ok(Secrets { key_pem: stored.key_pem.clone(), basic_auth_token: stored.basic_auth_token.clone() });
        };
        let dek = self.unwrap_dek(host, id, stored.dek.as_deref())?;
        let key =
            Self::dek_key(&dek).ok_or(CredentialsError::Corrupt { host: host.to_owned(), field: "credentials_dek" })?;
        let field = |name: &'static str, v: &Option<String>| -> Result<Option<String>, CredentialsError> {
            let Some(v) = v else { return Ok(None) };
            let corrupt = || CredentialsError::Corrupt { host: host.to_owned(), field: name };
            let plain = Self::open_with(&key, &Self::field_aad(host, name), v).ok_or_else(corrupt)?;
            String::from_utf8(plain).map(Some).map_err(|_| corrupt())
        };
        Ok(Secrets {
            key_pem: field("key_pem", &stored.key_pem)?,
            basic_auth_token: field("basic_auth_token", &stored.basic_auth_token)?,
        })
    }

    /// What a row should store instead, when it is not sealed under the current key: a row
    /// under an old key gets its data key re-wrapped (the ciphertexts stay); a plaintext row
    /// is sealed. `None`: nothing to do (no current key, already current, or no secrets).
    pub fn reseal(&self, host: &str, stored: &Stored) -> Result<Option<Stored>, CredentialsError> {
        let Some(kek) = self.current.as_deref() else { return Ok(None) };
        if !stored.has_secrets() || stored.key_id.as_deref() == Some(kek.id.as_str()) {
            return Ok(None);
        }
        let Some(id) = &stored.key_id else {
            let plain = Secrets { key_pem: stored.key_pem.clone(), basic_auth_token: stored.basic_auth_token.clone() };
            return self.seal(host, &plain).map(Some);
        };
        let dek = self.unwrap_dek(host, id, stored.dek.as_deref())?;
        Ok(Some(Stored {
            dek: Some(self.seal_with(&kek.key, &Self::dek_aad(host, &kek.id), &dek)),
            key_id: Some(kek.id.clone()),
            ..stored.clone()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "first-key-0123456789abcdefghijklmnop";
    const K2: &str = "second-key-0123456789abcdefghijklmno";

    fn secrets() -> Secrets {
        Secrets { key_pem: Some("-----BEGIN PRIVATE KEY-----\nxyz".into()), basic_auth_token: Some("tok3n".into()) }
    }

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn sealed_secrets_open_and_never_appear_in_what_is_stored() {
        let ring = Keyring::new(Some(K1), &[]);
        let stored = ring.seal("h1", &secrets()).unwrap();
        assert_eq!(stored.key_id.as_deref(), ring.current_id());
        for v in [&stored.key_pem, &stored.basic_auth_token, &stored.dek] {
            let v = v.as_deref().unwrap();
            assert!(!v.contains("PRIVATE") && !v.contains("tok3n"), "{v}");
        }
        assert_eq!(ring.open("h1", &stored).unwrap(), secrets());
        // Two seals of the same secrets differ (fresh data key, fresh nonces).
        assert_ne!(ring.seal("h1", &secrets()).unwrap().key_pem, stored.key_pem);
    }

    #[test]
    fn a_ciphertext_moved_to_another_host_or_column_or_altered_does_not_open() {
        let ring = Keyring::new(Some(K1), &[]);
        let stored = ring.seal("h1", &secrets()).unwrap();
        let err = ring.open("h2", &stored).unwrap_err();
        assert!(matches!(err, CredentialsError::Corrupt { field: "credentials_dek", .. }), "{err}");
        let swapped = Stored { key_pem: stored.basic_auth_token.clone(), ..stored.clone() };
        assert!(matches!(ring.open("h1", &swapped), Err(CredentialsError::Corrupt { field: "key_pem", .. })));
        let mut bytes = b64().decode(stored.basic_auth_token.as_deref().unwrap()).unwrap();
        bytes[NONCE_LEN] ^= 1;
        let altered = Stored { basic_auth_token: Some(b64().encode(bytes)), ..stored.clone() };
        assert!(matches!(ring.open("h1", &altered), Err(CredentialsError::Corrupt { field: "basic_auth_token", .. })));
        assert!(matches!(
            ring.open("h1", &Stored { dek: Some("not base64!".into()), ..stored }),
            Err(CredentialsError::Corrupt { .. })
        ));
    }

    #[test]
    fn another_key_cannot_open_and_says_which_key_it_needs() {
        let stored = Keyring::new(Some(K1), &[]).seal("h1", &secrets()).unwrap();
        let other = Keyring::new(Some(K2), &[]);
        let err = other.open("h1", &stored).unwrap_err();
        assert_eq!(err, CredentialsError::UnknownKey { host: "h1".into(), id: stored.key_id.clone().unwrap() });
        assert!(err.to_string().contains(OLD_KEYS_VAR), "{err}");
        assert!(!err.to_string().contains(K1) && !err.to_string().contains(K2));
    }

    #[test]
    fn rotation_rewraps_the_data_key_and_plaintext_rows_get_sealed() {
        let old = Keyring::new(Some(K1), &[]);
        let stored = old.seal("h1", &secrets()).unwrap();
        let rotated = Keyring::new(Some(K2), &[K1]);
        let resealed = rotated.reseal("h1", &stored).unwrap().expect("under an old key: re-wrapped");
        assert_eq!(resealed.key_id.as_deref(), rotated.current_id());
        assert_eq!((&resealed.key_pem, &resealed.basic_auth_token), (&stored.key_pem, &stored.basic_auth_token));
        assert_eq!(Keyring::new(Some(K2), &[]).open("h1", &resealed).unwrap(), secrets());
        assert_eq!(rotated.reseal("h1", &resealed).unwrap(), None, "already current");

        let plain = Stored { key_pem: None, basic_auth_token: Some("legacy".into()), key_id: None, dek: None };
        assert_eq!(rotated.open("h1", &plain).unwrap().basic_auth_token.as_deref(), Some("legacy"));
        let sealed = rotated.reseal("h1", &plain).unwrap().expect("plaintext: sealed");
        assert_ne!(sealed.basic_auth_token.as_deref(), Some("legacy"));
        assert_eq!(rotated.open("h1", &sealed).unwrap().basic_auth_token.as_deref(), Some("legacy"));
        assert_eq!(rotated.reseal("h1", &Stored::default()).unwrap(), None, "nothing to seal");
        assert_eq!(Keyring::default().reseal("h1", &plain).unwrap(), None, "no key: left as it is");
    }

    #[test]
    fn without_a_key_secrets_are_refused_and_a_host_without_secrets_is_not() {
        let ring = Keyring::default();
        assert_eq!(ring.seal("h1", &Secrets::default()).unwrap(), Stored::default());
        let err = ring.seal("h1", &secrets()).unwrap_err();
        assert!(err.to_string().contains(KEY_VAR), "{err}");
    }

    #[test]
    fn keys_from_the_environment_are_checked_and_never_shown() {
        let ring = Keyring::from_lookup(&lookup(&[(KEY_VAR, K2), (OLD_KEYS_VAR, &format!(" {K1} ,,{K2}"))])).unwrap();
        let shown = format!("{ring:?}");
        assert!(!shown.contains(K1) && !shown.contains(K2), "{shown}");
        assert_eq!(ring.old.len(), 1, "the current key repeated among the old ones counts once");
        let err = Keyring::from_lookup(&lookup(&[(KEY_VAR, "short")])).unwrap_err();
        assert!(err.contains(KEY_VAR) && err.contains("32") && !err.contains("short"), "{err}");
        let err = Keyring::from_lookup(&lookup(&[(KEY_VAR, &format!("{K1},x"))])).unwrap_err();
        assert!(err.contains("comma"), "{err}");
        assert!(!format!("{:?}", secrets()).contains("tok3n"), "Secrets' Debug shows no secret");
        let err = Keyring::from_lookup(&lookup(&[(OLD_KEYS_VAR, K1)])).unwrap_err();
        assert!(err.contains(KEY_VAR), "{err}");
        assert!(Keyring::from_lookup(&lookup(&[])).unwrap().current_id().is_none());
        // The id is a fingerprint: the same key, the same id; another key, another.
        assert_eq!(Keyring::new(Some(K1), &[]).current_id(), Keyring::new(Some(K1), &[]).current_id());
        assert_ne!(Keyring::new(Some(K1), &[]).current_id(), Keyring::new(Some(K2), &[]).current_id());
    }
}
