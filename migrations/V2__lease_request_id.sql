-- Idempotent claims (seed change "feat: make ClaimVM idempotent with request_id").
--
-- Leases created before this migration keep request_id NULL: they were claimed without
-- one and can never be replayed. principal is the authenticated caller that claimed the
-- lease; it scopes request_id so two clients choosing the same id never see each other's
-- lease.
ALTER TABLE leases ADD COLUMN request_id text;
-- Old leases get the empty principal, which no token maps to.
ALTER TABLE leases ADD COLUMN principal text NOT NULL DEFAULT '';

ALTER TABLE leases ADD CONSTRAINT leases_request_id_length
    CHECK (request_id IS NULL OR (request_id <> '' AND octet_length(request_id) <= 255));

-- The only guard against a duplicate claim. The claim's INSERT repeats this predicate in
-- its ON CONFLICT clause so PostgreSQL can infer this partial index as the arbiter.
CREATE UNIQUE INDEX leases_principal_request_id ON leases (principal, request_id)
    WHERE request_id IS NOT NULL;
