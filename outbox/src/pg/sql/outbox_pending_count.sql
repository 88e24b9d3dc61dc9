-- Publisher::outbox_pending_count: unpublished, unparked rows.
SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND parked_at IS NULL
