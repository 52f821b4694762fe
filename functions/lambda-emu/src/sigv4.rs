//! AWS Signature Version 4 as the emulated Lambda Invoke API checks it: [`parse`] reads an
//! `Authorization: AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…, Signature=…` header,
//! [`signature`] recomputes the signature of a request from its parts and a secret key, so
//! [`crate::InvokeApi`] can tell a correctly signed invoke from one that only looks signed.
//! [`sign`] produces the header (for tests, and for anything driving the emulator).
//!
//! Never checks the clock: `X-Amz-Date` is taken as given (the emulator runs on one machine).

use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};

/// The parts of an `Authorization` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthHeader {
    pub access_key_id: String,
    /// `DATE/REGION/SERVICE/aws4_request`.
    pub scope: String,
    /// Lowercase header names, `;`-separated, as signed.
    pub signed_headers: String,
    pub signature: String,
}

/// Reads an `AWS4-HMAC-SHA256` `Authorization` header; `None` for another scheme or a
/// header missing a part.
pub fn parse(header: &str) -> Option<AuthHeader> {
    let rest = header.trim().strip_prefix("AWS4-HMAC-SHA256")?;
    if !rest.starts_with(' ') {
        return None;
    }
    let (mut credential, mut signed_headers, mut signature) = (None, None, None);
    for part in rest.split(',') {
        let (k, v) = part.trim().split_once('=')?;
        match k {
            "Credential" => credential = Some(v.to_owned()),
            "SignedHeaders" => signed_headers = Some(v.to_owned()),
            "Signature" => signature = Some(v.to_owned()),
            _ => {}
        }
    }
    let credential = credential?;
    let (access_key_id, scope) = credential.split_once('/')?;
    if access_key_id.is_empty() || scope.split('/').count() != 4 || !scope.ends_with("/aws4_request") {
        return None;
    }
    let signature = signature?;
    if signature.len() != 64 || !signature.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(AuthHeader {
        access_key_id: access_key_id.to_owned(),
        scope: scope.to_owned(),
        signed_headers: signed_headers?,
        signature: signature.to_ascii_lowercase(),
    })
}

/// What is signed of a request.
pub struct Request<'a> {
    pub method: &'a str,
    /// The path as sent (already URI-encoded once).
    pub path: &'a str,
    /// The raw query string (may be empty).
    pub query: &'a str,
    /// The request's headers; only the signed ones are used, looked up case-insensitively.
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

/// The signature of `req` under `secret_access_key`, for the scope, signed headers and
/// `X-Amz-Date` the request names. `None` when a signed header is missing.
pub fn signature(req: &Request<'_>, auth: &AuthHeader, secret_access_key: &str) -> Option<String> {
    let header = |name: &str| req.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str());
    let amz_date = header("x-amz-date")?;
    let mut canonical_headers = String::new();
    for name in auth.signed_headers.split(';') {
        let value = header(name)?;
        canonical_headers.push_str(&format!("{name}:{}\n", value.split_whitespace().collect::<Vec<_>>().join(" ")));
    }
    let payload = match header("x-amz-content-sha256") {
        Some(h) => h.to_owned(),
        None => sha256_hex(req.body),
    };
    let canonical = format!(
        "{}\n{}\n{}\n{canonical_headers}\n{}\n{payload}",
        req.method,
        canonical_uri(req.path),
        canonical_query(req.query),
        auth.signed_headers
    );
    let to_sign = format!("AWS4-HMAC-SHA256\n{amz_date}\n{}\n{}", auth.scope, sha256_hex(canonical.as_bytes()));
    let mut key = format!("AWS4{secret_access_key}").into_bytes();
    for part in auth.scope.split('/') {
        key = hmac_sha256(&key, part.as_bytes());
    }
    Some(hex(&hmac_sha256(&key, to_sign.as_bytes())))
}

/// The `Authorization` header for `req` (whose headers must include `host` and `x-amz-date`;
/// every header given is signed). `date` is `YYYYMMDD`, the first part of `x-amz-date`.
pub fn sign(req: &Request<'_>, access_key_id: &str, secret_access_key: &str, region: &str, service: &str) -> String {
    let amz_date =
        req.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("x-amz-date")).map(|(_, v)| v.as_str()).unwrap_or("");
    let date = amz_date.get(..8).unwrap_or("");
    let mut names: Vec<String> = req.headers.iter().map(|(k, _)| k.to_ascii_lowercase()).collect();
    names.sort();
    let auth = AuthHeader {
        access_key_id: access_key_id.to_owned(),
        scope: format!("{date}/{region}/{service}/aws4_request"),
        signed_headers: names.join(";"),
        signature: String::new(),
    };
    let sig = signature(req, &auth, secret_access_key).unwrap_or_default();
    format!(
        "AWS4-HMAC-SHA256 Credential={access_key_id}/{}, SignedHeaders={}, Signature={sig}",
        auth.scope, auth.signed_headers
    )
}

