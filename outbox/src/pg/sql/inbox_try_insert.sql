-- Subscriber step 2 (#433), in the handler's transaction: insert the inbox
-- row unless it exists. A concurrent transaction holding an uncommitted row
-- for the same event and subscription makes this wait until it ends, so
-- deliveries of one event to one subscription serialize here. $1 event id,
-- $2 subscription, $3 routing key, $4 encoded envelope, $5 and $6 its
-- ordering key and number on an ordered subscription (else NULL).
--
-- A new row is inserted already marked processed: if the handler then
-- succeeds nothing more is written (no second row version, no index
-- entries twice); if it fails, inbox_record_failure.sql unmarks it. Other
-- sessions never see the mark before the commit, which carries the effect.
INSERT INTO event_inbox
    (event_id, subscription, routing_key, payload, processed_at, ordering_key, key_seq)
VALUES ($1, $2, $3, $4::jsonb, now(), $5, $6)
ON CONFLICT (subscription, event_id) DO NOTHING
