-- Phase 3 (#478, #1230): record row-culpable failures on rows still claimed
-- by us: attempts + 1, last_error, lease released, parked at the budget.
-- $1 replica id, $2 row ids, $3 errors (same order), $4 max attempts.
UPDATE event_outbox o
SET attempts = o.attempts + 1,
    last_error = f.error,
    claimed_at = NULL,
    claimed_by = NULL,
    parked_at = CASE WHEN o.attempts + 1 >= $4 THEN now() END
FROM unnest($2::uuid[], $3::text[]) AS f(id, error)
WHERE o.id = f.id
  AND o.claimed_by = $1
  AND o.published_at IS NULL
RETURNING o.parked_at IS NOT NULL AS parked
