-- Subscriber, in the handler's transaction (sent as a simple query, one
-- round trip): can what it holds so far commit? In an aborted transaction
-- (a handler statement failed, even if the handler swallowed the error)
-- the SAVEPOINT fails with 25P02, where a COMMIT would answer ROLLBACK with
-- no error. SET CONSTRAINTS ALL IMMEDIATE checks every deferred constraint
-- now (a deferred unique key, foreign key or constraint trigger), as the
-- COMMIT would; rolling back to the savepoint puts the constraints back to
-- deferred and their checks back in the queue, so the COMMIT checks them
-- again and later work is not held to them early.
SAVEPOINT canopy_check;
SET CONSTRAINTS ALL IMMEDIATE;
ROLLBACK TO SAVEPOINT canopy_check;
RELEASE SAVEPOINT canopy_check
