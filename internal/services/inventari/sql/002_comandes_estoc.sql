-- What inventari did for each order, so that a cancellation restores exactly
-- what was taken and nothing else: servida (linies = what was taken, per
-- product), refusada (nothing taken; estoc.refusat published), cancellada
-- (restaurada: whether the taken lines were given back; a cancellation seen
-- before the order's comanda.creada leaves a tombstone with nothing taken,
-- and the creation then takes nothing). Every transaction that reads or
-- writes an order's row first takes the order's advisory lock (two-key,
-- class 0x696e76, hashtext(comanda_id)), before any estoc row.
CREATE TABLE IF NOT EXISTS comandes_estoc (
    comanda_id     TEXT        PRIMARY KEY,
    estat          TEXT        NOT NULL
                   CHECK (estat IN ('servida', 'refusada', 'cancellada')),
    linies         JSONB       NOT NULL DEFAULT '[]',   -- [{producte, quantitat}] taken
    restaurada     BOOLEAN     NOT NULL DEFAULT false,
    motiu          TEXT,                                -- of the refusal
    actualitzat_en TIMESTAMPTZ NOT NULL DEFAULT now()
);
