-- Issue 22: a pool refills in seconds where it is deployed, and sizes itself to the traffic
-- (docs/design-notes.md, "Issue 22: demand").

-- The reconcile loop's lease: one row. An invocation of the reconcile function (the schedule,
-- a claim's wake, a loop's own hand-off) that takes it keeps passing while there is work,
-- and for a linger after it; one that finds it held asks the holder to keep going
-- (`asked_at`, `wake_until`: store::loop_*) and returns. So however many wakes arrive, one
-- invocation at a time loops, and a wake is never lost: the holder gives the lease back only
-- in a statement that also checks that no ask came after its last pass started and that
-- `wake_until` has passed. The holder renews the lease every few seconds while it works, so a
-- holder that died is replaced within seconds.
CREATE TABLE reconcile_loop (
    id         boolean     PRIMARY KEY DEFAULT true CHECK (id),
    owner      text,
    -- The holder's lease: past it, the holder is taken to be gone (a timed-out invocation).
    until      timestamptz NOT NULL DEFAULT '-infinity',
    -- Somebody asked for passes until then (a wake that found the lease held).
    wake_until timestamptz NOT NULL DEFAULT '-infinity',
    -- The last ask: the holder owes a pass that starts after it.
    asked_at   timestamptz NOT NULL DEFAULT '-infinity',
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO reconcile_loop DEFAULT VALUES;

-- The autoscaling policy as the API gave it (NULL: off, `size` is the target as before), the
-- size the pool works towards while it is set (NULL without a policy: `size`), and what the
-- sizing step keeps between passes (reconcile::sizing): the reason of the last decision, the
-- recommendations of the stabilization window, the measured rates.
ALTER TABLE pools
    ADD COLUMN autoscaling  jsonb,
    ADD COLUMN desired_size integer CHECK (desired_size BETWEEN 0 AND 10000),
    ADD COLUMN scaling      jsonb,
    -- Announced demand (POST …/expect): this many claims expected until `expected_until`,
    -- counted from `expected_at`. Without autoscaling it only wakes the reconciler.
    ADD COLUMN expected_claims integer,
    ADD COLUMN expected_at     timestamptz,
    ADD COLUMN expected_until  timestamptz;

-- The sizing step's candidates without a scan of `pools` (store::demand_list): autoscaled
-- pools whose last decision says to look again (demand measured, busy VMs, a size above the
-- floor) or with a hint; the others are found through recent claims and refusals.
CREATE INDEX pools_scaling_active ON pools (namespace, name)
    WHERE autoscaling IS NOT NULL AND (scaling IS NULL OR scaling->>'active' = 'true' OR expected_until IS NOT NULL);

-- Claims refused with 429, one row per (pool, request): a client retrying the same request_id
-- is one arrival, not one per retry. Demand is invisible exactly when the pool is empty unless
-- refused claims count. Pruned by the sizing step past the demand window.
CREATE TABLE pool_refused_claims (
    pool_namespace text        NOT NULL,
    pool_name      text        NOT NULL,
    request_key    text        NOT NULL,
    refused_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool_namespace, pool_name, request_key)
);
CREATE INDEX pool_refused_claims_at ON pool_refused_claims (refused_at);
-- A pool's refusals of the window, without reading the rest of what it kept.
CREATE INDEX pool_refused_claims_pool_at ON pool_refused_claims (pool_namespace, pool_name, refused_at);

-- Whether any pool is autoscaled at all, without a scan of `pools` (the sizing step reads
-- nothing else when none is).
CREATE INDEX pools_autoscaling ON pools ((1)) WHERE autoscaling IS NOT NULL;

-- The provisioning time of a pool's recent VMs (the p90 of creation to AVAILABLE, from the
-- VM_AVAILABLE events' `provision_seconds`): the last few of one pool without reading its
-- other events. Written by the reconciler only, never on the claim path.
CREATE INDEX events_pool_available ON events (pool_namespace, pool_name, id) WHERE type = 'VM_AVAILABLE';
