-- Infra failure (#1061): release our claims without touching attempts.
-- $1 replica id, $2 row ids.
-- No `published_at IS NULL` here on purpose: with stale statistics (a queue
-- table churns faster than autoanalyze) the planner would AND the partial
-- index event_outbox_unpublished_idx into the plan and scan the whole
-- backlog; the primary key alone finds the rows, and the claimed_by guard
-- already excludes rows someone else reclaimed and published.
UPDATE event_outbox
SET claimed_at = NULL, claimed_by = NULL
WHERE id = ANY($2)
  AND claimed_by = $1
