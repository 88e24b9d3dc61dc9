-- Phase 3 (#478, #1230): record row-culpable failures on rows still claimed
-- by us: attempts + 1, last_error, lease released, parked at the budget.
-- $1 replica id, $2 row ids, $3 errors (same order), $4 max attempts.
-- No `published_at IS NULL` here on purpose: with stale statistics (a queue
-- table churns faster than autoanalyze) the planner would AND the partial
-- index event_outbox_unpublished_idx into the plan and scan the whole
-- backlog; the primary key alone finds the rows, and the claimed_by guard
-- already excludes rows someone else reclaimed and published.
UPDATE event_outbox o
SET attempts = o.attempts + 1,
    last_error = f.error,
    claimed_at = NULL,
    claimed_by = NULL,
    parked_at = CASE WHEN o.attempts + 1 >= $4 THEN now() END
FROM unnest($2::uuid[], $3::text[]) AS f(id, error)
WHERE o.id = f.id
  AND o.claimed_by = $1
RETURNING o.parked_at IS NOT NULL AS parked
