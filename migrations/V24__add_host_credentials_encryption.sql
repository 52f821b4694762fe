-- Issue 25 item 4: hosts' secrets encrypted at rest (functions/core/src/credentials.rs).
-- `key_pem` and `basic_auth_token` hold ciphertexts under a per-host data key; the data key is
-- stored here wrapped by a key-encryption key the database never holds, named by its id.
-- NULL id: secrets stored before this migration, in plaintext; the reconcile pass seals them
-- once the deployment has a key (POOLMGR_CREDENTIALS_KEY).
ALTER TABLE hosts
    ADD COLUMN credentials_key_id text,
    ADD COLUMN credentials_dek    text,
    ADD CONSTRAINT hosts_credentials_sealed_whole CHECK ((credentials_key_id IS NULL) = (credentials_dek IS NULL));

-- Rows stored in plaintext are sealed by the reconcile pass, but not before this: during the
-- deploy that runs this migration, functions of the version before may still run (a reconcile
-- loop for up to its 300 s timeout), and they would send a sealed value as the host's token.
ALTER TABLE deployment ADD COLUMN seal_host_credentials_from timestamptz NOT NULL DEFAULT now() + interval '15 minutes';
