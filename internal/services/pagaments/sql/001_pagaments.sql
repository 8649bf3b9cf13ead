-- km0_pagaments: the payments of CONTRACT.md, one per order.
CREATE TABLE IF NOT EXISTS pagaments (
    comanda_id     TEXT        NOT NULL UNIQUE,
    import_centims BIGINT      NOT NULL CHECK (import_centims >= 0),
    ref_passarella TEXT        NOT NULL,
    creat_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Card authorisations answered on pagaments.autoritzacions, one decision per
-- order: a repeated request gets the same answer.
CREATE TABLE IF NOT EXISTS autoritzacions (
    comanda_id     TEXT        PRIMARY KEY,
    import_centims BIGINT      NOT NULL,
    aprovada       BOOLEAN     NOT NULL,
    motiu          TEXT,
    creat_en       TIMESTAMPTZ NOT NULL DEFAULT now()
);
