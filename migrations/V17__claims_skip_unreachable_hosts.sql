-- A claim never picks a VM on a host that a call found unreachable and none has reached since
-- (hosts.unreachable_since, V16; issue 23 finding 1, docs/design-notes.md "Issue 23: faults").
--
-- Such a host may have rebooted without its microVMs, and its VMs cannot be checked until it
-- answers again: the reconciler's first call that reaches it clears the mark and makes its
-- orphan scan due at once, which removes the rows whose microVMs it lost (VM_LOST). A claim
-- on a pool whose every AVAILABLE VM is on such hosts finds none (429), as it would after the
-- dead-host judgement retired them. The same pick as V10 otherwise: the host is looked up by
-- its primary key for each candidate row.
CREATE OR REPLACE FUNCTION vm_pick_available(p_namespace text, p_name text)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    slot smallint := floor(random() * 64)::smallint;
    picked text;
BEGIN
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
