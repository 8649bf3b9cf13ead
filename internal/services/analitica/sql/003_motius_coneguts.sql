-- comptadors_cancellacio counts the known motius only (analitica.KnownCancelReasons);
-- every other motiu is counted under 'altres'. Fold the rows counted before.
INSERT INTO comptadors_cancellacio (motiu, n)
    SELECT 'altres', sum(n) FROM comptadors_cancellacio
    WHERE motiu NOT IN ('client', 'estoc_insuficient', 'producte_desconegut', 'altres')
    HAVING count(*) > 0
ON CONFLICT (motiu) DO UPDATE SET n = comptadors_cancellacio.n + EXCLUDED.n;
DELETE FROM comptadors_cancellacio
    WHERE motiu NOT IN ('client', 'estoc_insuficient', 'producte_desconegut', 'altres');
