-- rollout.claim_preference ANY (issue 24): the client does not mind which revision it gets,
-- so a claim takes a stale VM first (another revision than the pool's, oldest first) while a
-- rollout runs. A stale VM that is claimed is gone anyway, and its replacement boots on the new
-- revision: a busy pool rolls by its own claims at no extra boot (reconcile::rollout counts on
-- them for the window). CURRENT keeps V19's pick: the pool's revision first.
CREATE OR REPLACE FUNCTION vm_pick_available(p_namespace text, p_name text)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    slot smallint := floor(random() * 64)::smallint;
    picked text;
    want integer;
    pref text;
BEGIN
    SELECT p.revision, coalesce(p.rollout->>'claim_preference', 'CURRENT') INTO want, pref FROM pools p
     WHERE p.namespace = p_namespace AND p.name = p_name
       AND p.rollout_state IN ('PROGRESSING', 'PAUSED', 'HALTED', 'ROLLED_BACK');
    IF want IS NOT NULL AND pref = 'CURRENT' THEN
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
    ELSIF want IS NOT NULL THEN
        SELECT v.id INTO picked FROM vms v
         WHERE v.pool_namespace = p_namespace AND v.pool_name = p_name AND v.phase = 'AVAILABLE'
           AND v.revision <> want
           AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.name = v.flintlock_host AND h.unreachable_since IS NOT NULL)
         ORDER BY v.created_at, v.id
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
