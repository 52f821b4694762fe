-- poolmgr baseline schema.
--
-- Correctness lives here: every claim, release and reconcile decision is one transaction
-- over these tables, and the constraints below are the last line of defence against a VM
-- being handed out twice. Timestamps are timestamptz, durations whole seconds.

CREATE TABLE pools (
    namespace                  text        NOT NULL,
    name                       text        NOT NULL,
    size                       integer     NOT NULL CHECK (size BETWEEN 0 AND 10000),
    flintlock_hosts            text[]      NOT NULL DEFAULT '{}',
    strategy                   text        NOT NULL
        CHECK (strategy IN ('IMMEDIATE_ON_LEASE', 'MIN_SIZE_THRESHOLD', 'REPLACE_ON_DELETE')),
    min_size                   integer,
    microvm_template           jsonb       NOT NULL,
    create_commands            text[]      NOT NULL DEFAULT '{}',
    pre_lease_commands         text[]      NOT NULL DEFAULT '{}',
    hook_failure_policy        text        NOT NULL
        CHECK (hook_failure_policy IN ('DELETE_AND_REPLACE', 'QUARANTINE')),
    heartbeat_interval_seconds integer     NOT NULL CHECK (heartbeat_interval_seconds >= 1),
    heartbeat_expiry_seconds   integer     NOT NULL CHECK (heartbeat_expiry_seconds >= 1),
    -- Reconcile lease: a pass owns the pool until reconcile_until. Rows, not advisory locks,
    -- so overlapping passes through a transaction-mode pooler stay safe.
    reconcile_owner            text,
    reconcile_until            timestamptz NOT NULL DEFAULT '-infinity',
    created_at                 timestamptz NOT NULL DEFAULT now(),
    updated_at                 timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, name)
);

CREATE TABLE hosts (
    name             text        PRIMARY KEY,
    address          text        NOT NULL,
    tls_insecure     boolean     NOT NULL DEFAULT true,
    ca_pem           text,
    cert_pem         text,
    key_pem          text,
    basic_auth_token text,
    cordoned         boolean     NOT NULL DEFAULT false,
    cordoned_reason  text,
    cordoned_at      timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- No foreign key from vms to pools: a deleted pool's VMs stay as DELETING rows until
-- flintlock confirms their deletion.
CREATE TABLE vms (
    id                 text        PRIMARY KEY,   -- ours; also the flintlock spec.id
    uid                text,                      -- flintlock's ULID, NULL until known
    pool_namespace     text        NOT NULL,
    pool_name          text        NOT NULL,
    flintlock_host     text        NOT NULL,
    phase              text        NOT NULL CHECK (phase IN (
        'PROVISIONING', 'CREATE_HOOK_RUNNING', 'AVAILABLE', 'PRE_LEASE_HOOK_RUNNING',
        'LEASED', 'DELETING', 'QUARANTINED', 'FAILED')),
    lease_id           text,
    network_interfaces jsonb       NOT NULL DEFAULT '{}',
    attempts           integer     NOT NULL DEFAULT 0,
    next_attempt_at    timestamptz,               -- backoff: NULL = try now
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX vms_pool_phase ON vms (pool_namespace, pool_name, phase);
-- The claim's hot path: only AVAILABLE rows, so the SKIP LOCKED scan stays short however
-- many leased or deleting VMs a pool has.
CREATE INDEX vms_pool_available ON vms (pool_namespace, pool_name, created_at)
    WHERE phase = 'AVAILABLE';
CREATE INDEX vms_host ON vms (flintlock_host);

CREATE TABLE leases (
    lease_id          text        PRIMARY KEY,
    -- One lease per VM, ever: the database refuses to hand a VM out twice.
    vm_id             text        NOT NULL UNIQUE,
    pool_namespace    text        NOT NULL,
    pool_name         text        NOT NULL,
    claimed_at        timestamptz NOT NULL,
    last_heartbeat_at timestamptz NOT NULL,
    expires_at        timestamptz NOT NULL
);

CREATE INDEX leases_pool ON leases (pool_namespace, pool_name);
CREATE INDEX leases_expires_at ON leases (expires_at);

-- Append-only outbox, written in the same transaction as the change it records.
CREATE TABLE events (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    type           text        NOT NULL,
    pool_namespace text        NOT NULL,
    pool_name      text        NOT NULL,
    vm_id          text,
    lease_id       text,
    payload        jsonb       NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX events_pool_id ON events (pool_namespace, pool_name, id);
