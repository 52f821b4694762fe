//! The OpenAPI 3.1 document of the HTTP contract (`shared/http-api.md`): what the operations
//! share — the API's info and tags, the bearer scheme, the error responses in the contract's
//! shape — and [`build`], which documents a route table it is given.
//!
//! Its paths come from the same route table as the Routers: every handler is routed through
//! `utoipa_axum::routes!` with its `#[utoipa::path]` next to it, and `super::document` passes
//! [`super::api_routes`], the table `poolmgr-local` and the tests serve. This module imports
//! no route: it must never describe a path by hand.
//!
//! Request objects are closed (`additionalProperties: false`), because the service refuses
//! unknown fields; response objects are left open so that a field added later does not break
//! a client generated from this document (the Router test still refuses undocumented fields).

use std::collections::BTreeMap;

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, ObjectBuilder, OpenApi, Ref, RefOr, Response, ResponseBuilder, Type};
use utoipa::{IntoResponses, Modify};
use utoipa_axum::router::OpenApiRouter;

use crate::error::ErrorBody;

/// Name of the security scheme every authenticated operation names.
pub const BEARER: &str = "bearer";

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "poolmgr HTTP API",
        version = "1",
        description = "Warm pools of flintlock microVMs: claim a ready VM, heartbeat its lease, release it. \
                       Every error answers `{\"error\": {\"code\", \"status\", \"reason\", \"message\", \"request_id\"}}` with the HTTP status of its code. \
                       Tokens have a role: `client` (claims, leases and demand hints), `viewer` (every read, metrics and events) or `admin` (everything). \
                       Reference: docs/api.md; compatibility within /v1: docs/compatibility.md.",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    components(schemas(ErrorBody)),
    modifiers(&BearerScheme),
    tags(
        (name = "claims", description = "Claim a VM (the claims function)"),
        (name = "leases", description = "Heartbeat, list and release leases (the leases function)"),
        (name = "pools", description = "Pools (the pools function)"),
        (name = "hosts", description = "flintlock hosts and VMs (the hosts function)"),
        (name = "principals", description = "client principals' pool scopes and live-lease quotas (the hosts function)"),
        (name = "events", description = "The event feed (the events function)"),
        (name = "operations", description = "Probes, health, metrics and this document (every function)"),
    )
)]
pub struct ApiDoc;

struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("`Authorization: Bearer <token>`; an `admin`, `viewer` or `client` token (each route says which roles it takes)"))
                    .build(),
            ),
        );
    }
}

/// The document of `routes`: their paths and schemas under this API's info, tags, bearer
/// scheme and error schema.
pub fn build<S: Clone + Send + Sync + 'static>(routes: OpenApiRouter<S>) -> OpenApi {
    OpenApiRouter::with_openapi(<ApiDoc as utoipa::OpenApi>::openapi()).merge(routes).split_for_parts().1
}

fn error_response(description: &str, retry_after: bool) -> RefOr<Response> {
    let mut b = ResponseBuilder::new()
        .description(description)
        .content("application/json", ContentBuilder::new().schema(Some(Ref::from_schema_name("Error"))).build());
    if retry_after {
        b = b.header(
            "Retry-After",
            HeaderBuilder::new()
                .schema(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0)))
                .description(Some("Seconds to wait before retrying"))
                .build(),
        );
    }
    RefOr::T(b.build())
}

/// Declares a set of error responses for `responses(...)` of `#[utoipa::path]`.
macro_rules! error_responses {
    ($(#[$doc:meta])* $name:ident { $($code:literal => ($desc:literal, $retry:literal)),+ $(,)? }) => {
        $(#[$doc])*
        pub struct $name;

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                BTreeMap::from([$(($code.to_string(), error_response($desc, $retry))),+])
            }
        }
    };
}

error_responses!(
    /// What any authenticated operation can answer.
    Common {
        "400" => ("INVALID_ARGUMENT: malformed JSON, a missing, unknown or invalid field, query parameter or path parameter; FAILED_PRECONDITION where the operation says so", false),
        "401" => ("UNAUTHENTICATED: missing or unknown token", false),
        "500" => ("INTERNAL: an unexpected server error (no internals in the message); for a claim also a failed pre-lease hook", false),
        "503" => ("UNAVAILABLE: flintlock or the database could not be reached, or the database reported a retryable error (deadlock, serialization failure, cancelled statement, lock not available); retry", true),
    }
);

error_responses!(
    /// A change only an admin may make, called with a client or viewer token.
    AdminOnly { "403" => ("PERMISSION_DENIED: a client or viewer token on an admin route", false) }
);

error_responses!(
    /// A read of the fleet (admin or viewer) called with a client token.
    ReadOnly { "403" => ("PERMISSION_DENIED: a client token on an admin or viewer route", false) }
);

error_responses!(
    /// A claim, heartbeat, release or hint (client or admin) called with a viewer token.
    ConsumerOnly { "403" => ("PERMISSION_DENIED: a viewer token, which may only read", false) }
);

error_responses!(
    /// The named object does not exist.
    NotFound { "404" => ("NOT_FOUND: unknown pool, lease, host, VM or principal limits", false) }
);

error_responses!(
    /// A conditional update whose If-Match names none of the object's current ETags.
    PreconditionFailed {
        "412" => ("FAILED_PRECONDITION (reason ETAG_MISMATCH): If-Match names none of the pool's current ETag: someone changed its spec since it was read; nothing was changed. GET it again and retry with the new ETag", false),
    }
);

error_responses!(
    /// A create of something that exists.
    AlreadyExists { "409" => ("ALREADY_EXISTS: it exists already", false) }
);

error_responses!(
    /// A host update to an address another host has.
    AddressTaken { "409" => ("ALREADY_EXISTS: another host is registered at this address (one record per flintlockd)", false) }
);

error_responses!(
    /// The claim's outcomes beyond the common ones.
    ClaimErrors {
        "404" => ("NOT_FOUND: unknown pool, or a pool outside the client principal's scope (answered exactly alike)", false),
        "409" => ("ABORTED: the claim raced a deletion (the replayed lease's VM is DELETING or gone, or the concurrent claim that won the request_id already ended), or a concurrent claim with this request_id is still running its pre-lease hook; retrying is correct", true),
        "429" => ("RESOURCE_EXHAUSTED: no AVAILABLE VM in the pool (`reason` POOL_EXHAUSTED), or the principal's live-lease quota is used up (`reason` QUOTA_EXCEEDED)", true),
    }
);

error_responses!(
    /// `/readyz` and `/healthz`: no token, so only the server-side failures.
    HealthErrors {
        "500" => ("INTERNAL: an unexpected server error", false),
        "503" => ("UNAVAILABLE: the database could not be reached, or its schema is not this binary's (the message says which and what to do)", true),
    }
);
