-- Ordered subscriptions (issue 27), in the handler's transaction before a
-- keyed delivery's insert: does an earlier event of its key wait, and is
-- one of those dead-lettered or held? NULL: none waits (apply it); false:
-- each one waits for its retry (requeue it behind them); true: one is
-- dead-lettered or held (record it held). Sees committed rows and this
-- transaction's own. $1 subscription, $2 ordering key, $3 its number.
SELECT bool_or(dead_lettered_at IS NOT NULL OR held_at IS NOT NULL) AS blocked
FROM event_inbox
WHERE subscription = $1
  AND ordering_key COLLATE "C" = $2
  AND key_seq < $3
  AND processed_at IS NULL
