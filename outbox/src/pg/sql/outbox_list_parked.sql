-- Parked rows, oldest parked first. $1 limit; $2 and $3 the row to start
-- after (parked_at, id; NULL: from the first); $4 ids (NULL: any); $5 leave
-- the envelope out (an empty text: a listing of many large rows reads none
-- of them); $6 a path in the event's payload (NULL: no condition) whose
-- value is the string $7, or is no string and equals $8 (NULL when $7 is
-- not JSON), as inbox_list_unprocessed.sql matches it. With the envelope
-- the drainer publishes (a row written before the envelope column: its
-- payload).
SELECT id, routing_key, attempts, last_error, enqueued_at, parked_at, ordering_key, key_seq,
       CASE WHEN $5 THEN '' ELSE COALESCE(envelope, payload::text) END AS envelope
FROM event_outbox
WHERE published_at IS NULL AND parked_at IS NOT NULL
  AND ($2::timestamptz IS NULL OR (parked_at, id) > ($2, $3::uuid))
  AND ($4::uuid[] IS NULL OR id = ANY($4))
  AND ($6::text[] IS NULL
       OR payload -> 'payload' #> $6 = to_jsonb($7::text)
       OR ($8::jsonb IS NOT NULL
           AND jsonb_typeof(payload -> 'payload' #> $6) <> 'string'
           AND payload -> 'payload' #> $6 = $8::jsonb))
ORDER BY parked_at, id
LIMIT $1
