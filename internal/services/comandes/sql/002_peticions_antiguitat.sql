-- The housekeeping deletes stored Idempotency-Key answers by age.
CREATE INDEX IF NOT EXISTS peticions_idempotents_antiguitat ON peticions_idempotents (creat_en);
