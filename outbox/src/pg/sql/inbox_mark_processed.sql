-- Subscriber step 4, in the handler's transaction: the event took effect.
-- $1 event id, $2 subscription.
UPDATE event_inbox
SET processed_at = now()
WHERE event_id = $1
  AND subscription = $2
