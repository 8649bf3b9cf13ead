-- Stored responses of idempotent request/reply servers (requestreply.Idempotent):
-- the response to request id_peticio, written in the same transaction as the
-- effect and its key in missatges_processats, returned again on a repeat.
CREATE TABLE IF NOT EXISTS {{schema}}.respostes_desades (
    id_peticio TEXT        NOT NULL,   -- the request id (AMQP message_id, Kafka header id_peticio)
    consumidor TEXT        NOT NULL,   -- e.g. 'pagaments.autoritzacio'
    resposta   BYTEA       NOT NULL,   -- the reply body, as sent
    desada_en  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (id_peticio, consumidor)
);
-- Purging by age walks this index.
CREATE INDEX IF NOT EXISTS respostes_desades_antiguitat ON {{schema}}.respostes_desades (desada_en);
