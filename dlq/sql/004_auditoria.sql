-- The audit log of dead-letter operations (package dlq): one row per replay,
-- purge, edit-and-replay or skip an operator ran (a dry run is not one), with
-- who ran it (the console session's or the CLI's identity string), when, the
-- letters it acted on and its result. Rows are only ever inserted.
CREATE TABLE IF NOT EXISTS {{schema}}.auditoria_cartes (
    id        BIGSERIAL   PRIMARY KEY,
    en        TIMESTAMPTZ NOT NULL DEFAULT now(),
    qui       TEXT        NOT NULL,             -- e.g. 'cli:maria@host', 'console:<session>'
    accio     TEXT        NOT NULL CHECK (accio IN ('reproduccio', 'purga', 'edicio', 'salt')),
    cartes    TEXT[]      NOT NULL,             -- the letters acted on (done)
    refusades INTEGER     NOT NULL DEFAULT 0,   -- letters selected and refused
    resultat  TEXT        NOT NULL              -- 'fet', or the error, for people
);
CREATE INDEX IF NOT EXISTS auditoria_cartes_en ON {{schema}}.auditoria_cartes (en);
-- The edited payloads: the letter's own bytes stay in cartes_mortes.valor
-- (the original is kept); what an edit-and-replay sent is here.
CREATE TABLE IF NOT EXISTS {{schema}}.cartes_editades (
    id         BIGSERIAL   PRIMARY KEY,
    id_carta   TEXT        NOT NULL,
    editada_en TIMESTAMPTZ NOT NULL DEFAULT now(),
    qui        TEXT        NOT NULL,
    valor      BYTEA       NOT NULL             -- the envelope sent in place of the original
);
CREATE INDEX IF NOT EXISTS cartes_editades_carta ON {{schema}}.cartes_editades (id_carta);