/// Every service but S3: each segment of the (once-encoded) path encoded again.
fn canonical_uri(path: &str) -> String {
    if path.is_empty() {
        return "/".into();
    }
    path.split('/').map(uri_encode).collect::<Vec<_>>().join("/")
}

/// The query's pairs sorted (already encoded as sent).
fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<(&str, &str)> =
        query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, ""))).collect();
    pairs.sort();
    pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
}

/// Percent-encodes everything but SigV4's unreserved characters (`A-Z a-z 0-9 - _ . ~`).
pub fn uri_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";

    fn vanilla_headers() -> Vec<(String, String)> {
        vec![("Host".into(), "example.amazonaws.com".into()), ("X-Amz-Date".into(), "20150830T123600Z".into())]
    }

    /// AWS's Signature Version 4 test suite: post-vanilla and get-vanilla-query-order-key-case.
    #[test]
    fn signatures_match_the_aws_test_suite() {
        let headers = vanilla_headers();
        let post = Request { method: "POST", path: "/", query: "", headers: &headers, body: b"" };
        assert_eq!(
            sign(&post, "AKIDEXAMPLE", SECRET, "us-east-1", "service"),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"
        );
        let get =
            Request { method: "GET", path: "/", query: "Param2=value2&Param1=value1", headers: &headers, body: b"" };
        let auth = parse(&sign(&get, "AKIDEXAMPLE", SECRET, "us-east-1", "service")).unwrap();
        assert_eq!(auth.signature, "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500");
    }

    #[test]
    fn parse_reads_a_header_and_refuses_other_schemes() {
        let auth = parse(
            "AWS4-HMAC-SHA256 Credential=ASIAEXAMPLE/20260101/eu-west-1/lambda/aws4_request, \
             SignedHeaders=host;x-amz-date, Signature=5DA7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b",
        )
        .unwrap();
        assert_eq!(auth.access_key_id, "ASIAEXAMPLE");
        assert_eq!(auth.scope, "20260101/eu-west-1/lambda/aws4_request");
        assert_eq!(auth.signed_headers, "host;x-amz-date");
        assert!(auth.signature.starts_with("5da7"));
        for bad in [
            "",
            "Bearer abc",
            "AWS4-HMAC-SHA256",
            "AWS4-HMAC-SHA256 Credential=A/20260101/eu-west-1/lambda/aws4_request, SignedHeaders=host",
            "AWS4-HMAC-SHA256 Credential=A/20260101/lambda/aws4_request, SignedHeaders=host, Signature=00",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_changed_body_or_header_changes_the_signature() {
        let mut headers = vanilla_headers();
        let req = Request {
            method: "POST",
            path: "/2015-03-31/functions/f/invocations",
            query: "",
            headers: &headers,
            body: b"{}",
        };
        let auth = parse(&sign(&req, "AK", "s", "eu-west-1", "lambda")).unwrap();
        assert_eq!(signature(&req, &auth, "s").as_deref(), Some(auth.signature.as_str()));
        assert_ne!(signature(&req, &auth, "other").as_deref(), Some(auth.signature.as_str()));
        let changed = Request { body: b"{ }", ..req };
        assert_ne!(signature(&changed, &auth, "s").as_deref(), Some(auth.signature.as_str()));
        headers[0].1 = "elsewhere".into();
        let moved = Request {
            method: "POST",
            path: "/2015-03-31/functions/f/invocations",
            query: "",
            headers: &headers,
            body: b"{}",
        };
        assert_ne!(signature(&moved, &auth, "s").as_deref(), Some(auth.signature.as_str()));
        // A signed header that is not there: no signature at all.
        let none: Vec<(String, String)> = vec![("x-amz-date".into(), "20150830T123600Z".into())];
        let missing = Request { headers: &none, ..moved };
        assert_eq!(signature(&missing, &auth, "s"), None);
    }

    #[test]
    fn the_canonical_uri_encodes_an_encoded_arn_again() {
        assert_eq!(
            canonical_uri("/2015-03-31/functions/reconcile/invocations"),
            "/2015-03-31/functions/reconcile/invocations"
        );
        assert_eq!(
            canonical_uri("/2015-03-31/functions/arn%3Aaws%3Alambda/invocations"),
            "/2015-03-31/functions/arn%253Aaws%253Alambda/invocations"
        );
        assert_eq!(uri_encode("a b/c~"), "a%20b%2Fc~");
    }
}
