-- Ordered subscriptions (issue 27), in the handler's transaction, first
-- for a keyed delivery: take its key's lock in this subscription until
-- the transaction ends. Deliveries, replays and skips of one key then
-- decide one after the other, each seeing what the last committed: a
-- delivery recorded held behind a dead-lettered event cannot commit after
-- that event's replay or skip looked for the key's held rows, which would
-- leave it held for ever. A lone statement, so that inbox_key_wait.sql
-- takes its snapshot after the wait. Keys of different subscriptions or
-- keys that hash alike only wait for each other. $1 subscription, $2 key.
SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, 0))
