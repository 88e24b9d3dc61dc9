-- Operators (issue 27), first in a skip's transaction: the key locks of
-- the rows to skip (see inbox_key_lock.sql), in key order.
-- $1 subscription, $2 ids.
SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || k.ordering_key, 0))
FROM (
    SELECT DISTINCT ordering_key
    FROM event_inbox
    WHERE subscription = $1
      AND event_id = ANY($2)
      AND ordering_key IS NOT NULL
    ORDER BY ordering_key
) k
