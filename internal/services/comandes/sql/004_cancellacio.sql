-- Cancellation (POST /comandes/{id}/cancellacio, or the compensation of an
-- order inventari refused). State machine of estat:
--   creada --pagament.confirmat--> pagada
--   creada | pagada --cancellacio--> cancellada   (terminal)
-- A cancellation is recorded once: its motiu and the id_esdeveniment of its
-- comanda.cancellada, so a repeat answers the same body.
ALTER TABLE comandes
    ADD COLUMN IF NOT EXISTS cancellada_en            TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS motiu_cancellacio        TEXT,
    ADD COLUMN IF NOT EXISTS esdeveniment_cancellacio TEXT;
