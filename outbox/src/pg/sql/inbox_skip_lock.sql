-- Operators (issue 27), first in a skip's transaction: the key locks of
-- the rows to skip, in the order of the locks' numbers, as every taker
-- takes them (see inbox_lock_keys.sql). $1 subscription, $2 ids.
SELECT count(pg_advisory_xact_lock(k.lock)) AS locked
FROM (
    SELECT DISTINCT hashtextextended($1 || chr(31) || ordering_key, 0) AS lock
    FROM event_inbox
    WHERE subscription = $1
      AND event_id = ANY($2)
      AND ordering_key IS NOT NULL
    ORDER BY 1
) k
