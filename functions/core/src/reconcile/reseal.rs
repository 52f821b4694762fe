//! Hosts' secrets brought under the current credentials key (issue 25 item 4,
//! [`crate::credentials`]): a row sealed under an old key gets its data key re-wrapped, a row
//! stored in plaintext before encryption existed is sealed. Each pass looks at the host rows
//! it read at its start and writes only those that need it, each in one compare-and-set
//! statement: a host write in between wins and the next pass looks again.
//!
//! Never writes a row it cannot open (a key this function does not hold): the pass skips
//! such a host and says which key is missing ([`unreadable_hosts`]). Never seals a plaintext
//! row in the first 15 minutes after the migration that made sealing possible (V24's
//! `deployment.seal_host_credentials_from`): functions of the version before may still be
//! running during the deploy, and would send a ciphertext as the host's token.
//!
//! [`unreadable_hosts`]: unreadable_hosts

use super::PassReport;
use crate::app::AppState;
use crate::store::{self, HostRow};

/// The hosts whose stored secrets this function cannot open, with why (it lacks the key the
/// row names, or the row was altered). The pass skips them as it skips a sick host: no call,
/// no placement, no step of their VMs, so no VM fails or is taken for lost, and the host is
/// never judged unreachable for it; a function that holds the key steps them.
pub(super) fn unreadable_hosts(state: &AppState, hosts: &[HostRow]) -> Vec<(String, String)> {
    let keyring = &state.config.credentials;
    hosts
        .iter()
        .filter_map(|h| keyring.open(&h.name, &h.stored_credentials()).err().map(|e| (h.name.clone(), e.to_string())))
        .collect()
}

pub(super) async fn reseal_credentials(state: &AppState, hosts: &[HostRow]) -> PassReport {
    let mut report = PassReport::default();
    let keyring = &state.config.credentials;
    for host in hosts {
        let stored = host.stored_credentials();
        let new = match keyring.reseal(&host.name, &stored) {
            Ok(Some(new)) => new,
            Ok(None) => continue,
            // Reported at the pass's start (`unreadable_hosts`).
            Err(_) => continue,
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
            // Changed since the pass read it, or a plaintext row within the upgrade's grace:
            // the next pass looks again.
            Ok(false) => {}
            Err(e) => report.errors.push(format!("re-sealing host {}'s credentials: {e}", host.name)),
        }
    }
    report
}
