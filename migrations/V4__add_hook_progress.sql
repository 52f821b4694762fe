-- Hooks (create_commands, pre_lease_commands) run through flintlock's guest agent.

-- Progress of a VM's hook: the next create command to run, and when the current hook
-- started (CREATE_HOOK_RUNNING: bounds the wait for the guest agent; PRE_LEASE_HOOK_RUNNING:
-- lets the reconciler recover a claim whose function died mid-hook).
ALTER TABLE vms ADD COLUMN hook_step integer NOT NULL DEFAULT 0;
ALTER TABLE vms ADD COLUMN hook_started_at timestamptz;

-- What the last ServerInfo probe of a host said, shown in the host's status.
ALTER TABLE hosts ADD COLUMN flintlock_version text;
ALTER TABLE hosts ADD COLUMN exec_unavailable_reason text;
ALTER TABLE hosts ADD COLUMN checked_at timestamptz;
