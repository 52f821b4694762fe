//! `pg-test-certs DIR`: writes a fresh test CA (`ca.pem`) and a server certificate for
//! `localhost` it signed (`server.crt`, `server.key`) into DIR, for the TLS test server that
//! `scripts/test.sh` starts. Test use only.

fn main() -> std::process::ExitCode {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: pg-test-certs DIR");
        return std::process::ExitCode::from(2);
    };
    match poolmgr_tests::tls::write_server_files(std::path::Path::new(&dir)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pg-test-certs: cannot write the certificates into {}: {e}", dir.to_string_lossy());
            std::process::ExitCode::FAILURE
        }
    }
}
