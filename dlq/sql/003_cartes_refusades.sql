-- Letters the index refused (package dlq): a row of cartes_mortes PostgreSQL
-- would not take even with every header bounded to its column (a data
-- exception, SQLSTATE class 22; a program limit, 54; an integrity violation
-- other than a duplicate, 23). Such a letter is set aside here, with its
-- bytes, so that the letters behind it are indexed and alerted: one bad
-- letter never hides the others. `km0 dlq ls` shows how many there are.
-- Kafka still holds the record; a RabbitMQ letter is acked off the broker
-- once it is here, so this table is then its only copy.
CREATE TABLE IF NOT EXISTS {{schema}}.cartes_refusades (
    id                TEXT        PRIMARY KEY,  -- the letter's ID, as cartes_mortes.id
    topic             TEXT        NOT NULL,     -- the DLQ topic or queue
    particio          INTEGER     NOT NULL,
    offset_dlq        BIGINT      NOT NULL,     -- Kafka offset, or the RabbitMQ letter's number
    codi_error        TEXT        NOT NULL,     -- SQLSTATE of the refusal, e.g. 23514
    error             TEXT        NOT NULL,     -- PostgreSQL's message, cut
    morta_en          TIMESTAMPTZ,
    clau              BYTEA,
    valor             BYTEA       NOT NULL,     -- the letter's bytes, exactly
    capcaleres_claus  BYTEA[]     NOT NULL,
    capcaleres_valors BYTEA[]     NOT NULL,
    refusada_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);
