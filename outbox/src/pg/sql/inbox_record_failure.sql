-- Subscriber step 4 on failure, in the handler's transaction after
-- inbox_rollback_handler.sql: count the attempt, keep the error, mark the row
-- dead-lettered at the budget. It commits with the transaction, so the count
-- survives the handler's rollback (the ADR's reason for a separate
-- connection) and a retry after a lost reply cannot count one failure twice.
-- It also clears the processed mark a new row is inserted with (see
-- inbox_try_insert.sql): the handler only runs for unprocessed rows.
-- $1 event id, $2 error, $3 max attempts, $4 subscription.
UPDATE event_inbox
SET processed_at = NULL,
    attempts = attempts + 1,
    last_error = $2,
    dead_lettered_at = CASE
        WHEN attempts + 1 >= $3 THEN coalesce(dead_lettered_at, now())
        ELSE dead_lettered_at
    END
WHERE event_id = $1
  AND subscription = $4
RETURNING attempts, dead_lettered_at IS NOT NULL AS dead_lettered
