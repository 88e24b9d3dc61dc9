-- Subscriber, on a connection of its own: end the handler transaction
-- tagged $1 (inbox_begin.sql) at the server, whatever statement of it is
-- still running there. The subscriber holds that transaction and sends
-- nothing on it meanwhile, so the tag (SET LOCAL, ending with the
-- transaction) names no other. The sessions are found first
-- (MATERIALIZED), so no planner order can signal a session the filter
-- would have left out.
WITH tagged AS MATERIALIZED (
    SELECT pid
    FROM pg_stat_activity
    WHERE application_name = $1
      AND pid <> pg_backend_pid()
)
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS terminated
FROM tagged
