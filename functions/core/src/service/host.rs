//! Hosts: register, update, cordon, remove.

use serde::Deserialize;
use utoipa::openapi::schema::{AllOfBuilder, OneOfBuilder, Schema};
use utoipa::openapi::{ObjectBuilder, RefOr};
use utoipa::{PartialSchema, ToSchema};

use crate::api::Host;
use crate::app::AppState;
use crate::credentials::{CredentialsError, Secrets, Stored};
use crate::domain::{EventType, HostExec, NAME_PATTERN, Name, validate_name};
use crate::error::ApiError;
use crate::rules::{
    BasicAuthToken, HOST_ADDRESS, HostAddress, MAX_BASIC_AUTH_TOKEN_CHARS, MAX_HOST_ADDRESS_CHARS, MAX_PEM_CHARS,
    NO_CONTROL, PEM, Pem, null, reference, schema_only, string,
};
use crate::store::{self, HostDelete, HostWrite, StoreError};

/// How to reach a flintlockd: plaintext (`insecure`), or TLS with a CA and optionally a
/// client certificate (see [`TlsRules`]).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = HostTlsSpec)]
pub struct HostTls {
    #[serde(default)]
    pub insecure: bool,
    #[serde(default)]
    #[schema(value_type = Option<Pem>)]
    pub ca_pem: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Pem>)]
    pub cert_pem: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Pem>)]
    pub key_pem: Option<String>,
}

schema_only! {
    /// A [`HostTls`] as [`HostSpec::validate`] accepts it: `insecure: true` and no PEM, or a
    /// CA with an optional client certificate and key (both or neither).
    TlsRules [HostTls] = AllOfBuilder::new().item(reference::<HostTls>()).item(
        OneOfBuilder::new().item(tls_way(true, false, false)).item(tls_way(false, true, false)).item(tls_way(false, true, true)),
    );

    /// The body of `POST /v1/hosts`: a [`HostSpec`] with its `name` and `tls` required (and
    /// `tls` not null). (HostSpec's own example has no name: a PUT's body may leave it out,
    /// and one naming another host is refused.)
    HostCreate [HostSpec] = host_create();
}

/// [`HostCreate`]'s schema: [`HostSpec`]'s own object with `name` and `tls` narrowed and
/// required. One object, not an `allOf` of `HostSpec` and the narrower fields, which client
/// generators cannot merge (`name: string | null` with `name: string`): they dropped the
/// operation. Accepts exactly what that `allOf` accepted.
fn host_create() -> Schema {
    let RefOr::T(Schema::Object(mut spec)) = <HostSpec as PartialSchema>::schema() else {
        unreachable!("HostSpec derives an object schema")
    };
    spec.properties.insert(
        "name".into(),
        string().pattern(Some(NAME_PATTERN)).description(Some("The host's name, unique")).into(),
    );
    spec.properties.insert("tls".into(), <TlsRules as PartialSchema>::schema());
    for field in ["name", "tls"] {
        if !spec.required.iter().any(|r| r == field) {
            spec.required.push(field.into());
        }
    }
    spec.description = Some(
        "The body of `POST /v1/hosts`: a HostSpec whose `name` and `tls` are required (plaintext only as \
         `{\"insecure\": true}`)."
            .into(),
    );
    spec.example = None;
    spec.examples = vec![serde_json::json!({"name": "spare", "address": "127.0.0.1:9", "tls": {"insecure": true}})];
    Schema::Object(spec)
}

/// One way [`TlsRules`] allows: `insecure` (required when true), a CA, a client certificate
/// and key; each PEM either required or absent.
fn tls_way(insecure: bool, ca: bool, cert_and_key: bool) -> ObjectBuilder {
    let flag = ObjectBuilder::new().schema_type(utoipa::openapi::Type::Boolean).enum_values(Some([insecure]));
    let mut way = ObjectBuilder::new().property("insecure", flag);
    if insecure {
        way = way.required("insecure");
    }
    for (field, has) in [("ca_pem", ca), ("cert_pem", cert_and_key), ("key_pem", cert_and_key)] {
        way = if has { way.property(field, string()).required(field) } else { way.property(field, null()) };
    }
    way
}

