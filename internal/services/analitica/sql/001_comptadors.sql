-- km0_analitica: event counters. At-most-once: a lost event is one count less.
CREATE TABLE IF NOT EXISTS comptadors_tipus (
    tipus TEXT   PRIMARY KEY,
    n     BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS comptadors_mercat (
    mercat TEXT   PRIMARY KEY,
    n      BIGINT NOT NULL DEFAULT 0   -- comanda.creada per market
);
