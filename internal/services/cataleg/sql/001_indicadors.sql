-- km0_cataleg: the low-stock flag per product, set from estoc.actualitzat.
-- SET estoc_baix = despres < 5 is idempotent by nature: no inbox table.
CREATE TABLE IF NOT EXISTS indicadors (
    producte       TEXT        PRIMARY KEY,
    estoc_baix     BOOLEAN     NOT NULL,
    unitats        INTEGER     NOT NULL,
    actualitzat_en TIMESTAMPTZ NOT NULL DEFAULT now()
);
