-- km0_inventari: the stock of CONTRACT.md, seeded as the seed's section 2.
CREATE TABLE IF NOT EXISTS estoc (
    producte TEXT PRIMARY KEY,
    unitats  INTEGER NOT NULL CHECK (unitats >= 0)
);
INSERT INTO estoc VALUES ('tomaquet-rosa', 120), ('carbasso', 80), ('formatge-curat', 5),
                         ('formatge-fresc', 30), ('vi-crianca', 200)
ON CONFLICT (producte) DO NOTHING;

-- ReservarEstoc answers, by id_reserva: a repeated request gets the stored
-- answer and reserves nothing more. Written in the transaction of the effect.
CREATE TABLE IF NOT EXISTS reserves (
    id_reserva TEXT        PRIMARY KEY,
    resposta   JSONB       NOT NULL,
    creat_en   TIMESTAMPTZ NOT NULL DEFAULT now()
);
