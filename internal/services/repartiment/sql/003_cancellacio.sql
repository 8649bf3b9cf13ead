-- comanda.cancellada: a delivery is cancelled and its courier released
-- (alliberat). A cancellation that comes before the order's comanda.pagada
-- leaves a tombstone (estat cancellat, no city): the payment then assigns
-- nothing.
ALTER TABLE lliuraments DROP CONSTRAINT IF EXISTS lliuraments_estat_check;
ALTER TABLE lliuraments ADD CONSTRAINT lliuraments_estat_check
    CHECK (estat IN ('pendent', 'assignat', 'rebutjat', 'cancellat'));
ALTER TABLE lliuraments ALTER COLUMN ciutat DROP NOT NULL;
ALTER TABLE lliuraments
    ADD COLUMN IF NOT EXISTS cancellat_en TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS alliberat    BOOLEAN NOT NULL DEFAULT false;
