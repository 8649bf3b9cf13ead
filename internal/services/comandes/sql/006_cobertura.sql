-- comandes's copy of repartiment's coverage (event-carried state: the
-- repartiment.cobertura snapshots): the covered cities of the snapshot of
-- the largest revisio seen. No row in cobertura: no snapshot yet, every
-- city is accepted (repartiment rejects and the saga refunds).
CREATE TABLE IF NOT EXISTS cobertura (
    id       BOOLEAN     PRIMARY KEY DEFAULT true CHECK (id),
    revisio  BIGINT      NOT NULL,
    rebut_en TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS ciutats_cobertes (
    ciutat TEXT PRIMARY KEY -- trimmed, lower case
);
