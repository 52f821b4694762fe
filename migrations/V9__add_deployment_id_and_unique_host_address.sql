-- Orphan collection never deletes another deployment's VMs (issue 14 item 9), and a host
-- that stops answering is remembered between passes (item 7).
--
-- The orphan scan deletes a microVM that no vms row accounts for, or whose row names
-- another host. Two deployments sharing a flintlockd, or two host records of one deployment
-- for one flintlockd, each saw the other's VMs that way and deleted them, leased ones
-- included.

-- One host record per flintlockd: an address is registered once, compared without case
-- (DNS names are case-insensitive). Two spellings of one machine (an IP address and a name)
-- cannot be told apart here. A database that already has such duplicates is refused with
-- the list, rather than left deleting VMs: retire all but one record of each first (cordon
-- it, take it out of its pools' flintlock_hosts, let its VMs go, delete it).
DO $$
DECLARE
    dup text;
BEGIN
    SELECT string_agg(format('%s (hosts %s)', a, names), '; ') INTO dup
    FROM (
        SELECT lower(address) AS a, string_agg(name, ', ' ORDER BY name) AS names
        FROM hosts GROUP BY lower(address) HAVING count(*) > 1
    ) d;
    IF dup IS NOT NULL THEN
        RAISE EXCEPTION 'several host records name one flintlockd address: %', dup
            USING HINT = 'Keep one host record per address: cordon the others, remove them from their pools'' '
                         'flintlock_hosts, wait for their VMs to go, delete them; then migrate again.';
    END IF;
END $$;

CREATE UNIQUE INDEX hosts_address_key ON hosts (lower(address));

-- The deployment's id, generated once per database: every function of a deployment reads
-- the same one, and two deployments (two databases) never share one. It is part of every
-- flintlock namespace the deployment creates VMs in (`<prefix><id>-<pool namespace>`), and
-- the orphan scan only ever deletes microVMs in its own deployment's namespaces.
-- POOLMGR_DEPLOYMENT_ID overrides it. Letters and digits only: a '-' would make the
-- namespace ambiguous.
CREATE TABLE deployment (
    -- At most one row.
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    id         text        NOT NULL CHECK (id ~ '^[a-z0-9]{1,20}$'),
    created_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO deployment (id) VALUES (substr(replace(gen_random_uuid()::text, '-', ''), 1, 12));

-- A host a reconcile pass could not reach (a call timed out or was refused) gets no new VMs
-- until then: a pass places new VMs beside its VM steps, before they could find out again.
ALTER TABLE hosts ADD COLUMN unreachable_until timestamptz;
