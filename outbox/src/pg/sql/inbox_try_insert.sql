-- Subscriber step 2 (#433), in the handler's transaction: insert the inbox
-- row unless it exists. A concurrent transaction holding an uncommitted row
-- for the same event and subscription makes this wait until it ends, so
-- deliveries of one event to one subscription serialize here. $1 event id,
-- $2 subscription, $3 routing key, $4 encoded envelope.
INSERT INTO event_inbox (event_id, subscription, routing_key, payload)
VALUES ($1, $2, $3, $4::jsonb)
ON CONFLICT (subscription, event_id) DO NOTHING
