-- A job run with Force (replay letters already replayed or purged, or older
-- than the retention) keeps it when it is resumed after a restart.
ALTER TABLE {{schema}}.feines_reproduccio ADD COLUMN IF NOT EXISTS forcar BOOLEAN NOT NULL DEFAULT false;
