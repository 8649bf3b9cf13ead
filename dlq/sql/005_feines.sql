-- Bulk replay jobs (package dlq): a capped, paced replay that survives a
-- restart of whoever runs it. One row per job, one row per letter with its
-- own state, so a resumed job replays only what it had not replayed.
CREATE TABLE IF NOT EXISTS {{schema}}.feines_reproduccio (
    id         TEXT        PRIMARY KEY,
    qui        TEXT        NOT NULL,
    creada_en  TIMESTAMPTZ NOT NULL DEFAULT now(),
    per_segon  DOUBLE PRECISION NOT NULL CHECK (per_segon > 0), -- the pace
    estat      TEXT        NOT NULL DEFAULT 'pendent'
               CHECK (estat IN ('pendent', 'cancellada', 'acabada')),
    acabada_en TIMESTAMPTZ
);
CREATE TABLE IF NOT EXISTS {{schema}}.feines_reproduccio_cartes (
    id_feina TEXT    NOT NULL REFERENCES {{schema}}.feines_reproduccio (id) ON DELETE CASCADE,
    ordre    INTEGER NOT NULL,
    id_carta TEXT    NOT NULL,
    estat    TEXT    NOT NULL DEFAULT 'pendent' CHECK (estat IN ('pendent', 'fet', 'refusat')),
    detall   TEXT,                              -- why refused
    PRIMARY KEY (id_feina, ordre)
);