/// A host as written by a client. `tls` is required to create one (plaintext only as
/// `{"insecure": true}`); a PUT that leaves it out keeps the host's current TLS.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"address": "127.0.0.1:9", "tls": {"insecure": true}}))]
pub struct HostSpec {
    /// Required to create; on update it may be given and must match the path.
    #[serde(default)]
    #[schema(value_type = Option<Name>, inline)]
    pub name: Option<String>,
    #[schema(value_type = HostAddress)]
    pub address: String,
    /// Required on create: `{"insecure": true}` for a plaintext (`--insecure`) flintlockd, or
    /// a CA (and optionally a client certificate and key). On update, omitted or null keeps
    /// the host's current TLS, its key included.
    #[serde(default)]
    #[schema(value_type = Option<TlsRules>, inline)]
    pub tls: Option<HostTls>,
    #[serde(default)]
    #[schema(value_type = Option<BasicAuthToken>)]
    pub basic_auth_token: Option<String>,
    /// Whether this host can run hooks (create and pre-lease commands): `auto` asks its
    /// ServerInfo when a pool with hooks names it; `enabled` / `disabled` declares it,
    /// overriding ServerInfo. A PUT without it sets `auto` again.
    #[serde(default = "HostExec::auto")]
    #[schema(default = "auto")]
    pub exec: HostExec,
}

impl HostSpec {
    /// Checks the spec and gives the TLS it asks for: its own `tls`, else `current` (a PUT of a
    /// host that has one), else it is refused: plaintext is never a default.
    fn validate(&self, current: Option<&HostTls>) -> Result<HostTls, ApiError> {
        let bad = |m: String| ApiError::InvalidArgument(m);
        if !HOST_ADDRESS.is_match(&self.address) || self.address.len() > MAX_HOST_ADDRESS_CHARS {
            return Err(bad(format!(
                "address {:?} must be host:port (at most {MAX_HOST_ADDRESS_CHARS} ASCII characters, no scheme, path or space) with a port between 1 and 65535",
                self.address
            )));
        }
        let tls = self.tls.clone().or_else(|| current.cloned()).ok_or_else(|| {
            bad("tls is required: {\"insecure\": true} for a plaintext (--insecure) flintlockd, or {\"ca_pem\": …} (with cert_pem and key_pem for mTLS) for TLS".into())
        })?;
        for (field, v) in [("tls.ca_pem", &tls.ca_pem), ("tls.cert_pem", &tls.cert_pem), ("tls.key_pem", &tls.key_pem)]
        {
            if let Some(v) = v {
                if !PEM.is_match(v) || v.len() > MAX_PEM_CHARS {
                    return Err(bad(format!(
                        "{field} must be a PEM block (ASCII, with a -----BEGIN line) of at most {MAX_PEM_CHARS} characters"
                    )));
                }
                if tls.insecure {
                    return Err(bad(format!("{field} makes no sense with tls.insecure=true")));
                }
            }
        }
        if tls.cert_pem.is_some() != tls.key_pem.is_some() {
            return Err(bad("tls.cert_pem and tls.key_pem go together: give both or neither".into()));
        }
        if !tls.insecure && tls.ca_pem.is_none() {
            return Err(bad(
                "tls.ca_pem is required for a TLS host (or set tls.insecure=true for a plaintext flintlockd)".into(),
            ));
        }
        if let Some(t) = &self.basic_auth_token
            && (t.is_empty() || t.chars().count() > MAX_BASIC_AUTH_TOKEN_CHARS || !NO_CONTROL.is_match(t))
        {
            return Err(bad(format!(
                "basic_auth_token must be 1-{MAX_BASIC_AUTH_TOKEN_CHARS} characters without control characters"
            )));
        }
        if self.basic_auth_token.is_some() && tls.insecure && !is_loopback(&self.address) {
            return Err(bad(format!(
                "basic_auth_token over plaintext would send the token in the clear to {}: give the host TLS (tls.ca_pem), or drop the token (plaintext with a token is allowed only on a loopback address)",
                self.address
            )));
        }
        Ok(tls)
    }
}

/// `localhost`, `127.x.x.x` or `[::1]` (with its port): a token to it never crosses a network.
fn is_loopback(address: &str) -> bool {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound(format!("host {name} not found"))
}

fn write<'a>(name: &'a str, spec: &'a HostSpec, tls: &'a HostTls, secrets: &'a Stored) -> HostWrite<'a> {
    HostWrite {
        name,
        address: &spec.address,
        tls_insecure: tls.insecure,
        ca_pem: tls.ca_pem.as_deref(),
        cert_pem: tls.cert_pem.as_deref(),
        secrets,
        exec: spec.exec,
    }
}

