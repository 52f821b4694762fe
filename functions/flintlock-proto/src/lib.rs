//! Rust bindings for flintlock's MicroVM gRPC API (wire contract of flintlock
//! v0.11.0, plus the later `ServerInfo` RPC and the `MicroVMExec` service),
//! generated at build time from the trimmed protos in `proto/`.
//!
//! - [`types`] is proto package `flintlock.types` (the domain messages).
//! - [`v1alpha1`] is proto package `microvm.services.api.v1alpha1` (the
//!   `MicroVM` service, its request/response wrappers, the tonic client
//!   [`v1alpha1::micro_vm_client::MicroVmClient`] and the server trait
//!   [`v1alpha1::micro_vm_server::MicroVm`] /
//!   [`v1alpha1::micro_vm_server::MicroVmServer`]). It includes
//!   `ServerInfo` (flintlock v0.15.0+), whose field numbers are unverified
//!   (declaration order, see the proto).
//! - [`exec`] is proto package `microvmexec.services.api.v1alpha1` (the
//!   bidi-streaming `MicroVMExec/ExecCommand` service of flintlock v0.13.0+,
//!   client [`exec::micro_vm_exec_client::MicroVmExecClient`], server
//!   [`exec::micro_vm_exec_server::MicroVmExecServer`]).
//!
//! The modules are nested like the proto packages so that the generated
//! cross-package paths (`super::super::...`) resolve.

/// Proto package `flintlock`.
pub mod flintlock {
    /// Proto package `flintlock.types`.
    pub mod types {
        tonic::include_proto!("flintlock.types");
    }
}

/// Proto package `microvm`.
pub mod microvm {
    /// Proto package `microvm.services`.
    pub mod services {
        /// Proto package `microvm.services.api`.
        pub mod api {
            /// Proto package `microvm.services.api.v1alpha1`.
            pub mod v1alpha1 {
                tonic::include_proto!("microvm.services.api.v1alpha1");
            }
        }
    }
}

/// Proto package `microvmexec`.
pub mod microvmexec {
    /// Proto package `microvmexec.services`.
    pub mod services {
        /// Proto package `microvmexec.services.api`.
        pub mod api {
            /// Proto package `microvmexec.services.api.v1alpha1`.
            pub mod v1alpha1 {
                tonic::include_proto!("microvmexec.services.api.v1alpha1");
            }
        }
    }
}

pub use flintlock::types;
pub use microvm::services::api::v1alpha1;
pub use microvmexec::services::api::v1alpha1 as exec;
