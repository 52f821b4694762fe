-- Rollouts (issue 24 items 2-5; docs/design-notes.md "Issue 24: rollouts").
--
-- rollout: the pool's rollout policy (domain::RolloutPolicy), NULL without one (a template
-- change then applies to new VMs only, as before). The rest is the state of the pool's last
-- rollout, stepped by the reconcile pass (reconcile::rollout): NULL state when none ever ran.
-- rollout_event_id is its ROLLOUT_STARTED event: the failures and progress it counts are the
-- pool's events after it (events_pool_id, events_pool_available).
ALTER TABLE pools
    ADD COLUMN rollout jsonb,
    ADD COLUMN rollout_state text
        CHECK (rollout_state IN ('PROGRESSING', 'PAUSED', 'HALTED', 'ROLLED_BACK', 'COMPLETE')),
    ADD COLUMN rollout_from integer,
    ADD COLUMN rollout_event_id bigint,
    ADD COLUMN rollout_started_at timestamptz,
    ADD COLUMN rollout_extra_boots integer NOT NULL DEFAULT 0,
    ADD COLUMN rollout_halted_reason text;

-- Claims prefer the current revision's VMs while a rollout has not finished
-- (rollout.claim_preference CURRENT, the default): the same pick as V17 (slots, unreachable
-- hosts skipped), first among the VMs of the pool's revision, then among all. A pool without
-- a rollout costs one more primary-key read of its row.
CREATE OR REPLACE FUNCTION vm_pick_available(p_namespace text, p_name text)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    slot smallint := floor(random() * 64)::smallint;
    picked text;
    want integer;
BEGIN
    SELECT p.revision INTO want FROM pools p
     WHERE p.namespace = p_namespace AND p.name = p_name
       AND p.rollout_state IN ('PROGRESSING', 'PAUSED', 'HALTED', 'ROLLED_BACK')
       AND coalesce(p.rollout->>'claim_preference', 'CURRENT') = 'CURRENT';
    IF want IS NOT NULL THEN
        SELECT v.id INTO picked FROM vms v
         WHERE v.pool_namespace = p_namespace AND v.pool_name = p_name AND v.phase = 'AVAILABLE'
           AND v.revision = want
           AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.name = v.flintlock_host AND h.unreachable_since IS NOT NULL)
         ORDER BY (v.claim_slot < slot), v.claim_slot, v.created_at
         LIMIT 1
           FOR NO KEY UPDATE OF v SKIP LOCKED;
        IF FOUND THEN
            RETURN picked;
        END IF;
    END IF;
    SELECT v.id INTO picked FROM vms v
     WHERE v.pool_namespace = p_namespace AND v.pool_name = p_name AND v.phase = 'AVAILABLE'
       AND v.claim_slot >= slot
       AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.name = v.flintlock_host AND h.unreachable_since IS NOT NULL)
     ORDER BY v.claim_slot, v.created_at
     LIMIT 1
       FOR NO KEY UPDATE OF v SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT v.id INTO picked FROM vms v
         WHERE v.pool_namespace = p_namespace AND v.pool_name = p_name AND v.phase = 'AVAILABLE'
           AND v.claim_slot < slot
           AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.name = v.flintlock_host AND h.unreachable_since IS NOT NULL)
         ORDER BY v.claim_slot, v.created_at
         LIMIT 1
           FOR NO KEY UPDATE OF v SKIP LOCKED;
    END IF;
    RETURN picked;
END
$$;

-- The selection steps every pool whose rollout is under way (a ROLLED_BACK one until its
-- rollback finished: store::rollout_complete clears rollout_event_id).
CREATE INDEX pools_rolling ON pools (namespace, name)
    WHERE rollout_state IN ('PROGRESSING', 'ROLLED_BACK') AND rollout_event_id IS NOT NULL;
