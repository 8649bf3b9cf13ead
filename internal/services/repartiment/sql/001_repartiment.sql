-- km0_repartiment: covered cities, couriers, deliveries and alerts.
CREATE TABLE IF NOT EXISTS ciutats (
    ciutat TEXT PRIMARY KEY               -- lower case, e.g. 'girona'
);
INSERT INTO ciutats VALUES ('girona'), ('barcelona'), ('tarragona'), ('lleida'), ('vic'), ('figueres')
ON CONFLICT DO NOTHING;

-- A courier is free when ocupat_fins is NULL or in the past.
CREATE TABLE IF NOT EXISTS repartidors (
    id          TEXT        PRIMARY KEY,
    ciutat      TEXT        NOT NULL REFERENCES ciutats (ciutat),
    ocupat_fins TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS repartidors_ciutat ON repartidors (ciutat);
INSERT INTO repartidors (id, ciutat) VALUES
    ('gi-1', 'girona'), ('gi-2', 'girona'), ('gi-3', 'girona'),
    ('bcn-1', 'barcelona'), ('bcn-2', 'barcelona'), ('bcn-3', 'barcelona'), ('bcn-4', 'barcelona'),
    ('tgn-1', 'tarragona'), ('lle-1', 'lleida'), ('lle-2', 'lleida'), ('vic-1', 'vic'), ('fig-1', 'figueres')
ON CONFLICT DO NOTHING;

-- One row per paid order: pending assignment (no courier free: the periodic
-- assigner retries), assigned, or rejected (city not covered).
CREATE TABLE IF NOT EXISTS lliuraments (
    comanda_id    TEXT        PRIMARY KEY,
    ciutat        TEXT        NOT NULL,
    codi_postal   TEXT,
    estat         TEXT        NOT NULL CHECK (estat IN ('pendent', 'assignat', 'rebutjat')),
    repartidor_id TEXT        REFERENCES repartidors (id),
    motiu         TEXT,
    creat_en      TIMESTAMPTZ NOT NULL DEFAULT now(),
    assignat_en   TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS lliuraments_pendents ON lliuraments (creat_en) WHERE estat = 'pendent';

-- Contract alerts (an event that breaks the schema), one per event.
CREATE TABLE IF NOT EXISTS alertes (
    id_esdeveniment TEXT        PRIMARY KEY,
    tipus           TEXT        NOT NULL,
    detall          TEXT        NOT NULL,
    creat_en        TIMESTAMPTZ NOT NULL DEFAULT now()
);
