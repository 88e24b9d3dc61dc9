-- Inbox janitor: delete at most $2 rows processed more than $1 seconds ago,
-- oldest first. Never an unprocessed row (replay needs those).
DELETE FROM event_inbox
WHERE (subscription, event_id) IN (
    SELECT subscription, event_id
    FROM event_inbox
    WHERE processed_at IS NOT NULL
      AND processed_at < now() - make_interval(secs => $1)
    ORDER BY processed_at
    LIMIT $2
)
