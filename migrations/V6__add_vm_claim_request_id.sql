-- Idempotent claims of pools with pre-lease hooks (issue 14, item 1).
--
-- A hook claim commits its first transaction (VM → PRE_LEASE_HOOK_RUNNING) long before its
-- lease exists, so the leases index cannot tell a duplicate that the request_id is taken. The
-- claim now writes its (principal, request_id) on the VM it took, and this index makes that
-- the guard while the hook runs: a second first-transaction with the same key waits for the
-- first and then fails instead of taking a second VM and running the hook again. The
-- predicate names the phase, so the key stops counting the moment the VM leaves
-- PRE_LEASE_HOOK_RUNNING (LEASED, AVAILABLE again, DELETING, QUARANTINED): no cleanup needed,
-- and the values left on the row afterwards are history only.
ALTER TABLE vms ADD COLUMN claim_principal text;
ALTER TABLE vms ADD COLUMN claim_request_id text;

CREATE UNIQUE INDEX vms_hook_claim_request_id ON vms (claim_principal, claim_request_id)
    WHERE phase = 'PRE_LEASE_HOOK_RUNNING' AND claim_request_id IS NOT NULL;
