-- The claim statement as of commit 20f4ecb (schema V4, before the claim-slot change of V5),
-- generated then by `poolmgr-bench pgbench-script --mode claim`. Used by
-- `scripts/bench-claims.sh --claim-sql` for the "before" side of docs/benchmarks.md.
-- Define ns, pool and principal with pgbench -D.
\set lid random(1, 9000000000000000000)
\set rid random(1, 9000000000000000000)
WITH pool AS (
         SELECT namespace, name, heartbeat_expiry_seconds,
                cardinality(pre_lease_commands) > 0 AS has_hooks
         FROM pools WHERE namespace = :ns AND name = :pool
     ), existing AS (
         SELECT * FROM leases WHERE :rid::text IS NOT NULL AND principal = :principal AND request_id = :rid
     ), picked AS (
         SELECT v.id FROM vms v
         WHERE v.pool_namespace = :ns AND v.pool_name = :pool AND v.phase = 'AVAILABLE'
           AND NOT EXISTS (SELECT 1 FROM existing)
           AND NOT (SELECT has_hooks FROM pool)
         ORDER BY v.created_at
         LIMIT 1
         FOR NO KEY UPDATE SKIP LOCKED
     ), ins AS (
         INSERT INTO leases (lease_id, vm_id, pool_namespace, pool_name, claimed_at,
                             last_heartbeat_at, expires_at, request_id, principal)
         SELECT :lid, picked.id, pool.namespace, pool.name, now(), now(),
                now() + make_interval(secs => pool.heartbeat_expiry_seconds), :rid, :principal
         FROM picked, pool
         ON CONFLICT (principal, request_id) WHERE request_id IS NOT NULL DO NOTHING
         RETURNING *
     ), upd AS (
         UPDATE vms v SET phase = 'LEASED', lease_id = ins.lease_id, updated_at = now()
         FROM ins WHERE v.id = ins.vm_id
         RETURNING v.*
     ), ev AS (
         INSERT INTO events (type, pool_namespace, pool_name, vm_id, lease_id)
         SELECT 'VM_CLAIMED', ins.pool_namespace, ins.pool_name, ins.vm_id, ins.lease_id FROM ins
     )
     SELECT EXISTS (SELECT 1 FROM pool) AS pool_found, picked.id AS picked,
            coalesce((SELECT has_hooks FROM pool), false) AS has_hooks,
            to_jsonb(ins) AS lease, to_jsonb(upd) AS vm, to_jsonb(h) AS host,
            to_jsonb(e) AS existing_lease, to_jsonb(ev_vm) AS existing_vm, to_jsonb(ev_h) AS existing_host
     FROM (SELECT 1) AS one
     LEFT JOIN picked ON true
     LEFT JOIN ins ON true
     LEFT JOIN upd ON true
     LEFT JOIN hosts h ON h.name = upd.flintlock_host
     LEFT JOIN existing e ON true
     LEFT JOIN vms ev_vm ON ev_vm.id = e.vm_id
     LEFT JOIN hosts ev_h ON ev_h.name = ev_vm.flintlock_host;
