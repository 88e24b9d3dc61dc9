-- Ordered subscriptions (issue 27), in the handler's transaction: an
-- existing row of a delivery that inbox_try_insert_keyed.sql found held
-- behind a dead-lettered or held event of its key (a redelivery) is marked
-- held too, if unprocessed; a processed one is left alone. Either way the
-- row is then locked by inbox_lock.sql. $1 event id, $2 subscription.
UPDATE event_inbox
SET held_at = coalesce(held_at, now())
WHERE event_id = $1
  AND subscription = $2
  AND processed_at IS NULL
