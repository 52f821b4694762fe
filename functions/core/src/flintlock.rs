//! The flintlock client: one lazily connected channel per host, a timeout on every call,
//! optional TLS and basic-auth token.
//!
//! flintlock reports almost every failure as UNKNOWN with a text message; "not found" is
//! only recognisable by that substring. This module is the one place that reads it.
//! The channel cache is an optimisation only: nothing about correctness is kept here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use flintlock_proto::types as pb;
use flintlock_proto::v1alpha1 as api;
use flintlock_proto::v1alpha1::micro_vm_client::MicroVmClient;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::store::HostRow;

#[derive(Debug, thiserror::Error)]
pub enum FlintlockError {
    /// The host could not be reached or answered UNAVAILABLE / DEADLINE_EXCEEDED.
    #[error("flintlock host {host} unavailable: {message}")]
    Unavailable { host: String, message: String },
    /// The host answered with an error.
    #[error("flintlock host {host}: {code:?}: {message}")]
    Rpc { host: String, code: tonic::Code, message: String },
    /// The host's stored connection settings are unusable.
    #[error("flintlock host {host} is misconfigured: {message}")]
    Config { host: String, message: String },
}

impl FlintlockError {
    /// flintlock's "not found": UNKNOWN with that text (never the NOT_FOUND code).
    pub fn is_not_found(&self) -> bool {
        match self {
            FlintlockError::Rpc { code, message, .. } => {
                (*code == tonic::Code::Unknown || *code == tonic::Code::NotFound) && message.contains("not found")
            }
            _ => false,
        }
    }

    fn from_status(host: &str, s: tonic::Status) -> FlintlockError {
        match s.code() {
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                FlintlockError::Unavailable { host: host.to_owned(), message: s.message().to_owned() }
            }
            code => FlintlockError::Rpc { host: host.to_owned(), code, message: s.message().to_owned() },
        }
    }
}

/// Adds `authorization: Basic <base64(token)>` when the host has a token.
#[derive(Clone)]
pub struct BasicAuth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for BasicAuth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Client = MicroVmClient<InterceptedService<Channel, BasicAuth>>;

/// The settings a cached channel was built from; a host update changes the key.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ChannelKey {
    address: String,
    tls_insecure: bool,
    ca_pem: Option<String>,
    cert_pem: Option<String>,
    key_pem: Option<String>,
    token: Option<String>,
}

impl ChannelKey {
    fn of(h: &HostRow) -> ChannelKey {
        ChannelKey {
            address: h.address.clone(),
            tls_insecure: h.tls_insecure,
            ca_pem: h.ca_pem.clone(),
            cert_pem: h.cert_pem.clone(),
            key_pem: h.key_pem.clone(),
            token: h.basic_auth_token.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Flintlock {
    timeout: Duration,
    channels: Arc<Mutex<HashMap<String, (ChannelKey, Client)>>>,
}

impl Flintlock {
    pub fn new(timeout: Duration) -> Flintlock {
        Flintlock { timeout, channels: Arc::default() }
    }

    fn build(&self, host: &HostRow) -> Result<Client, FlintlockError> {
        let cfg_err = |message: String| FlintlockError::Config { host: host.name.clone(), message };
        let scheme = if host.tls_insecure { "http" } else { "https" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{}", host.address))
            .map_err(|e| cfg_err(format!("address {:?}: {e}", host.address)))?
            .connect_timeout(self.timeout)
            .timeout(self.timeout);
        if !host.tls_insecure {
            let mut tls = ClientTlsConfig::new().with_enabled_roots();
            if let Some(ca) = &host.ca_pem {
                tls = tls.ca_certificate(Certificate::from_pem(ca));
            }
            if let (Some(cert), Some(key)) = (&host.cert_pem, &host.key_pem) {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            ep = ep.tls_config(tls).map_err(|e| cfg_err(format!("TLS settings: {e}")))?;
        }
        let auth = match &host.basic_auth_token {
            None => None,
            Some(t) => {
                let v = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(t));
                Some(v.parse().map_err(|_| cfg_err("basic_auth_token is not valid header text".into()))?)
            }
        };
        Ok(MicroVmClient::with_interceptor(ep.connect_lazy(), BasicAuth(auth)))
    }

    /// The cached client for `host`, rebuilt when its settings changed.
    pub fn client(&self, host: &HostRow) -> Result<Client, FlintlockError> {
        let key = ChannelKey::of(host);
        let mut map = self.channels.lock().expect("channel cache poisoned");
        if let Some((k, c)) = map.get(&host.name)
            && *k == key
        {
            return Ok(c.clone());
        }
        let c = self.build(host)?;
        map.insert(host.name.clone(), (key, c.clone()));
        Ok(c)
    }

    pub async fn create(&self, host: &HostRow, spec: pb::MicroVmSpec) -> Result<pb::MicroVm, FlintlockError> {
        let resp = self
            .client(host)?
            .create_micro_vm(api::CreateMicroVmRequest { microvm: Some(spec), metadata: Default::default() })
            .await
            .map_err(|s| FlintlockError::from_status(&host.name, s))?;
        resp.into_inner().microvm.ok_or_else(|| FlintlockError::Rpc {
            host: host.name.clone(),
            code: tonic::Code::Internal,
            message: "CreateMicroVM answered without a microvm".into(),
        })
    }

    /// Gets a VM by uid; `Ok(None)` when flintlock says it is not found.
    pub async fn get(&self, host: &HostRow, uid: &str) -> Result<Option<pb::MicroVm>, FlintlockError> {
        match self.client(host)?.get_micro_vm(api::GetMicroVmRequest { uid: uid.to_owned() }).await {
            Ok(r) => Ok(r.into_inner().microvm),
            Err(s) => {
                let e = FlintlockError::from_status(&host.name, s);
                if e.is_not_found() { Ok(None) } else { Err(e) }
            }
        }
    }

    /// Deletes a VM by uid. A VM flintlock no longer knows counts as deleted.
    pub async fn delete(&self, host: &HostRow, uid: &str) -> Result<(), FlintlockError> {
        match self.client(host)?.delete_micro_vm(api::DeleteMicroVmRequest { uid: uid.to_owned() }).await {
            Ok(_) => Ok(()),
            Err(s) => {
                let e = FlintlockError::from_status(&host.name, s);
                if e.is_not_found() { Ok(()) } else { Err(e) }
            }
        }
    }

    /// Lists VMs in `namespace` (all namespaces when empty), optionally only those named `name`.
    pub async fn list(
        &self,
        host: &HostRow,
        namespace: &str,
        name: Option<&str>,
    ) -> Result<Vec<pb::MicroVm>, FlintlockError> {
        let resp = self
            .client(host)?
            .list_micro_v_ms(api::ListMicroVMsRequest {
                namespace: namespace.to_owned(),
                name: name.map(str::to_owned),
            })
            .await
            .map_err(|s| FlintlockError::from_status(&host.name, s))?;
        Ok(resp.into_inner().microvm)
    }
}
