-- The parking of a WAL-mode outbox (outbox.ModeWAL, docs/cdc.md): events
-- live in the write-ahead log as logical decoding messages, so an event the
-- broker refuses for good, and every later event of its aggregate, is kept
-- here (the slot moves past them). motiu is set on the events refused (the
-- heads); NULL on the events waiting behind a head and on a head an operator
-- released. The relay publishes an aggregate's rows in lsn order once none
-- of them has a motiu, and deletes each one the broker confirmed. Empty for
-- a table-mode outbox. No index but the key: the table holds only the
-- parked events and those behind them.
CREATE TABLE IF NOT EXISTS {{wal_aparcats}} (
    id          UUID        PRIMARY KEY,
    lsn         PG_LSN      NOT NULL,
    agregat     TEXT        NOT NULL,
    agregat_id  TEXT        NOT NULL,
    tipus       TEXT        NOT NULL,
    versio      INTEGER     NOT NULL,
    carrega     JSONB       NOT NULL,
    creat_en    TIMESTAMPTZ NOT NULL,
    capcaleres  JSONB,
    motiu       TEXT,
    aparcat_en  TIMESTAMPTZ NOT NULL DEFAULT now()
);
