-- km0_comandes: the orders of CONTRACT.md ("Service tables named by the seed"),
-- with the columns the service adds (amount, delivery address, timestamps).
CREATE TABLE IF NOT EXISTS comandes (
    id             TEXT        PRIMARY KEY,              -- 'P-2026-000123'
    client         TEXT        NOT NULL,
    mercat         TEXT        NOT NULL,
    estat          TEXT        NOT NULL DEFAULT 'creada'
                   CHECK (estat IN ('creada', 'pagada', 'cancellada')),
    import_centims BIGINT      NOT NULL CHECK (import_centims >= 0),
    ciutat         TEXT,                                 -- adreca_lliurament, NULL for v1 clients
    codi_postal    TEXT,
    creat_en       TIMESTAMPTZ NOT NULL DEFAULT now(),
    pagada_en      TIMESTAMPTZ
);

CREATE TABLE IF NOT EXISTS linies_comanda (
    comanda_id   TEXT    NOT NULL REFERENCES comandes (id),
    linia        INTEGER NOT NULL,
    producte     TEXT    NOT NULL,
    quantitat    INTEGER NOT NULL CHECK (quantitat > 0),
    preu_centims INTEGER NOT NULL CHECK (preu_centims >= 0),
    PRIMARY KEY (comanda_id, linia)
);

-- Idempotency-Key of POST /comandes: the first answer, replayed to every retry.
-- The row is inserted in the same transaction as the order, so a retry racing
-- the first request waits for it and then reads its answer.
CREATE TABLE IF NOT EXISTS peticions_idempotents (
    clau         TEXT        PRIMARY KEY,
    hash_peticio TEXT        NOT NULL,   -- sha256 of the body: a reused key with another body is refused
    estat_http   INTEGER     NOT NULL,
    resposta     JSONB       NOT NULL,
    creat_en     TIMESTAMPTZ NOT NULL DEFAULT now()
);
