-- An Idempotency-Key is claimed before anything else of its request runs, in a
-- transaction of its own: estat_http = 0 marks the request in progress, held by
-- titular until reservada_fins. A second request with the key waits for the
-- answer; a claim whose holder died (its lease passed with estat_http still 0)
-- is taken over by the next request with the key.
ALTER TABLE peticions_idempotents
    ADD COLUMN IF NOT EXISTS titular        TEXT,
    ADD COLUMN IF NOT EXISTS reservada_fins TIMESTAMPTZ;
