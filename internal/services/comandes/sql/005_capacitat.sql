-- The order capability (the customer's credential for GET /comandes/{id} and
-- POST /comandes/{id}/cancellacio): 32 random bytes returned once in the 201,
-- stored here only as their SHA-256. NULL for orders stored before it: only
-- the operator token reads or cancels those.
ALTER TABLE comandes ADD COLUMN IF NOT EXISTS hash_capacitat BYTEA;
-- The capability of a 201 stored under an Idempotency-Key, so that a retry
-- that lost the first answer gets it again: AES-256-GCM under a key derived
-- from the Idempotency-Key and the exact request body, which is not stored
-- (capability.go). Purged with the row.
ALTER TABLE peticions_idempotents ADD COLUMN IF NOT EXISTS capacitat_xifrada BYTEA;
