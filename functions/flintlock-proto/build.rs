//! Generates the flintlock gRPC bindings from the trimmed protos in `proto/`.
//!
//! protoc comes from `protoc-bin-vendored`, so no system protoc is needed. The
//! protoc path is handed to prost-build through its `Config` rather than the
//! `PROTOC` environment variable, which keeps this script free of `unsafe`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("proto");
    let protos = [
        proto_root.join("types/microvm.proto"),
        proto_root.join("services/microvm/v1alpha1/microvms.proto"),
        proto_root.join("services/microvmexec/v1alpha1/microvmexec.proto"),
    ];

    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let wkt_include = protoc_bin_vendored::include_path()?;

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", proto_root.display());
    for proto in &protos {
        println!("cargo:rerun-if-changed={}", proto.display());
    }

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);

    tonic_prost_build::configure().build_server(true).build_client(true).compile_with_config(
        config,
        &protos,
        &[proto_root, wkt_include],
    )?;
    Ok(())
}
