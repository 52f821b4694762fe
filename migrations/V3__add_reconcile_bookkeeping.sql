-- Bookkeeping for the reconcile pass, kept in the database so passes stay stateless and
-- any number of them may overlap.

-- The expires_at value a VM_EXPIRING_SOON warning was last written for: one warning per
-- expiry deadline, and a heartbeat (which moves expires_at) re-arms it.
ALTER TABLE leases ADD COLUMN warned_expires_at timestamptz;

-- Orphan scans run per host; this row lease keeps overlapping passes from scanning the same
-- host at once and spaces scans out.
ALTER TABLE hosts ADD COLUMN scan_until timestamptz NOT NULL DEFAULT '-infinity';

-- Pools whose reconcile lease is free, oldest first.
CREATE INDEX pools_reconcile_until ON pools (reconcile_until);
-- Work the pass looks for across pools: deletions and provisioning, by due time.
CREATE INDEX vms_phase_due ON vms (phase, next_attempt_at)
    WHERE phase IN ('DELETING', 'PROVISIONING', 'CREATE_HOOK_RUNNING');
