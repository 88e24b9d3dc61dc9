-- Subscriber step 4 on failure, on its own connection after the attempt's
-- rollback (which also removed a row the attempt inserted): count the
-- attempt, keep the error, mark the row dead-lettered at the budget. A row
-- processed meanwhile is left alone (no row returned).
-- $1 event id, $2 subscription, $3 routing key, $4 encoded envelope,
-- $5 error, $6 max attempts.
INSERT INTO event_inbox AS i
    (event_id, subscription, routing_key, payload, attempts, last_error, dead_lettered_at)
VALUES ($1, $2, $3, $4::jsonb, 1, $5, CASE WHEN 1 >= $6 THEN now() END)
ON CONFLICT (event_id) DO UPDATE
SET attempts = i.attempts + 1,
    last_error = EXCLUDED.last_error,
    dead_lettered_at = CASE
        WHEN i.attempts + 1 >= $6 THEN coalesce(i.dead_lettered_at, now())
        ELSE i.dead_lettered_at
    END
WHERE i.processed_at IS NULL
RETURNING attempts, dead_lettered_at IS NOT NULL AS dead_lettered
