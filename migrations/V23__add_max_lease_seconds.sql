-- Issue 25 item 2: a pool may bound a lease's life. `max_lease_seconds` (NULL: unbounded, as
-- before): a lease is never extended past claimed_at + it, by its claim (the first deadline is
-- the lesser of heartbeat_expiry_seconds and it) or by a heartbeat (store::lease_heartbeat).
ALTER TABLE pools ADD COLUMN max_lease_seconds integer CHECK (max_lease_seconds >= 1);

-- V14's claim function, its first deadline bounded by max_lease_seconds; nothing else changes.
CREATE OR REPLACE FUNCTION lease_claim(p_namespace text, p_name text, p_lease_id text, p_request_id text, p_principal text)
RETURNS lease_claim_result
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    r lease_claim_result;
    expiry integer;
    slot smallint;
    vm_host text;
    existing_vm_id text;
    -- What a claim never needs of its VM's host: it answers with the host's name and address
    -- and calls no flintlock (a hook claim reads the whole host in store::vm_claim_for_hook).
    host_credentials constant text[] := ARRAY['ca_pem', 'cert_pem', 'key_pem', 'basic_auth_token'];
BEGIN
    r.db_now := now();
    r.pool_found := false;
    r.has_hooks := false;
    SELECT least(p.heartbeat_expiry_seconds, coalesce(p.max_lease_seconds, p.heartbeat_expiry_seconds)),
           cardinality(p.pre_lease_commands) > 0
      INTO expiry, r.has_hooks
      FROM pools p WHERE p.namespace = p_namespace AND p.name = p_name;
    IF NOT FOUND THEN
        r.has_hooks := false;
        RETURN r;
    END IF;
    r.pool_found := true;

    -- The replay: the lease this principal's request_id already created, on any pool. One
    -- probe of leases_principal_request_id, skipped for a claim without request_id: a
    -- statement on leases alone, so no other index of leases can serve it (V12).
    IF p_request_id IS NOT NULL THEN
        SELECT to_jsonb(l), l.vm_id INTO r.existing_lease, existing_vm_id
          FROM leases l
         WHERE l.principal = p_principal AND l.request_id = p_request_id;
        IF FOUND THEN
            SELECT to_jsonb(v), v.flintlock_host INTO r.existing_vm, vm_host FROM vms v WHERE v.id = existing_vm_id;
            SELECT to_jsonb(h) - host_credentials INTO r.existing_host FROM hosts h WHERE h.name = vm_host;
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
    SELECT to_jsonb(h) - host_credentials INTO r.host FROM hosts h WHERE h.name = vm_host;
    INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
    VALUES ('VM_CLAIMED', p_namespace, p_name, r.picked, p_lease_id);
    RETURN r;
END
$$;
