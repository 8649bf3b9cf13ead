-- Pruning (DESIGN.md O3): km0 outbox prune and the relay's
-- --prune-older-than delete published rows oldest first. This partial index
-- holds only published rows, so a writer's INSERT (publicat_en NULL) never
-- touches it; the relay's mark adds one entry per row (the mark already could
-- not be a HOT update: publicat_en is in the predicate of the pending index).
CREATE INDEX IF NOT EXISTS {{publicats_name}} ON {{outbox}} (publicat_en) WHERE publicat_en IS NOT NULL;
