-- Subscriber step 2, when the row already exists: lock it for the rest of
-- the handler's transaction and say whether it took effect. $1 event id,
-- $2 subscription.
SELECT processed_at IS NOT NULL AS processed, attempts
FROM event_inbox
WHERE event_id = $1
  AND subscription = $2
FOR UPDATE
