-- Per-key order: the blocked head of a key and the messages parked behind it,
-- per consumidor, beside missatges_processats. Written in the transaction that
-- settles the offset or ack of the message (or applies its effect).

-- One row per blocked key: its head (the oldest unapplied message of the key)
-- waits for a retry ('reintent') or sits in the dead-letter queue ('dlq', with
-- its letter id). The row is the key's lock: every operation that parks behind,
-- releases or re-heads the key takes it FOR UPDATE first. seguent numbers the
-- messages parked behind the head.
CREATE TABLE IF NOT EXISTS {{schema}}.claus_bloquejades (
    consumidor    TEXT        NOT NULL,
    clau          BYTEA       NOT NULL,            -- the record key (agregat_id)
    id_missatge   TEXT        NOT NULL,            -- the head's id_esdeveniment
    motiu         TEXT        NOT NULL CHECK (motiu IN ('reintent', 'dlq')),
    id_carta      TEXT,                            -- the head's dead letter, when motiu = 'dlq'
    ultim_error   TEXT,                            -- why the head failed (<= 200 bytes)
    seguent       BIGINT      NOT NULL DEFAULT 1,  -- sequencia of the next parked message
    bloquejada_en TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumidor, clau)
);

-- The messages behind a blocked head, in arrival order (sequencia), with what
-- is needed to apply them or dead-letter them later: the record value and
-- headers and the source position. estat: darrere_reintent (the head waits for
-- a retry), darrere_dlq (the head is dead-lettered, the message stays parked),
-- morta_per_bloqueig (dead-lettered as blocked by the head; still kept here
-- so that replaying the head releases it in order).
CREATE TABLE IF NOT EXISTS {{schema}}.missatges_aparcats (
    consumidor      TEXT        NOT NULL,
    clau            BYTEA       NOT NULL,
    sequencia       BIGINT      NOT NULL,
    id_missatge     TEXT        NOT NULL,
    estat           TEXT        NOT NULL CHECK (estat IN ('darrere_reintent', 'darrere_dlq', 'morta_per_bloqueig')),
    topic           TEXT        NOT NULL,          -- domain topic or work queue
    particio        INTEGER     NOT NULL,
    offset_original BIGINT      NOT NULL,          -- -1 on RabbitMQ
    valor           BYTEA       NOT NULL,
    capcaleres      JSONB       NOT NULL,          -- [[name, value], ...] in record order
    data_original   TIMESTAMPTZ,
    aparcat_en      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumidor, clau, sequencia),
    -- A redelivered message (offset commit lost after the park committed) is
    -- parked once.
    UNIQUE (consumidor, id_missatge)
);
