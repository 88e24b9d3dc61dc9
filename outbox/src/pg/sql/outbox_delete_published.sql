-- Retention janitor: delete at most $2 rows published more than $1 seconds
-- ago, oldest first. Never an unpublished row.
DELETE FROM event_outbox
WHERE id IN (
    SELECT id
    FROM event_outbox
    WHERE published_at IS NOT NULL
      AND published_at < now() - make_interval(secs => $1)
    ORDER BY published_at
    LIMIT $2
)
