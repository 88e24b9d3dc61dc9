-- Replay: a fresh budget for unprocessed rows of one subscription (run in
-- the replayed attempt's transaction, right after its lock, by
-- inbox_try_insert with fresh_budget).
-- $1 ids, $2 subscription.
UPDATE event_inbox
SET attempts = 0,
    dead_lettered_at = NULL
WHERE event_id = ANY($1)
  AND subscription = $2
  AND processed_at IS NULL
