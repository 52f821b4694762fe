-- Issue 15: a settled reconcile pass costs O(work), not O(pools). The selection no longer
-- counts every VM of every pool; it counts only the pools some signal names
-- (`store::pool_list_with_work`):
--
-- * the pools row itself (a changed spec, a reason for being below target, a step since the
--   watermark), one scan of `pools`;
-- * leases to expire or warn about: a range of leases_expires_at, global;
-- * VMs due (deleting, provisioning, create hooks: vms_phase_due, V3) and claims abandoned
--   mid pre-lease hook (vms_pre_lease_hook_started), partial indexes over those phases only;
-- * changes to a pool's VMs since the watermark: a range of events_created_at (V8). Every
--   statement outside the pass that changes what a pool needs writes its event in the same
--   statement, stamped now() (the transaction's start): a claim (VM_CLAIMED, V10), a
--   discard, a quarantine, a release's removal of the VM row, an expiry, a pool's delete.
--   Events, not vms.updated_at: a removed row leaves no updated_at behind, and an index on
--   updated_at would be one more entry on every claim;
-- * and a bounded number of pools per pass checked in full whatever the signals say, in key
--   order from a cursor, so a transition no signal covers is found within a bounded number
--   of passes.

-- One row: what the passes have seen so far.
CREATE TABLE reconcile_selection (
    id                boolean     PRIMARY KEY DEFAULT true CHECK (id),
    -- Every VM write and every pool step before this was seen by a pass that went on to
    -- lease every pool it selected: the next selection looks at what changed from here on
    -- (less a margin). A pass start, held back by the oldest transaction open at that start.
    seen_through      timestamptz NOT NULL DEFAULT '-infinity',
    -- The key of the last pool checked in full: the next pass continues after it.
    checked_namespace text        NOT NULL DEFAULT '',
    checked_name      text        NOT NULL DEFAULT '',
    updated_at        timestamptz NOT NULL DEFAULT now()
);
INSERT INTO reconcile_selection DEFAULT VALUES;

-- Leases due, across pools (V5 dropped the global index for the claim's sake; the selection
-- needs it back: one more index entry per claim and per heartbeat, see design-notes.md).
CREATE INDEX leases_expires_at ON leases (expires_at);

-- Claims abandoned mid pre-lease hook, across pools.
CREATE INDEX vms_pre_lease_hook_started ON vms (hook_started_at) WHERE phase = 'PRE_LEASE_HOOK_RUNNING';
