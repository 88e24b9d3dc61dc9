-- Ordered subscriptions (issue 27): a key's held rows above a number,
-- lowest first: what a replay or skip of the key's dead-lettered event
-- releases, in the key's order. $1 subscription, $2 ordering key, $3 the
-- number to start after, $4 limit.
SELECT event_id, subscription, routing_key, payload::text AS payload,
       attempts, last_error, received_at, dead_lettered_at,
       ordering_key, key_seq, held_at IS NOT NULL AS held
FROM event_inbox
WHERE subscription = $1
  AND ordering_key COLLATE "C" = $2
  AND key_seq > $3
  AND processed_at IS NULL
  AND held_at IS NOT NULL
ORDER BY key_seq
LIMIT $4
