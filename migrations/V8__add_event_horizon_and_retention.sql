-- The events feed never skips an event (issue 14 item 6; docs/design-notes.md, "Issue 14
-- item 6").
--
-- Event ids come from a sequence, so they commit out of order: a transaction can hold id 10
-- uncommitted while id 11 commits. A reader of `after=N` must therefore never hand out an id
-- while a smaller one may still commit. The reader (store::event_horizon) reads the largest id
-- handed out so far (the sequence's last_value), then takes a new transaction id, waits until
-- no transaction below that one is running, and only then reads the events up to that id.
-- That covers every writer of a smaller id only if each writer had its transaction id before
-- it took its event id: events_next_id() takes the transaction id first. Without it, a writer
-- between nextval() and its first row write has no transaction id yet, and could get one
-- above the reader's.
--
-- The identity column becomes a plain sequence default because an identity's default
-- cannot be an expression.
ALTER TABLE events ALTER COLUMN id DROP IDENTITY;

-- CACHE 1 (one value per nextval, never a range held by one session) is what makes
-- last_value the largest id handed out so far. Never raise it.
CREATE SEQUENCE events_id_seq AS bigint CACHE 1 OWNED BY events.id;
SELECT setval('events_id_seq', (SELECT coalesce(max(id), 0) + 1 FROM events), false);

CREATE FUNCTION events_next_id() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- Takes this transaction's id if it has none yet: from here until the transaction ends
    -- the snapshot of every other session lists it as running. Only then the event id.
    PERFORM pg_current_xact_id();
    RETURN nextval('events_id_seq');
END
$$;

ALTER TABLE events ALTER COLUMN id SET DEFAULT events_next_id();

-- Retention (POOLMGR_EVENTS_RETENTION): the reconcile pass deletes events older than it in
-- batches, oldest first.
CREATE INDEX events_created_at ON events (created_at);
