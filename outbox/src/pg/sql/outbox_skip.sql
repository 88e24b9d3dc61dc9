-- Skip (issue 27 admin surface): the parked rows among $1 (every parked
-- row for NULL) are given up: marked as done without being published
-- (published_at, so the janitor deletes them in time and their keys' later
-- events go on; skipped_at records that nothing was sent) and their lease
-- dropped. last_error and attempts are kept as history. Only parked rows:
-- a row a drainer may be publishing is never skipped.
UPDATE event_outbox
SET published_at = now(), skipped_at = now(), claimed_at = NULL, claimed_by = NULL
WHERE published_at IS NULL
  AND parked_at IS NOT NULL
  AND ($1::uuid[] IS NULL OR id = ANY($1))
