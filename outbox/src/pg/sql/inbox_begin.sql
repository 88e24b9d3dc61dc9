-- Subscriber step 1, one round trip (sent as a simple query): BEGIN, and a
-- handler transaction whose client vanished ends after a minute idle,
-- releasing its inbox row locks (see HANDLER_IDLE_IN_TX_TIMEOUT in
-- pg/inbox.rs).
BEGIN;
SET LOCAL idle_in_transaction_session_timeout = '60s';
