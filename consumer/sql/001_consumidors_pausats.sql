-- Consumer groups an operator paused (km0 console): a service whose consumer
-- group has a row here takes no new batch until the row is gone. One row per
-- grup; per is who paused it (the console's session, never a credential).
CREATE TABLE IF NOT EXISTS {{schema}}.consumidors_pausats (
    grup      TEXT        PRIMARY KEY,
    pausat_en TIMESTAMPTZ NOT NULL DEFAULT now(),
    per       TEXT        NOT NULL DEFAULT ''
);
