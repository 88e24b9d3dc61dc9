-- Replay: a fresh budget for dead-lettered rows of one subscription (run
-- in the replayed attempt's transaction, right after its lock, by
-- inbox_try_insert with fresh_budget). A row still within its budget keeps
-- its attempts: two releases of one held row that race (a replica's sweep
-- and a replay's release) would otherwise each reset what the other spent,
-- and a failing event never reach its budget.
-- $1 ids, $2 subscription.
UPDATE event_inbox
SET attempts = 0,
    dead_lettered_at = NULL
WHERE event_id = ANY($1)
  AND subscription = $2
  AND processed_at IS NULL
  AND dead_lettered_at IS NOT NULL
