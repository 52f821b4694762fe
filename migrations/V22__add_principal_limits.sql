-- Issue 25 item 2: a client principal may be limited to pool patterns and to a number of live
-- leases, changed through admin routes (`/v1/principals/{name}`) without a redeploy. A
-- principal without a row is unlimited, as before.
CREATE TABLE principal_limits (
    principal       text        PRIMARY KEY,
    -- Patterns `namespace/*` or `namespace/name`; NULL: every pool.
    pools           text[],
    -- Live leases (plus claims running their pre-lease hook) at most; NULL: no quota.
    max_live_leases integer     CHECK (max_live_leases >= 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    updated_by      text        NOT NULL
);

-- A quota's count: the principal's live leases (an index-only scan of its own rows). Led by
-- (principal, request_id) so that, should the claim's replay lookup plan on it instead of
-- leases_principal_request_id, it still finds the one row by both keys (a (principal,
-- expires_at) index made that lookup read every lease of the principal).
CREATE INDEX leases_principal_quota ON leases (principal, request_id, expires_at);
