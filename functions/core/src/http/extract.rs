//! The extractors every route uses, and the small parsers of path and query values.
//!
//! Every rejection — a malformed body, a wrong type, an unknown field, a bad query string, an
//! oversized body, a NUL character — becomes an [`ApiError`] in the contract's shape, never
//! axum's plain text. This module parses and authenticates only: it must never call `service`
//! or the store.

use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;
use utoipa::ToSchema;

use crate::app::AppState;
use crate::auth::Principal;
use crate::domain::{LeaseId, PoolRef, validate_name};
use crate::error::ApiError;

/// Largest accepted request body. A PoolSpec with a big cloud-init payload fits.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// A JSON body whose every failure is a contract error, including an array where the body's
/// schema documents an object ([`super::shape`]). The content type is not checked: a body
/// that parses as JSON is accepted.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned + ToSchema + 'static, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(body_error)?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// A JSON body as `T`, every failure a contract error: malformed JSON, a wrong type or an
/// unknown field, a NUL character, or an array where `T`'s schema documents an object (serde
/// reads a struct from an array too; [`super::shape`] refuses it).
/// An optional JSON body: empty (or only whitespace) and `null` are `T::default()`, anything
/// else is [`parse_json`]'s.
pub(super) fn parse_optional_json<T: DeserializeOwned + ToSchema + Default + 'static>(
    bytes: &[u8],
) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) || bytes.trim_ascii() == b"null" {
        return Ok(T::default());
    }
    parse_json(bytes)
}

pub(super) fn parse_json<T: DeserializeOwned + ToSchema + 'static>(bytes: &[u8]) -> Result<T, ApiError> {
    let value = serde_json::from_slice(bytes)
        .or_else(|e| integral_floats_as_integers(bytes).ok_or(e))
        .map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
    reject_nul_in_json(bytes)?;
    super::shape::check::<T>(bytes).map_err(|e| ApiError::InvalidArgument(format!("invalid JSON body: {e}")))?;
    Ok(value)
}

/// `bytes` as `T` with every integral float (`28.0`, `1e3`) read as the integer it is: JSON
/// Schema, and so the OpenAPI document, calls them integers, serde's integer fields do not.
/// `None` when there is none, or `T` still does not parse (the first error then stands).
fn integral_floats_as_integers<T: DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    fn fix(v: &mut serde_json::Value) -> bool {
        match v {
            serde_json::Value::Number(n) if n.is_f64() => {
                let f = n.as_f64().unwrap_or(f64::NAN);
                // Exactly representable: |f| < 2^53.
                if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 {
                    *v = serde_json::Value::from(f as i64);
                    return true;
                }
                false
            }
            serde_json::Value::Array(a) => a.iter_mut().fold(false, |changed, x| fix(x) | changed),
            serde_json::Value::Object(o) => o.values_mut().fold(false, |changed, x| fix(x) | changed),
            _ => false,
        }
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    fix(&mut value).then(|| serde_json::from_value(value).ok()).flatten()
}

/// A body that could not be read, too large included, as a contract error (never axum's
/// plain-text 413).
pub(super) fn body_error(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::InvalidArgument(format!("request body is larger than {MAX_BODY_BYTES} bytes"))
    } else {
        ApiError::InvalidArgument(format!("cannot read request body: {e}"))
    }
}

const NUL_MESSAGE: &str = "text must not contain the NUL character (\\u0000)";

/// PostgreSQL text cannot hold NUL: refuse it at the edge as INVALID_ARGUMENT rather than let
/// the database fail with an internal error. In JSON a NUL can only be written `\u0000`, so
/// bodies without that escape are not walked.
fn reject_nul_in_json(bytes: &[u8]) -> Result<(), ApiError> {
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(a) => a.iter().any(has_nul),
            serde_json::Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    if !bytes.windows(6).any(|w| w == b"\\u0000") {
        return Ok(());
    }
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(v) if has_nul(&v) => Err(ApiError::InvalidArgument(format!("invalid JSON body: {NUL_MESSAGE}"))),
        _ => Ok(()),
    }
}

/// A query string whose failures are contract errors.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // `%00` is the only way to put a NUL in a query string.
        if parts.uri.query().is_some_and(|q| q.contains("%00")) {
            return Err(ApiError::InvalidArgument(format!("invalid query string: {NUL_MESSAGE}")));
        }
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| ApiQuery(q))
            .map_err(|e: QueryRejection| ApiError::InvalidArgument(format!("invalid query string: {}", e.body_text())))
    }
}

/// Path parameters whose failures are contract errors.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        if parts.uri.path().contains("%00") {
            return Err(ApiError::InvalidArgument(format!("invalid path: {NUL_MESSAGE}")));
        }
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(p)| ApiPath(p))
            .map_err(|e: PathRejection| ApiError::InvalidArgument(format!("invalid path: {}", e.body_text())))
    }
}

/// The authenticated caller.
pub struct Caller(pub Principal);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let header = parts.headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
        state.auth.authenticate(header).map(Caller)
    }
}

/// An extractor for an authenticated caller whose role passes `Principal::$check`.
macro_rules! role_extractor {
    ($(#[$doc:meta])* $name:ident, $check:ident) => {
        $(#[$doc])*
        pub struct $name(pub Principal);

        impl FromRequestParts<AppState> for $name {
            type Rejection = ApiError;

            async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
                let Caller(p) = Caller::from_request_parts(parts, state).await?;
                p.$check()?;
                Ok($name(p))
            }
        }
    };
}

role_extractor!(
    /// An authenticated caller with the admin role.
    Admin,
    require_admin
);
role_extractor!(
    /// An authenticated caller that may read the fleet: an admin or a viewer.
    Reader,
    require_reader
);
role_extractor!(
    /// An authenticated caller that may claim, heartbeat, release and hint: a client or an
    /// admin (a viewer only reads).
    Consumer,
    require_consumer
);

pub(super) fn pool_ref(namespace: &str, name: &str) -> Result<PoolRef, ApiError> {
    PoolRef::parse(namespace, name).map_err(ApiError::InvalidArgument)
}

pub(super) fn lease_id(raw: &str) -> Result<LeaseId, ApiError> {
    // A malformed id cannot name a lease: NOT_FOUND, like any unknown id.
    LeaseId::parse(raw).map_err(|_| ApiError::NotFound(format!("lease {raw} not found")))
}

/// An optional name filter: empty means absent, anything else must be a valid name.
pub(super) fn optional_name(field: &str, value: Option<String>) -> Result<Option<String>, ApiError> {
    match value.filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(v) => validate_name(field, &v).map(|()| Some(v)).map_err(ApiError::InvalidArgument),
    }
}

/// Both or neither of `namespace` and `pool`.
pub(super) fn optional_pool(namespace: Option<&str>, pool: Option<&str>) -> Result<Option<PoolRef>, ApiError> {
    match (namespace.filter(|s| !s.is_empty()), pool.filter(|s| !s.is_empty())) {
        (None, None) => Ok(None),
        (Some(ns), Some(p)) => pool_ref(ns, p).map(Some),
        _ => Err(ApiError::InvalidArgument("give both namespace and pool, or neither".into())),
    }
}
