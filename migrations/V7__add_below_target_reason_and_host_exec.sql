-- Issue 14: a bounded QUARANTINE pool, and an admin's say over a host's exec support.

-- Why the reconciler is holding a pool below its target (quarantined VMs fill it, no
-- eligible host), NULL while nothing holds it back. POOL_SIZE_BELOW_TARGET is written when
-- this changes to a new reason, so a pool stuck for hours writes one event, not one a pass.
ALTER TABLE pools ADD COLUMN below_target_reason text;

-- What the exec gate (a pool with hooks may only name hosts that can exec) believes about
-- this host: 'auto' asks its ServerInfo, 'enabled' / 'disabled' is an admin's override for a
-- flintlockd whose ServerInfo answer we cannot read (its field numbers are unpublished).
ALTER TABLE hosts ADD COLUMN exec text NOT NULL DEFAULT 'auto'
    CONSTRAINT hosts_exec_check CHECK (exec IN ('auto', 'enabled', 'disabled'));
