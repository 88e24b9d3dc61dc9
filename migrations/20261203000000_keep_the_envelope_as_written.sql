-- The envelope as publish_tx encoded it, byte for byte, which the drainer
-- publishes as the AMQP body. The ADR's payload (JSONB) stays the queryable
-- copy; jsonb re-renders what it stores (keys reordered, spaces added, up to
-- 1.5x the bytes), which broke consumers that hash or sign the body and
-- pushed envelopes over a subscriber's size limit. Rows written before this
-- column existed have none and are published as their payload renders.
-- Adding a nullable column without a default rewrites nothing.
ALTER TABLE event_outbox ADD COLUMN envelope TEXT;
