-- Refunds, one per Idempotency-Key ('reemborsament-<order id>'), of the charge
-- made under clau_cobrament ('cobrament-<order id>'): a repeated key returns
-- the refund already made; a charge is refunded at most once, whole. A refund
-- asked for a charge key with no charge voids that key (ref_cobrament NULL,
-- import 0): a charge that arrives later under it is refused, so a charge
-- request still in flight when the order was cancelled charges nothing.
CREATE TABLE IF NOT EXISTS {{schema}}.reemborsaments (
    clau           TEXT        PRIMARY KEY,
    clau_cobrament TEXT        NOT NULL UNIQUE,
    ref_cobrament  TEXT        UNIQUE REFERENCES {{schema}}.cobraments (ref),
    comanda_id     TEXT        NOT NULL,
    import_centims BIGINT      NOT NULL,
    ref            TEXT        NOT NULL UNIQUE,
    crides         INTEGER     NOT NULL DEFAULT 1,
    creat_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);
