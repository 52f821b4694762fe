//! The `microvm.services.api.v1alpha1.MicroVM` gRPC service of the sim
//! (the `MicroVMExec` service is in `exec.rs`).

use std::pin::Pin;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use flintlock_proto::types::micro_vm_status::MicroVmState;
use flintlock_proto::v1alpha1::micro_vm_server::MicroVm;
use flintlock_proto::v1alpha1::{
    CreateMicroVmRequest, CreateMicroVmResponse, DeleteMicroVmRequest, GetMicroVmRequest, GetMicroVmResponse,
    GuestAgentServiceInfo, ListMessage, ListMicroVMsRequest, ListMicroVMsResponse, ServerInfoResponse, VersionInfo,
};
use futures::Stream;
use rand::seq::SliceRandom;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::{
    Inner, METHOD_CREATE, METHOD_DELETE, METHOD_GET, METHOD_LIST, METHOD_LIST_STREAM, METHOD_SERVER_INFO, Sim, create,
    set_state, take_fault, vm_uid,
};

/// The build metadata ServerInfo reports next to a defined version.
const BUILD_DATE: &str = "2026-10-01T09:30:00Z";
/// See [`BUILD_DATE`].
const COMMIT_HASH: &str = "5f1e0c2";

/// The tonic service implementation; obtain it with [`Sim::service`].
#[derive(Debug, Clone)]
pub struct SimService {
    pub(crate) sim: Sim,
}

impl SimService {
    pub(crate) fn new(sim: Sim) -> Self {
        SimService { sim }
    }

    /// Counts the call, then applies the "server unavailable" fault and the
    /// basic-auth check (flintlock's auth interceptor runs before handlers).
    fn precheck(&self, method: &'static str, metadata: &MetadataMap) -> Result<(), Status> {
        self.precheck_gated(method, metadata, |_| None)
    }

    /// [`SimService::precheck`] with a registration gate: when `unregistered`
    /// returns a status (UNIMPLEMENTED for a service or method the emulated
    /// server does not have) it is answered before the auth check, as grpc-go
    /// does for unknown services and methods.
    pub(crate) fn precheck_gated(
        &self,
        method: &'static str,
        metadata: &MetadataMap,
        unregistered: impl FnOnce(&Inner) -> Option<Status>,
    ) -> Result<(), Status> {
        let mut inner = self.sim.lock();
        *inner.calls.entry(method).or_default() += 1;
        tracing::debug!(method, "rpc received");
        if inner.faults.unavailable {
            return Err(Status::unavailable("injected: server unavailable"));
        }
        if let Some(status) = unregistered(&inner) {
            return Err(status);
        }
        if let Some(token) = inner.basic_auth_token.as_deref() {
            check_basic_auth(metadata, token)?;
        }
        Ok(())
    }

    /// Exact-match namespace / name filters over every stored record, shuffled.
    fn list(&self, namespace: &str, name: Option<&str>) -> Vec<flintlock_proto::types::MicroVm> {
        let mut vms: Vec<_> = self
            .sim
            .lock()
            .vms
            .values()
            .filter(|vm| {
                let spec = vm.spec.as_ref();
                let ns = spec.map(|s| s.namespace.as_str()).unwrap_or_default();
                let id = spec.map(|s| s.id.as_str()).unwrap_or_default();
                (namespace.is_empty() || ns == namespace) && name.is_none_or(|n| id == n)
            })
            .cloned()
            .collect();
        vms.shuffle(&mut rand::rng());
        vms
    }
}

const AUTH_EXTRACT_PREFIX: &str =
    "could not extract token from request header: rpc error: code = Unauthenticated desc = ";

