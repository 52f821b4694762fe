//! Hosts' secrets brought under the current credentials key (issue 25 item 4,
//! [`crate::credentials`]): a row sealed under an old key gets its data key re-wrapped, a row
//! stored in plaintext before encryption existed is sealed. Each pass looks at the host rows
//! it read at its start and writes only those that need it, each in one compare-and-set
//! statement: a host write in between wins and the next pass looks again.
//!
//! Never writes a row it cannot open (a key this function does not hold): it says which key
//! is missing and leaves the row as it is.

use super::PassReport;
use crate::app::AppState;
use crate::store::{self, HostRow};

pub(super) async fn reseal_credentials(state: &AppState, hosts: &[HostRow]) -> PassReport {
    let mut report = PassReport::default();
    let keyring = &state.config.credentials;
    for host in hosts {
        let stored = host.stored_credentials();
        let new = match keyring.reseal(&host.name, &stored) {
            Ok(Some(new)) => new,
            Ok(None) => continue,
            Err(e) => {
                report.errors.push(format!("re-sealing host credentials: {e}"));
                continue;
            }
        };
        let written = match state.db.get().await {
            Ok(c) => store::host_reseal_credentials(&c, &host.name, &stored, &new).await,
            Err(e) => Err(e),
        };
        match written {
            Ok(true) => {
                report.credentials_resealed += 1;
                tracing::info!(
                    host = %host.name,
                    from_key = stored.key_id.as_deref().unwrap_or("plaintext"),
                    to_key = new.key_id.as_deref().unwrap_or_default(),
                    "host credentials sealed under the current key"
                );
            }
            // Changed since the pass read it: the next pass looks again.
            Ok(false) => {}
            Err(e) => report.errors.push(format!("re-sealing host {}'s credentials: {e}", host.name)),
        }
    }
    report
}
