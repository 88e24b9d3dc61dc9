-- Ordered subscriptions (issue 27), in the handler's transaction: record a
-- delivery held behind a dead-lettered event of its key: unprocessed, with
-- its envelope, key and number, so nothing is lost and a replay or skip of
-- that event finds it (inbox_held.sql). An existing unprocessed row of the
-- event (a redelivery) is marked held too; a processed one is left alone.
-- Either way the row is then locked by inbox_lock.sql. $1 event id,
-- $2 subscription, $3 routing key, $4 encoded envelope, $5 ordering key,
-- $6 its number.
INSERT INTO event_inbox
    (event_id, subscription, routing_key, payload, ordering_key, key_seq, held_at)
VALUES ($1, $2, $3, $4::jsonb, $5, $6, now())
ON CONFLICT (subscription, event_id) DO UPDATE
    SET held_at = coalesce(event_inbox.held_at, now())
    WHERE event_inbox.processed_at IS NULL
