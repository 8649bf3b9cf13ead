-- A letter whose time of death is out of range (an AMQP timestamp of unix
-- -10^12, a Kafka record from the year -10700) is indexed with morta_en NULL
-- and temps_desconegut true, never refused: one such letter must not block
-- the letters behind it. temps_desconegut is also true when primera_fallada
-- or data_esdeveniment was present but out of range (stored NULL). The valid
-- range is dlq.InRange: from the unix epoch to a day after indexing. --since/--until never select a letter
-- whose morta_en is NULL, and replay refuses it without --force (its age is
-- unknown).
ALTER TABLE {{schema}}.cartes_mortes
    ALTER COLUMN morta_en DROP NOT NULL,
    ADD COLUMN IF NOT EXISTS temps_desconegut BOOLEAN NOT NULL DEFAULT false;
