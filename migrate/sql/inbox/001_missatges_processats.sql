-- Processed messages of CONTRACT.md: the idempotency keys of one consuming
-- service. The key and the effect are written in the same transaction.
CREATE TABLE IF NOT EXISTS {{processats}} (
    id_missatge  TEXT        NOT NULL,   -- id_esdeveniment of the envelope
    consumidor   TEXT        NOT NULL,   -- e.g. 'inventari.descompte_estoc'
    processat_en TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (id_missatge, consumidor)
);
-- Purging by age (retention, default 14 days) walks this index.
CREATE INDEX IF NOT EXISTS {{processats_idx}} ON {{processats}} (processat_en);