/// A failure of the deployment's credentials keys: the client cannot fix it by changing the
/// request alone, so FAILED_PRECONDITION with what the operator must set.
fn credentials_error(e: CredentialsError) -> ApiError {
    let reason = match e {
        CredentialsError::NoKey { .. } => "CREDENTIALS_KEY_MISSING",
        CredentialsError::UnknownKey { .. } | CredentialsError::Corrupt { .. } => "CREDENTIALS_UNREADABLE",
    };
    ApiError::FailedPrecondition(e.to_string()).reason(reason)
}

/// The host's secrets (the TLS key and the token) sealed for its row (issue 25 item 4).
fn seal(state: &AppState, name: &str, spec: &HostSpec, tls: &HostTls) -> Result<Stored, ApiError> {
    let secrets = Secrets { key_pem: tls.key_pem.clone(), basic_auth_token: spec.basic_auth_token.clone() };
    state.config.credentials.seal(name, &secrets).map_err(credentials_error)
}

/// A write refused because another host has the address: ALREADY_EXISTS, naming that host.
/// One record per flintlockd: two would each take the other's VMs for VMs "on another host"
/// and delete them as orphans.
async fn address_taken(state: &AppState, e: StoreError, address: &str) -> ApiError {
    match e {
        StoreError::UniqueViolation { constraint, .. } if constraint == store::HOSTS_ADDRESS_KEY => {
            let owner = match state.conn().await {
                Ok(conn) => store::host_name_by_address(&conn, address).await.ok().flatten(),
                Err(_) => None,
            };
            ApiError::AlreadyExists(format!(
                "address {address} is already registered as host {}: register each flintlockd once",
                owner.as_deref().unwrap_or("(another host)")
            ))
        }
        e => e.into(),
    }
}

/// `write` and its audit event in one transaction; the connection goes back before the
/// caller's error handling takes one (`address_taken`: a pool may have only one).
async fn write_audited(
    state: &AppState,
    kind: EventType,
    by: &str,
    w: &HostWrite<'_>,
    insert: bool,
) -> store::Result<Option<(store::HostRow, i64)>> {
    let mut conn = state.db.get().await?;
    let tx = conn.transaction().await?;
    let written = if insert { store::host_insert(&tx, w).await? } else { store::host_update(&tx, w).await? };
    if let Some((row, _)) = &written {
        let payload = serde_json::json!({"address": row.address, "tls_insecure": row.tls_insecure, "exec": row.exec});
        super::audit_fleet(&tx, kind, ("host", w.name), by, payload).await?;
        tx.commit().await?;
    }
    Ok(written)
}

pub async fn create(state: &AppState, spec: HostSpec, by: &str) -> Result<Host, ApiError> {
    let name = spec.name.clone().ok_or_else(|| ApiError::InvalidArgument("name is required".into()))?;
    validate_name("name", &name).map_err(ApiError::InvalidArgument)?;
    let tls = spec.validate(None)?;
    let secrets = seal(state, &name, &spec, &tls)?;
    let inserted =
        write_audited(state, EventType::HostRegistered, by, &write(&name, &spec, &tls, &secrets), true).await;
    let inserted = match inserted {
        Ok(r) => r,
        Err(e) => return Err(address_taken(state, e, &spec.address).await),
    };
    let (row, n) = inserted.ok_or_else(|| {
        ApiError::AlreadyExists(format!("host {name} already exists: use PUT /v1/hosts/{name} to change it"))
    })?;
    tracing::info!(host = %name, address = %row.address, exec = %row.exec, by, "host registered");
    Ok(Host::new(&row, n))
}

