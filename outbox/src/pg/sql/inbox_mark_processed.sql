-- Subscriber step 4, in the handler's transaction: the event took effect.
-- Only for a row that existed before the attempt (a retry, a replay): a row
-- the attempt inserted carries its mark already (inbox_try_insert.sql).
-- $1 event id, $2 subscription.
UPDATE event_inbox
SET processed_at = now()
WHERE event_id = $1
  AND subscription = $2
