-- Replay and operators: unprocessed rows, oldest first, filtered.
-- $1 ids (NULL: any), $2 subscription (NULL: any), $3 routing key
-- (NULL: any), $4 dead-lettered only, $5 limit, $6 and $7 the row to start
-- after (received_at, event_id; NULL: from the first), $8 leave the
-- payload out (an empty text: a listing of many large rows reads none of
-- them), $9 a path in the event's payload (NULL: no condition) whose value
-- is the string $10, or is no string and equals $11 (NULL when $10 is not
-- JSON).
SELECT event_id, subscription, routing_key,
       CASE WHEN $8 THEN '' ELSE payload::text END AS payload,
       attempts, last_error, received_at, dead_lettered_at,
       ordering_key, key_seq, held_at IS NOT NULL AS held
FROM event_inbox
WHERE processed_at IS NULL
  AND ($1::uuid[] IS NULL OR event_id = ANY($1))
  AND ($2::text IS NULL OR subscription = $2)
  AND ($3::text IS NULL OR routing_key = $3)
  AND (NOT $4 OR dead_lettered_at IS NOT NULL)
  AND ($6::timestamptz IS NULL OR (received_at, event_id) > ($6, $7::uuid))
  AND ($9::text[] IS NULL
       OR payload -> 'payload' #> $9 = to_jsonb($10::text)
       OR ($11::jsonb IS NOT NULL
           AND jsonb_typeof(payload -> 'payload' #> $9) <> 'string'
           AND payload -> 'payload' #> $9 = $11::jsonb))
ORDER BY received_at, event_id
LIMIT $5
