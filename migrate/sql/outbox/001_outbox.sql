-- The outbox of CONTRACT.md, exactly: one row per event, written in the
-- business transaction; publicat_en stays NULL until the broker confirmed it.
CREATE TABLE IF NOT EXISTS {{outbox}} (
    id          UUID        PRIMARY KEY,           -- becomes id_esdeveniment
    agregat     TEXT        NOT NULL,              -- 'comanda', 'producte', 'pagament'
    agregat_id  TEXT        NOT NULL,              -- partition key
    tipus       TEXT        NOT NULL,              -- 'comanda.creada'
    versio      INTEGER     NOT NULL DEFAULT 1,
    carrega     JSONB       NOT NULL,
    creat_en    TIMESTAMPTZ NOT NULL DEFAULT now(),
    publicat_en TIMESTAMPTZ                        -- NULL while pending
);
CREATE INDEX IF NOT EXISTS {{pendents_name}} ON {{outbox}} (creat_en) WHERE publicat_en IS NULL;
