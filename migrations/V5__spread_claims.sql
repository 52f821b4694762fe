-- Claims under high concurrency (scripts/bench-claims.sh, docs/benchmarks.md).
--
-- With every claimer scanning the AVAILABLE index from its head, N concurrent claimers each
-- step over up to N-1 rows locked by the others (SKIP LOCKED checks each one in the lock
-- manager), so a claim costs O(N) and 256 connections spent their time on LWLock:LockManager:
-- throughput fell to about a third of its peak. Each VM now gets a random claim slot; a claim
-- starts its scan at a random slot and wraps around, so concurrent claimers start in
-- different places of the index and rarely meet a locked row.
ALTER TABLE vms ADD COLUMN claim_slot smallint NOT NULL DEFAULT (floor(random() * 64))::smallint;

DROP INDEX vms_pool_available;
CREATE INDEX vms_pool_available ON vms (pool_namespace, pool_name, claim_slot, created_at)
    WHERE phase = 'AVAILABLE';

-- Every claim inserts a lease, and every index on leases is one more page to write and one
-- more relation to lock. The expiry scans are per pool (pool, expires_at), and the per-pool
-- lease listing only needs the pool prefix: one index serves both.
DROP INDEX leases_pool;
DROP INDEX leases_expires_at;
CREATE INDEX leases_pool_expires_at ON leases (pool_namespace, pool_name, expires_at);

-- The hot tables churn: every claim updates a vms row and inserts a lease and an event; every
-- release deletes a vms row and a lease. The defaults (vacuum after 20% of the table is dead)
-- let a pool's index fill with dead entries that every claim scan must step over; vacuum
-- these after a fixed number of changes instead, and vacuum the append-only events table
-- often enough that its visibility map stays current.
ALTER TABLE vms SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 500,
                     autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE leases SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 500,
                        autovacuum_vacuum_insert_scale_factor = 0.05);
ALTER TABLE events SET (autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);
