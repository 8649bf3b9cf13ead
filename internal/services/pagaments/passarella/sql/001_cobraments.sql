-- The simulated payment gateway's own storage: one charge per Idempotency-Key.
CREATE TABLE IF NOT EXISTS {{schema}}.cobraments (
    clau           TEXT        PRIMARY KEY,     -- Idempotency-Key, 'cobrament-<order id>'
    comanda_id     TEXT        NOT NULL,
    import_centims BIGINT      NOT NULL,
    ref            TEXT        NOT NULL UNIQUE, -- ref_passarella
    crides         INTEGER     NOT NULL DEFAULT 1, -- requests that carried this key
    creat_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);
