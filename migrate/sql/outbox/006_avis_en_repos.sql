-- A wake-up that does not NOTIFY on every commit while the relay is busy
-- (docs/design/outbox-relay.md, R-lease). NOTIFY takes a server-wide lock at
-- commit, held until the commit is durable, so notifying writers commit one
-- at a time. A relay that alone serves every shard of an outbox and sees
-- notifications arrive often takes a lease here (fins, server time) and,
-- until it ends, claims every millisecond by itself; a writer that inserts
-- while the lease runs does not notify. When the lease ends the relay waits
-- for every transaction then holding a lock on the outbox table (any of
-- them may have skipped its NOTIFY) and claims once more after each one
-- ends, so no commit waits for the fallback poll. No row, or a lease past
-- its end: every writer notifies, as before.
CREATE TABLE IF NOT EXISTS {{schema}}.km0_avisos (
    taula TEXT        PRIMARY KEY, -- the outbox table's name (TG_TABLE_NAME)
    fins  TIMESTAMPTZ NOT NULL     -- the relay claims by itself until then
);

CREATE OR REPLACE FUNCTION {{schema}}.km0_outbox_avis() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF clock_timestamp() < (SELECT fins FROM {{schema}}.km0_avisos WHERE taula = TG_TABLE_NAME) THEN
        RETURN NULL;
    END IF;
    PERFORM pg_notify('km0_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END $$;
