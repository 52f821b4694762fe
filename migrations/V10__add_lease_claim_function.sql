-- The claim as a server-side function (issue 12 section 4; docs/design-notes.md, "Issue 12
-- section 4").
--
-- On Lambda every claim goes through RDS Proxy, which cannot keep a client's named prepared
-- statement, so the claim used to be sent as text and planned on every call: planning cost
-- as much as running it. PL/pgSQL prepares each statement of a function the first time a
-- server connection runs it and keeps the plan for that connection's life, whichever client
-- the pooler lends the connection to: the client now sends `SELECT * FROM lease_claim(...)`,
-- which is cheap to plan, and the expensive plans are made once per server connection.
--
-- A kept plan has a hazard: one made while `leases` was analyzed empty scans it sequentially,
-- and keeps doing so as the table grows, until the next ANALYZE. `enable_seqscan = off`,
-- scoped to the two functions below by their SET clauses, leaves the planner no sequential
-- scan it would choose over an index: every lookup here has one (the replay lookup: the
-- unique index leases_principal_request_id; the pick: vms_pool_available; the rest: primary
-- keys), so no statistics can make a claim scan a table.
CREATE TYPE lease_claim_result AS (
    -- false: no such pool; nothing else is set.
    pool_found     boolean,
    has_hooks      boolean,
    -- The VM this claim picked (row locked), NULL when none was free.
    picked         text,
    -- Set when the claim took the VM: to_jsonb of the new lease, the VM and its host.
    lease          jsonb,
    vm             jsonb,
    host           jsonb,
    -- Set when the request_id already had a lease (a replay; maybe on another pool, maybe
    -- expired but not yet swept): nothing was claimed.
    existing_lease jsonb,
    existing_vm    jsonb,
    existing_host  jsonb,
    -- The database's clock, for the caller's "is that lease still live" check.
    db_now         timestamptz
);

-- One AVAILABLE VM of the pool, row locked FOR NO KEY UPDATE until the caller's transaction
-- ends, or NULL when every one is gone or locked. The one definition of the pick: the claim
-- (lease_claim) and the first transaction of a hook claim (store::vm_claim_for_hook) call it.
--
-- SKIP LOCKED: concurrent claimers each take a different row instead of queueing on the
-- first. NO KEY UPDATE: the key never changes, so the lock is no stronger than needed. Slots
-- (V5): the scan starts at a random claim_slot and wraps around, so N concurrent claimers
-- start in different places of vms_pool_available instead of all stepping over the same N-1
-- locked rows at its head; within a slot the oldest VM goes first. The low half is scanned
-- only when the high half had no free row.
CREATE FUNCTION vm_pick_available(p_namespace text, p_name text)
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
     ORDER BY v.claim_slot, v.created_at
     LIMIT 1
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT v.id INTO picked FROM vms v
         WHERE v.pool_namespace = p_namespace AND v.pool_name = p_name AND v.phase = 'AVAILABLE'
           AND v.claim_slot < slot
         ORDER BY v.claim_slot, v.created_at
         LIMIT 1
           FOR NO KEY UPDATE SKIP LOCKED;
    END IF;
    RETURN picked;
END
$$;

-- p_request_id NULL: a claim without request_id (never a replay). What each outcome means to
-- the caller is store::lease_claim's (functions/core/src/store/claim.rs).
CREATE FUNCTION lease_claim(p_namespace text, p_name text, p_lease_id text, p_request_id text, p_principal text)
RETURNS lease_claim_result
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    r lease_claim_result;
    expiry integer;
    slot smallint;
    vm_host text;
BEGIN
    r.db_now := now();
    r.pool_found := false;
    r.has_hooks := false;
    SELECT p.heartbeat_expiry_seconds, cardinality(p.pre_lease_commands) > 0
      INTO expiry, r.has_hooks
      FROM pools p WHERE p.namespace = p_namespace AND p.name = p_name;
    IF NOT FOUND THEN
        r.has_hooks := false;
        RETURN r;
    END IF;
    r.pool_found := true;

    -- The replay: the lease this principal's request_id already created, on any pool. One
    -- probe of leases_principal_request_id, skipped for a claim without request_id.
    IF p_request_id IS NOT NULL THEN
        SELECT to_jsonb(l), to_jsonb(v), to_jsonb(h)
          INTO r.existing_lease, r.existing_vm, r.existing_host
          FROM leases l
          LEFT JOIN vms v ON v.id = l.vm_id
          LEFT JOIN hosts h ON h.name = v.flintlock_host
         WHERE l.principal = p_principal AND l.request_id = p_request_id;
        IF FOUND THEN
            RETURN r;
        END IF;
    END IF;
    -- Pools with pre-lease hooks claim in two phases (store::vm_claim_for_hook).
    IF r.has_hooks THEN
        RETURN r;
    END IF;

    r.picked := vm_pick_available(p_namespace, p_name);
    IF r.picked IS NULL THEN
        RETURN r;
    END IF;

    -- The lease first: when the request_id index rejects it (a concurrent claim of the same
    -- request_id committed first), nothing is changed and the picked VM stays AVAILABLE. The
    -- conflict target repeats the partial index's predicate so PostgreSQL infers
    -- leases_principal_request_id as the arbiter; a concurrent insert of the same key makes
    -- this wait for that transaction, then do nothing.
    INSERT INTO leases AS l (lease_id, vm_id, pool_namespace, pool_name, claimed_at,
                             last_heartbeat_at, expires_at, request_id, principal)
    VALUES (p_lease_id, r.picked, p_namespace, p_name, now(), now(),
            now() + make_interval(secs => expiry), p_request_id, p_principal)
    ON CONFLICT (principal, request_id) WHERE request_id IS NOT NULL DO NOTHING
    RETURNING to_jsonb(l) INTO r.lease;
    IF NOT FOUND THEN
        RETURN r;
    END IF;
    UPDATE vms v SET phase = 'LEASED', lease_id = p_lease_id, updated_at = now()
     WHERE v.id = r.picked
    RETURNING to_jsonb(v), v.flintlock_host INTO r.vm, vm_host;
    SELECT to_jsonb(h) INTO r.host FROM hosts h WHERE h.name = vm_host;
    INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
    VALUES ('VM_CLAIMED', p_namespace, p_name, r.picked, p_lease_id);
    RETURN r;
END
$$;
