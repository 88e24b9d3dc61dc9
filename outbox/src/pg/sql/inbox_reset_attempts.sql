-- Replay: a fresh budget for unprocessed rows. $1 ids.
UPDATE event_inbox
SET attempts = 0,
    dead_lettered_at = NULL
WHERE event_id = ANY($1)
  AND processed_at IS NULL
