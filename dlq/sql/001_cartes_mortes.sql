-- Index of dead letters (package dlq). One row per record of a DLQ topic. The
-- broker keeps the records; this table makes listing and filtering fast and
-- keeps what Kafka cannot: whether a letter was replayed or purged.
-- Rows are written with INSERT ... ON CONFLICT (id) DO NOTHING, so indexing
-- the same record twice changes nothing and never resets estat.
CREATE TABLE IF NOT EXISTS {{schema}}.cartes_mortes (
    id                TEXT        PRIMARY KEY,  -- '<dlq topic>/<partition>/<offset>'
    topic             TEXT        NOT NULL,     -- the DLQ topic: comandes.esdeveniments.dlq
    particio          INTEGER     NOT NULL,
    offset_dlq        BIGINT      NOT NULL,
    topic_original    TEXT        NOT NULL,     -- where a replay publishes
    particio_original INTEGER,                  -- NULL when the header was absent
    offset_original   BIGINT,
    id_esdeveniment   TEXT,                     -- NULL when unknown (undecodable value)
    tipus             TEXT,
    motiu             TEXT COLLATE "C" NOT NULL, -- "C": LIKE 'prefix%' uses the index
    classe_motiu      TEXT        NOT NULL,     -- 'permanent: esquema' (dlq.ReasonClass)
    intents           INTEGER     NOT NULL,
    primera_fallada   TIMESTAMPTZ,
    data_esdeveniment TIMESTAMPTZ,              -- the envelope's data_ms
    morta_en          TIMESTAMPTZ NOT NULL,     -- the DLQ record's timestamp
    grup_consumidor   TEXT,
    clau              BYTEA,
    valor             BYTEA       NOT NULL,     -- the original envelope bytes, exactly
    capcaleres_claus  BYTEA[]     NOT NULL,     -- headers, exactly, in record order
    capcaleres_valors BYTEA[]     NOT NULL,
    estat             TEXT        NOT NULL DEFAULT 'pendent'
                      CHECK (estat IN ('pendent', 'reproduida', 'purgada')),
    reproduccions     INTEGER     NOT NULL DEFAULT 0,
    reproduida_en     TIMESTAMPTZ,
    purgada_en        TIMESTAMPTZ,
    indexada_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS cartes_mortes_topic_motiu ON {{schema}}.cartes_mortes (topic, motiu);
CREATE INDEX IF NOT EXISTS cartes_mortes_original_motiu ON {{schema}}.cartes_mortes (topic_original, motiu);
CREATE INDEX IF NOT EXISTS cartes_mortes_morta_en ON {{schema}}.cartes_mortes (morta_en);
-- Purge with --delete-records asks for the lowest pending offset per partition.
CREATE INDEX IF NOT EXISTS cartes_mortes_pendents ON {{schema}}.cartes_mortes (topic, particio, offset_dlq)
    WHERE estat = 'pendent';
