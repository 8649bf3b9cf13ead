-- Coverage can change: a city stays in ciutats (its couriers reference it)
-- and coberta says whether repartiment delivers there. cobertura_publicada
-- is the last snapshot of the covered cities published as
-- repartiment.cobertura (one row; every change locks it first, so changes
-- are serialised and each snapshot has a larger revisio).
ALTER TABLE ciutats ADD COLUMN IF NOT EXISTS coberta BOOLEAN NOT NULL DEFAULT true;
CREATE TABLE IF NOT EXISTS cobertura_publicada (
    id      BOOLEAN PRIMARY KEY DEFAULT true CHECK (id),
    revisio BIGINT  NOT NULL,
    ciutats TEXT[]  NOT NULL
);
INSERT INTO cobertura_publicada (revisio, ciutats) VALUES (0, '{}') ON CONFLICT DO NOTHING;
