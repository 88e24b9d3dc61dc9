-- Ordered subscriptions (issue 27), in the handler's transaction, which
-- holds the key's lock (inbox_lock_keys.sql): a keyed delivery's insert
-- and its look for earlier unprocessed events of its key, one statement.
-- Sees committed rows and this transaction's own. blocked:
-- - NULL: none waits. The row is inserted as inbox_try_insert.sql inserts
--   one (marked processed) unless it exists.
-- - false: each one waits for its retry. The delivery goes back to the
--   queue behind them, and its row records that it waits too
--   (unprocessed, no attempt), so that whichever replica gets the key's
--   deliveries next, in whatever order the broker gives them back, holds
--   a later one behind it. An existing row is left as it is.
-- - true: one is dead-lettered or held. The row is recorded held
--   (unprocessed, held_at set): nothing is lost, and a replay or skip of
--   that event finds it (inbox_held.sql). An existing row is marked by
--   inbox_hold.sql.
-- written: 1 if the row was inserted. $1 event id, $2 subscription,
-- $3 routing key, $4 encoded envelope, $5 ordering key, $6 its number.
WITH behind AS (
    SELECT bool_or(dead_lettered_at IS NOT NULL OR held_at IS NOT NULL) AS blocked
    FROM event_inbox
    WHERE subscription = $2
      AND ordering_key COLLATE "C" = $5
      AND key_seq < $6
      AND processed_at IS NULL
), written AS (
    INSERT INTO event_inbox
        (event_id, subscription, routing_key, payload, processed_at,
         ordering_key, key_seq, held_at)
    SELECT $1, $2, $3, $4::jsonb,
           CASE WHEN behind.blocked IS NULL THEN now() END,
           $5, $6,
           CASE WHEN behind.blocked THEN now() END
    FROM behind
    ON CONFLICT (subscription, event_id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT blocked FROM behind) AS blocked,
       (SELECT count(*) FROM written) AS written
