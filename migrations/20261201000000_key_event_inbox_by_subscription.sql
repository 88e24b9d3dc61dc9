-- Issue 11: each subscription of a service takes an event's effect once.
-- Keyed by the event id alone, the inbox let the first of two subscriptions
-- (queues) that both receive an event take the row, and the second found it
-- "already processed" and acked without running its handler: its effect
-- was lost. The key becomes (subscription, event_id): each subscription
-- has its own row, budget and dead-letter mark for the event. The #433
-- migration stays byte-identical; forward-only.
ALTER TABLE event_inbox DROP CONSTRAINT event_inbox_pkey;
ALTER TABLE event_inbox ADD PRIMARY KEY (subscription, event_id);