/// flintlockd's `--basic-auth-token` check (grpc-ecosystem `AuthFromMD(ctx, "basic")`).
fn check_basic_auth(metadata: &MetadataMap, token: &str) -> Result<(), Status> {
    let value = metadata.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("");
    if value.is_empty() {
        return Err(Status::unauthenticated(format!("{AUTH_EXTRACT_PREFIX}Request unauthenticated with basic")));
    }
    let Some((scheme, supplied)) = value.split_once(' ') else {
        return Err(Status::unauthenticated(format!("{AUTH_EXTRACT_PREFIX}Bad authorization string")));
    };
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(Status::unauthenticated(format!("{AUTH_EXTRACT_PREFIX}Request unauthenticated with basic")));
    }
    if supplied != BASE64.encode(token) {
        return Err(Status::unauthenticated(
            "invalid auth token: failed basic authentication. Check the token supplied",
        ));
    }
    Ok(())
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListMessage, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl MicroVm for SimService {
    async fn create_micro_vm(
        &self,
        request: Request<CreateMicroVmRequest>,
    ) -> Result<Response<CreateMicroVmResponse>, Status> {
        self.precheck(METHOD_CREATE, request.metadata())?;
        let req = request.into_inner();
        let vm = create::build_microvm(req.microvm, || ulid::Ulid::generate().to_string())?;
        let uid = vm_uid(&vm).to_string();
        let delay = {
            let mut inner = self.sim.lock();
            inner.creates_in_flight += 1;
            inner.max_creates_in_flight = inner.max_creates_in_flight.max(inner.creates_in_flight);
            inner.create_delay
        };
        tokio::time::sleep(delay).await;
        self.sim.lock().creates_in_flight -= 1;

        let (boot_delay, ends_failed, lose_reply) = {
            let mut inner = self.sim.lock();
            if take_fault(&mut inner.faults.fail_creates) {
                tracing::info!(%uid, "injected create failure");
                return Err(Status::unknown("creating microvm: saving microvm spec: injected failure"));
            }
            inner.vms.insert(uid.clone(), vm.clone());
            // Stored before the reply: a create the client saw survives a restart.
            if let Err(e) = inner.persist() {
                inner.vms.remove(&uid);
                tracing::error!(error = %e, "cannot write the state file");
                return Err(Status::unknown(format!("creating microvm: saving microvm spec: {e}")));
            }
            let lose_reply = take_fault(&mut inner.faults.lose_create_replies);
            let image = vm
                .spec
                .as_ref()
                .and_then(|s| s.root_volume.as_ref())
                .and_then(|r| r.source.as_ref())
                .and_then(|src| src.container_source.clone())
                .unwrap_or_default();
            let bad_image = inner.failing_images.iter().any(|p| image.contains(p.as_str()));
            (inner.next_boot_delay(), inner.faults.vms_end_failed || bad_image, lose_reply)
        };
        if let Some(spec) = vm.spec.as_ref() {
            let boot_delay_ms = boot_delay.as_millis() as u64;
            tracing::info!(%uid, namespace = %spec.namespace, id = %spec.id, boot_delay_ms, "microvm created (PENDING)");
        }
        self.sim.schedule_boot(uid, boot_delay, ends_failed);

        if lose_reply {
            return Err(Status::unavailable("injected: reply lost"));
        }
        Ok(Response::new(CreateMicroVmResponse { microvm: Some(vm) }))
    }

    async fn delete_micro_vm(&self, request: Request<DeleteMicroVmRequest>) -> Result<Response<()>, Status> {
        self.precheck(METHOD_DELETE, request.metadata())?;
        let uid = request.into_inner().uid;
        if uid.is_empty() {
            return Err(Status::invalid_argument("invalid request"));
        }
        let delay = {
            let mut inner = self.sim.lock();
            if take_fault(&mut inner.faults.fail_deletes) {
                return Err(Status::unknown("deleting microvm: injected failure"));
            }
            let Some(vm) = inner.vms.get_mut(&uid) else {
                return Err(Status::unknown(format!(
                    "deleting microvm: checking to see if spec exists: microvm spec //{uid} not found"
                )));
            };
            set_state(vm, MicroVmState::Deleting, 0);
            inner.persist_or_log();
            inner.delete_delay
        };
        tracing::info!(%uid, "microvm DELETING");
        self.sim.schedule_removal(uid, delay);
        Ok(Response::new(()))
    }

    async fn get_micro_vm(&self, request: Request<GetMicroVmRequest>) -> Result<Response<GetMicroVmResponse>, Status> {
        self.precheck(METHOD_GET, request.metadata())?;
        let uid = request.into_inner().uid;
        if uid.is_empty() {
            return Err(Status::invalid_argument("invalid request"));
        }
        let delay = self.sim.lock().get_delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        match self.sim.vm(&uid) {
            Some(vm) => Ok(Response::new(GetMicroVmResponse { microvm: Some(vm) })),
            None => Err(Status::unknown(format!(
                "getting microvm: error attempting to locate microvm with uid: {uid}: microvm spec //{uid} not found"
            ))),
        }
    }

    async fn list_micro_v_ms(
        &self,
        request: Request<ListMicroVMsRequest>,
    ) -> Result<Response<ListMicroVMsResponse>, Status> {
        self.precheck(METHOD_LIST, request.metadata())?;
        let req = request.into_inner();
        let name = req.name.as_deref().filter(|n| !n.is_empty());
        let microvm = self.list(&req.namespace, name);
        let delay = self.sim.lock().list_delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Ok(Response::new(ListMicroVMsResponse { microvm }))
    }

    type ListMicroVMsStreamStream = ListStream;

    async fn list_micro_v_ms_stream(
        &self,
        request: Request<ListMicroVMsRequest>,
    ) -> Result<Response<Self::ListMicroVMsStreamStream>, Status> {
        self.precheck(METHOD_LIST_STREAM, request.metadata())?;
        let req = request.into_inner();
        if req.namespace.is_empty() {
            return Err(Status::invalid_argument("invalid request"));
        }
        let messages = self.list(&req.namespace, None).into_iter().map(|vm| Ok(ListMessage { microvm: Some(vm) }));
        let stream: ListStream = Box::pin(futures::stream::iter(messages));
        Ok(Response::new(stream))
    }

    async fn server_info(&self, request: Request<()>) -> Result<Response<ServerInfoResponse>, Status> {
        self.precheck_gated(METHOD_SERVER_INFO, request.metadata(), |inner| {
            inner.exec.server_info_unimplemented.then(|| {
                Status::unimplemented("unknown method ServerInfo for service microvm.services.api.v1alpha1.MicroVM")
            })
        })?;
        let inner = self.sim.lock();
        let version = inner.exec.version.clone();
        let (build_date, commit_hash) = if version == "undefined" {
            ("undefined".to_string(), "undefined".to_string())
        } else {
            (BUILD_DATE.to_string(), COMMIT_HASH.to_string())
        };
        let uptime = inner.started_at.elapsed();
        let exec_enabled = inner.exec.enabled;
        let address =
            if exec_enabled { inner.listen_addr.map(|a| a.to_string()).unwrap_or_default() } else { String::new() };
        Ok(Response::new(ServerInfoResponse {
            version: Some(VersionInfo { version, build_date, commit_hash }),
            uptime: Some(prost_types::Duration {
                seconds: i64::try_from(uptime.as_secs()).unwrap_or(i64::MAX),
                nanos: i32::try_from(uptime.subsec_nanos()).unwrap_or(0),
            }),
            exec: Some(GuestAgentServiceInfo { enabled: exec_enabled, address }),
            ssh_proxy: Some(GuestAgentServiceInfo { enabled: false, address: String::new() }),
        }))
    }
}
