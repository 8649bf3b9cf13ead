-- comanda.cancellada per motiu (client, estoc_insuficient, ...).
CREATE TABLE IF NOT EXISTS comptadors_cancellacio (
    motiu TEXT   PRIMARY KEY,
    n     BIGINT NOT NULL DEFAULT 0
);
