-- Issue 15: the selection's conditions on the pools row are index lookups, not a scan of
-- `pools` (store::pool_list_with_work; docs/design-notes.md, "Issue 15: the selection at
-- 10,000 pools after a fill"). `reconcile_until >= since` already has pools_reconcile_until
-- (V3). Both indexes hold only the pools their predicate names: a handful at any time.
CREATE INDEX pools_spec_changed ON pools (namespace, name) WHERE updated_at > reconcile_until;
CREATE INDEX pools_below_target ON pools (namespace, name) WHERE below_target_reason IS NOT NULL;
