-- What inventari did for each order, so that a cancellation restores exactly
-- what was taken and nothing else: servida (linies = what was taken, per
-- product), refusada (nothing taken; estoc.refusat published), cancellada
-- (restaurada: whether the taken lines were given back; a cancellation seen
-- before the order's comanda.creada leaves a tombstone with nothing taken,
-- and the creation then takes nothing). pendent only exists inside the
-- transaction that locked a new order's row. The row is the order's lock:
-- every transaction that changes it takes it before any estoc row.
CREATE TABLE IF NOT EXISTS comandes_estoc (
    comanda_id     TEXT        PRIMARY KEY,
    estat          TEXT        NOT NULL DEFAULT 'pendent'
                   CHECK (estat IN ('pendent', 'servida', 'refusada', 'cancellada')),
    linies         JSONB       NOT NULL DEFAULT '[]',   -- [{producte, quantitat}] taken
    restaurada     BOOLEAN     NOT NULL DEFAULT false,
    motiu          TEXT,                                -- of the refusal
    actualitzat_en TIMESTAMPTZ NOT NULL DEFAULT now()
);
