-- Issue 26 item 9: a pool's spec has a version, and the pool's ETag is made of it, so that
-- `PUT /v1/pools/{namespace}/{name}` with `If-Match` refuses (412) to overwrite a spec someone
-- else changed since it was read.
--
-- spec_version takes a new value from one sequence at every change of the spec: a PUT
-- (store::pool_update), an undo and an automatic rollback (store::rollout_undo,
-- store::rollout_halt), which change the template. From a sequence rather than a per-pool
-- counter, so a pool deleted and created again never has the ETag of its namesake: an
-- If-Match read before the delete cannot match it. Status (counts, desired size, rollout
-- state) is not the spec and changes no version.
CREATE SEQUENCE pool_spec_versions AS bigint;
ALTER TABLE pools ADD COLUMN spec_version bigint NOT NULL DEFAULT nextval('pool_spec_versions');
ALTER SEQUENCE pool_spec_versions OWNED BY pools.spec_version;