pub async fn update(state: &AppState, name: &str, spec: HostSpec, by: &str) -> Result<Host, ApiError> {
    validate_name("name", name).map_err(ApiError::InvalidArgument)?;
    if let Some(body_name) = &spec.name
        && body_name != name
    {
        return Err(ApiError::InvalidArgument(format!(
            "the body names host {body_name} but the path names {name}: hosts cannot be renamed"
        )));
    }
    // A PUT without `tls` keeps the host's: never a silent downgrade to plaintext. Its key
    // is opened here and sealed again below, with the token the PUT gives.
    let current = match &spec.tls {
        Some(_) => None,
        None => match store::host_get(&state.conn().await?, name).await? {
            None => None,
            Some((h, _)) => {
                let opened = state.config.credentials.open(name, &h.stored_credentials()).map_err(credentials_error)?;
                Some(HostTls {
                    insecure: h.tls_insecure,
                    ca_pem: h.ca_pem,
                    cert_pem: h.cert_pem,
                    key_pem: opened.key_pem,
                })
            }
        },
    };
    if spec.tls.is_none() && current.is_none() {
        return Err(not_found(name));
    }
    let tls = spec.validate(current.as_ref())?;
    let secrets = seal(state, name, &spec, &tls)?;
    let updated = write_audited(state, EventType::HostUpdated, by, &write(name, &spec, &tls, &secrets), false).await;
    let updated = match updated {
        Ok(r) => r,
        Err(e) => return Err(address_taken(state, e, &spec.address).await),
    };
    let Some((row, n)) = updated else {
        return Err(match store::host_get(&state.conn().await?, name).await? {
            None => not_found(name),
            Some((old, vms)) => ApiError::FailedPrecondition(format!(
                "host {name} has {vms} VMs at {}: its address cannot change while it has VMs (their microVMs are there, and would leak); \
                 cordon it (POST /v1/hosts/{name}/cordon) and let its VMs go, or register the new flintlockd as a host of its own",
                old.address
            )),
        });
    };
    tracing::info!(host = %name, address = %row.address, exec = %row.exec, by, "host updated");
    Ok(Host::new(&row, n))
}

pub async fn get(state: &AppState, name: &str) -> Result<Host, ApiError> {
    let conn = state.conn().await?;
    let (row, n) = store::host_get(&conn, name).await?.ok_or_else(|| not_found(name))?;
    Ok(Host::new(&row, n))
}

/// One page of hosts by name, and the next page's token (empty on the last).
pub async fn list(
    state: &AppState,
    page_size: Option<i64>,
    page_token: Option<&str>,
) -> Result<(Vec<Host>, String), ApiError> {
    let size = super::page_size(page_size)?;
    let after =
        super::page_key(page_token, |name| crate::domain::validate_name("name", name).ok().map(|()| name.to_owned()))?;
    let conn = state.conn().await?;
    let rows = store::host_list_page(&conn, after.as_deref().unwrap_or(""), size + 1).await?;
    let (rows, next) = super::page_of(rows, size, |(h, _)| h.name.clone());
    Ok((rows.iter().map(|(h, n)| Host::new(h, *n)).collect(), next))
}

/// Cordons (`Some(reason)`) or uncordons (`None`) a host. Idempotent.
pub async fn set_cordon(state: &AppState, name: &str, reason: Option<&str>, by: &str) -> Result<Host, ApiError> {
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    let (row, n) = store::host_set_cordon(&tx, name, reason).await?.ok_or_else(|| not_found(name))?;
    let kind = if reason.is_some() { EventType::HostCordoned } else { EventType::HostUncordoned };
    super::audit_fleet(&tx, kind, ("host", name), by, serde_json::json!({"reason": reason})).await?;
    tx.commit().await?;
    tracing::info!(host = %name, cordoned = row.cordoned, by, "host cordon changed");
    Ok(Host::new(&row, n))
}

pub async fn remove(state: &AppState, name: &str, by: &str) -> Result<(), ApiError> {
    let mut conn = state.conn().await?;
    let tx = conn.transaction().await?;
    // Lock the host row in a statement of its own first. Under READ COMMITTED the in-use
    // check below then takes its snapshot after the lock is granted, so it sees a pool that a
    // concurrent create/update (holding KEY SHARE on this row) has just committed. Checking
    // in the locking statement itself would use a snapshot from before the wait and miss it.
    store::host_lock(&tx, name).await?;
    match store::host_delete(&tx, name).await? {
        HostDelete::NotFound => Err(not_found(name)),
        HostDelete::InUse { pools, vm_count } => Err(ApiError::FailedPrecondition(format!(
            "host {name} is still in use ({} pool(s){}{}, {vm_count} VM(s)): cordon it, remove it from those pools' flintlock_hosts and wait for its VMs to go",
            pools.len(),
            if pools.is_empty() { "" } else { ": " },
            pools.join(", ")
        ))),
        HostDelete::Deleted => {
            super::audit_fleet(&tx, EventType::HostRemoved, ("host", name), by, serde_json::json!({})).await?;
            tx.commit().await?;
            tracing::info!(host = %name, by, "host removed");
            Ok(())
        }
    }
}
