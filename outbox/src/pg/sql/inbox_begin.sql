-- Subscriber step 1, one round trip (sent as a simple query; the adapter
-- fills in the three values, all its own: two numbers and a tag of hex
-- digits). BEGIN, and the server's own bounds on the handler's
-- transaction (core::ports::TxBounds):
-- - a transaction whose client vanished ends after {idle_ms} ms idle,
--   releasing its inbox row locks;
-- - no statement runs past {statement_ms} ms (the handler's deadline and a
--   grace), so one whose client gave up ends even if nothing reaches the
--   server to end it;
-- - application_name names the transaction, so that when the subscriber
--   gives up on it (a handler past its deadline, whose statement PostgreSQL
--   keeps running) another connection can end it
--   (inbox_terminate.sql). SET LOCAL: all three end with the transaction.
BEGIN;
SET LOCAL idle_in_transaction_session_timeout = '{idle_ms}ms';
SET LOCAL statement_timeout = '{statement_ms}ms';
SET LOCAL application_name = '{tag}';
