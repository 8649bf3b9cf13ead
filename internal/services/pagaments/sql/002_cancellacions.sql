-- Cancelled orders (comanda.cancellada), one row each: a charge that comes
-- after its order's cancellation charges nothing (a tombstone).
CREATE TABLE IF NOT EXISTS cancellacions (
    comanda_id TEXT        PRIMARY KEY,
    motiu      TEXT        NOT NULL,
    creat_en   TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Refunds made through the gateway (Idempotency-Key reemborsament-<order id>),
-- one per order.
CREATE TABLE IF NOT EXISTS reemborsaments (
    comanda_id        TEXT        PRIMARY KEY,
    import_centims    BIGINT      NOT NULL CHECK (import_centims >= 0),
    ref_passarella    TEXT        NOT NULL,   -- the charge refunded
    ref_reemborsament TEXT        NOT NULL,
    creat_en          TIMESTAMPTZ NOT NULL DEFAULT now()
);
