-- Ordered subscriptions (issue 27): held rows nothing holds back any more,
-- each its key's lowest: no earlier unprocessed row of its key is
-- dead-lettered or waiting for a retry, so the subscriber releases it (a
-- replay or skip that released the key's rows was cut short, or a held
-- row was replayed alone). $1 subscription, $2 limit.
SELECT DISTINCT ON (h.ordering_key COLLATE "C")
       h.event_id, h.subscription, h.routing_key, h.payload::text AS payload,
       h.attempts, h.last_error, h.received_at, h.dead_lettered_at,
       h.ordering_key, h.key_seq, TRUE AS held
FROM event_inbox h
WHERE h.subscription = $1
  AND h.processed_at IS NULL
  AND h.ordering_key IS NOT NULL
  AND h.held_at IS NOT NULL
  AND h.dead_lettered_at IS NULL
  AND NOT EXISTS (
      SELECT 1
      FROM event_inbox d
      WHERE d.subscription = h.subscription
        AND d.ordering_key COLLATE "C" = h.ordering_key COLLATE "C"
        AND d.key_seq < h.key_seq
        AND d.processed_at IS NULL
        AND (d.dead_lettered_at IS NOT NULL OR d.held_at IS NULL)
  )
ORDER BY h.ordering_key COLLATE "C", h.key_seq
LIMIT $2
