-- Subscriber step 1, right after BEGIN: a handler transaction whose client
-- vanished ends after a minute idle, releasing its inbox row lock (see
-- HANDLER_IDLE_IN_TX_TIMEOUT in pg/inbox.rs).
SET LOCAL idle_in_transaction_session_timeout = '60s';
