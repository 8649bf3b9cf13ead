-- The maps estimate of a delivery that waits for a courier, so that the
-- assigner's repartiment.assignat carries it too.
ALTER TABLE lliuraments ADD COLUMN IF NOT EXISTS minuts_estimats INTEGER;
