-- Revisions (issue 24 item 1; docs/design-notes.md "Issue 24: rollouts").
--
-- A pool's revision is bumped by a change of a field that shapes its warm VMs
-- (microvm_template, create_commands); size, pre_lease_commands (run at claim time) and the
-- policies do not bump it. Every VM records the revision it was created from. The last 10
-- revisions are kept with the spec that created them (store::pool_update trims the rest).
ALTER TABLE pools ADD COLUMN revision integer NOT NULL DEFAULT 1;
ALTER TABLE vms ADD COLUMN revision integer NOT NULL DEFAULT 1;

-- rolled_out: every warm VM of the pool was of this revision at some point after it was
-- created (a pool's first revision is, by definition).
CREATE TABLE pool_revisions (
    namespace  text        NOT NULL,
    name       text        NOT NULL,
    revision   integer     NOT NULL,
    spec       jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    rolled_out boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (namespace, name, revision),
    FOREIGN KEY (namespace, name) REFERENCES pools (namespace, name) ON DELETE CASCADE
);

-- The existing pools' revision 1: their spec as the API writes it (domain::PoolSpec).
INSERT INTO pool_revisions (namespace, name, revision, spec, created_at, rolled_out)
SELECT namespace, name, 1,
       jsonb_build_object(
           'namespace', namespace, 'name', name, 'size', size,
           'flintlock_hosts', to_jsonb(flintlock_hosts),
           'replenishment', jsonb_strip_nulls(jsonb_build_object('strategy', strategy, 'min_size', min_size)),
           'microvm_template', microvm_template,
           'create_commands', to_jsonb(create_commands),
           'pre_lease_commands', to_jsonb(pre_lease_commands),
           'hook_failure_policy', hook_failure_policy,
           'heartbeat_interval_seconds', heartbeat_interval_seconds,
           'heartbeat_expiry_seconds', heartbeat_expiry_seconds)
       || CASE WHEN autoscaling IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('autoscaling', autoscaling) END,
       created_at, true
FROM pools;
