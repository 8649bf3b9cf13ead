-- Commit order per aggregate (DESIGN.md I3). Every insert into the outbox takes a
-- transaction-scoped advisory lock on its aggregate and only then stamps creat_en
-- with clock_timestamp(). A second writer of the same aggregate waits for the first
-- to commit or roll back, so within one aggregate creat_en order IS commit order,
-- whoever writes the row (km0, the seed's Python code, psql).
CREATE OR REPLACE FUNCTION {{schema}}.km0_outbox_ordre() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1802321968, hashtext(NEW.agregat_id));
    NEW.creat_en := clock_timestamp();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS km0_outbox_ordre ON {{outbox}};
CREATE TRIGGER km0_outbox_ordre BEFORE INSERT ON {{outbox}}
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.km0_outbox_ordre();

-- Wake relays at commit (NOTIFY is delivered only if the transaction commits).
-- The payload names the table so relays of other schemas ignore it.
CREATE OR REPLACE FUNCTION {{schema}}.km0_outbox_avis() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('km0_outbox', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS km0_outbox_avis ON {{outbox}};
CREATE TRIGGER km0_outbox_avis AFTER INSERT ON {{outbox}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.km0_outbox_avis();

-- Rows the broker refused for good (e.g. over max.message.bytes). A parked row
-- stays pending in the outbox; the relay skips its whole aggregate until an
-- operator releases it, so later events of that aggregate never overtake it.
CREATE TABLE IF NOT EXISTS {{aparcats}} (
    id          UUID        PRIMARY KEY,
    agregat_id  TEXT        NOT NULL,
    motiu       TEXT        NOT NULL,
    aparcat_en  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {{aparcats_idx}} ON {{aparcats}} (agregat_id);
