-- The warm floor of a rollout (issue 24): the AVAILABLE VMs the pool had when the rollout
-- started (or rolled back). A busy pool runs below its target by the VMs its refills have in
-- flight, so a floor of target - max_unavailable would never let a stale VM be retired there;
-- the rollout keeps the pool at or above the warm capacity it had instead
-- (reconcile::rollout). NULL for rollouts started before V20: the target's floor applies.
ALTER TABLE pools ADD COLUMN rollout_warm_floor integer;
