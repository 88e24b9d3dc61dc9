-- The operator console's overview of one subscription (issue 29): its rows
-- processed (or skipped) in the last $2 seconds, its unprocessed rows with a
-- failure recorded and not dead-lettered (retried), and its dead-lettered
-- rows. Each count stops at $3 rows, so asking costs no more than $3 rows
-- however large the table: the last two read the unprocessed index, the
-- first the processed one.
SELECT
    (SELECT count(*) FROM (
        SELECT 1 FROM event_inbox
         WHERE subscription = $1
           AND processed_at > now() - make_interval(secs => $2)
         LIMIT $3) recent) AS processed_recently,
    (SELECT count(*) FROM (
        SELECT 1 FROM event_inbox
         WHERE subscription = $1
           AND processed_at IS NULL
           AND dead_lettered_at IS NULL
           AND attempts > 0
         LIMIT $3) failing) AS retrying,
    (SELECT count(*) FROM (
        SELECT 1 FROM event_inbox
         WHERE subscription = $1
           AND processed_at IS NULL
           AND dead_lettered_at IS NOT NULL
         LIMIT $3) dead) AS dead_lettered
