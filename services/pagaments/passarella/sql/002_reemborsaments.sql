-- Refunds, one per Idempotency-Key ('reemborsament-<order id>'): a repeated
-- key returns the refund already made. A charge is refunded at most once,
-- whole.
CREATE TABLE IF NOT EXISTS {{schema}}.reemborsaments (
    clau           TEXT        PRIMARY KEY,
    ref_cobrament  TEXT        NOT NULL UNIQUE REFERENCES {{schema}}.cobraments (ref),
    comanda_id     TEXT        NOT NULL,
    import_centims BIGINT      NOT NULL,
    ref            TEXT        NOT NULL UNIQUE,
    crides         INTEGER     NOT NULL DEFAULT 1,
    creat_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);
