//! The model: what must be true at the end of a run, folded from the trace
//! ([`Model`]), and the oracle that reads what is true from the fakes'
//! tables ([`FinalState`]). The checker compares the two; the fakes
//! themselves never judge.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use uuid::Uuid;

use crate::fakes::mq::MqState;
use crate::fakes::pg::{PgState, now_ms};
use crate::trace::{Event, HostileKind};

/// What the trace says must be true.
#[derive(Debug, Default)]
pub struct Model {
    /// Envelopes the producer committed.
    pub committed: BTreeSet<Uuid>,
    /// Envelopes whose transaction rolled back.
    pub rolled_back: BTreeSet<Uuid>,
    /// Rows written by hand with a routing key no broker accepts.
    pub unpublishable: BTreeSet<Uuid>,
    /// Hostile messages by AMQP `message_id` (kind, envelope id inside).
    pub hostile: BTreeMap<String, (HostileKind, Option<Uuid>)>,
    /// Envelope ids of hostile messages the subscriber must apply once.
    pub hostile_applies: BTreeSet<Uuid>,
    /// Envelope ids inside hostile messages it must never apply.
    pub hostile_rejected: BTreeSet<Uuid>,
    /// Keyed hostile messages it must give up on (on an ordered
    /// subscription), by the id their record in the inbox takes: their
    /// `message_id` (every such message carries a UUID there).
    pub given_up: BTreeSet<Uuid>,
    /// Events whose effect takes a deferred unique key, and the key.
    pub unique: BTreeMap<Uuid, String>,
    /// Events written with trace context, and the context.
    pub traced: BTreeMap<Uuid, crate::wire::WireTrace>,
    /// Committed events with an ordering key: the key and their number
    /// (and keyed hostile messages, by the id the subscriber keys them by).
    pub keyed: BTreeMap<Uuid, (String, i64)>,
    /// Per ordering key, its committed events by number (and a foreign
    /// publisher's keyed hostile messages).
    pub by_key: BTreeMap<String, BTreeMap<i64, Uuid>>,
    /// Parked rows an operator skipped: given up, never to be published.
    pub skipped: BTreeSet<Uuid>,
    /// Envelopes committed, then taken back by a failover.
    pub taken_back: BTreeSet<Uuid>,
}

impl Model {
    /// Folds the trace.
    pub fn from_trace(events: &[(Duration, Event)]) -> Self {
        let mut m = Self::default();
        for (_, e) in events {
            match e {
                Event::Committed { ids, .. } => m.committed.extend(ids.iter().copied()),
                Event::RolledBack { ids, .. } => m.rolled_back.extend(ids.iter().copied()),
                Event::Unpublishable { id } => {
                    m.unpublishable.insert(*id);
                }
                Event::UniqueKeyed { id, key } => {
                    m.unique.insert(*id, key.clone());
                }
                Event::Skipped { ids } => m.skipped.extend(ids.iter().copied()),
                // Never committed, as the surviving database tells it.
                Event::FailedOver { lost, .. } => {
                    for id in lost {
                        m.committed.remove(id);
                        m.taken_back.insert(*id);
                    }
                }
                Event::KeysNumbered { rows } => {
                    for (id, key, seq) in rows {
                        m.keyed.insert(*id, (key.clone(), *seq));
                        m.by_key.entry(key.clone()).or_default().insert(*seq, *id);
                    }
                }
                Event::Traced {
                    id,
                    traceparent,
                    tracestate,
                } => {
                    m.traced
                        .insert(*id, (traceparent.clone(), tracestate.clone()));
                }
                Event::Hostile {
                    kind,
                    message_id,
                    envelope_id,
                    ordering,
                } => {
                    if let Some(mid) = message_id {
                        m.hostile.insert(mid.clone(), (*kind, *envelope_id));
                    }
                    if let Some((key, seq)) = ordering {
                        let id = if kind.applies() {
                            *envelope_id
                        } else {
                            message_id.as_deref().and_then(|m| Uuid::parse_str(m).ok())
                        };
                        if let Some(id) = id {
                            if !kind.applies() {
                                m.given_up.insert(id);
                            }
                            m.keyed.insert(id, (key.clone(), *seq));
                            m.by_key.entry(key.clone()).or_default().insert(*seq, id);
                        }
                    }
                    if let Some(id) = envelope_id {
                        if kind.applies() {
                            m.hostile_applies.insert(*id);
                        } else {
                            m.hostile_rejected.insert(*id);
                        }
                    }
                }
                _ => {}
            }
        }
        m
    }

    /// Committed envelopes the broker must have stored: all but the
    /// unpublishable ones.
    pub fn publishable(&self) -> impl Iterator<Item = &Uuid> {
        self.committed
            .iter()
            .filter(|id| !self.unpublishable.contains(id) && !self.skipped.contains(id))
    }

    /// Events a subscription of every routing key must apply exactly once:
    /// the publishable committed ones and the hostile ones that are valid.
    pub fn expected_effects(&self) -> BTreeSet<Uuid> {
        self.publishable()
            .copied()
            .chain(self.hostile_applies.iter().copied())
            .collect()
    }

    /// The publishable committed events that take a deferred unique key,
    /// by key: of each key's events exactly one can take effect.
    pub fn unique_groups(&self) -> BTreeMap<&str, BTreeSet<Uuid>> {
        let mut groups: BTreeMap<&str, BTreeSet<Uuid>> = BTreeMap::new();
        for id in self.publishable() {
            if let Some(key) = self.unique.get(id) {
                groups.entry(key.as_str()).or_default().insert(*id);
            }
        }
        groups
    }

    /// The event a settled or delivered message stands for, if it stands
    /// for one: hostile messages that must not apply stand for none.
    pub fn event_of(&self, message_id: Option<&str>) -> Option<Uuid> {
        let mid = message_id?;
        match self.hostile.get(mid) {
            Some((kind, envelope)) => envelope.filter(|_| kind.applies()),
            None => Uuid::parse_str(mid).ok(),
        }
    }
}

/// What the fakes' tables hold at the end of the run.
#[derive(Debug, Clone, Default)]
pub struct FinalState {
    /// How often the broker stored each envelope the drainers published.
    pub stored: BTreeMap<Uuid, u32>,
    /// Rows parked now.
    pub parked: BTreeSet<Uuid>,
    /// Every remaining row's attempts.
    pub attempts: BTreeMap<Uuid, i32>,
    /// Rows not published (parked ones included).
    pub unpublished: BTreeSet<Uuid>,
    /// Published rows older than the outbox retention bound.
    pub overdue_published: Vec<Uuid>,
    /// The consumer side, if the run had consumers.
    pub consumer: Option<ConsumerFinal>,
}

/// The subscription's final state.
#[derive(Debug, Clone, Default)]
pub struct ConsumerFinal {
    /// Committed handler effects per event (the subscription's).
    pub effects: BTreeMap<Uuid, u32>,
    /// Inbox rows (keys) that remain.
    pub rows: BTreeSet<Uuid>,
    /// Processed inbox rows older than the inbox retention bound.
    pub overdue_processed: Vec<Uuid>,
    /// Messages in the subscription's dead-letter queue, by `message_id`.
    pub dead_letters: BTreeMap<Option<String>, u32>,
    /// Dead letters still on their way to the dead-letter queue (waiting
    /// for it to take them), by `message_id`.
    pub dead_letters_waiting: BTreeMap<Option<String>, u32>,
    /// Whether the subscription is configured with quorum queues, whose
    /// dead-lettering must lose nothing.
    pub quorum: bool,
    /// Inbox rows marked dead-lettered.
    pub dead_lettered: BTreeSet<Uuid>,
    /// The domain table's committed unique keys, and the event that took
    /// each.
    pub unique_keys: BTreeMap<String, Uuid>,
}

/// Where the oracle looks.
pub struct Oracle<'a> {
    pub pg: &'a PgState,
    pub mq: &'a MqState,
    /// The subscription's queue, if the run had consumers.
    pub queue: Option<&'a str>,
    /// Its configured queue type.
    pub queue_type: outbox::QueueType,
    /// Published rows older than this must be gone.
    pub outbox_retention_bound: Duration,
    /// Processed inbox rows older than this must be gone.
    pub inbox_retention_bound: Duration,
}

impl Oracle<'_> {
    /// Whether everything the run owes has happened: every committed row is
    /// published (or parked for good), every event the subscription must
    /// apply is processed, every hostile message that must be
    /// dead-lettered is in the dead-letter queue, and the record of every
    /// keyed one given up on was skipped. The world stops early
    /// once it is.
    pub fn quiescent(&self) -> bool {
        let db = self.pg.lock();
        let drained = db.outbox.rows().all(|r| {
            r.published_ms.is_some()
                || (r.parked_ms.is_some()
                    && crate::fakes::pg::outbox::unpublishable_key(&r.routing_key))
        });
        if !drained {
            return false;
        }
        let Some(_) = self.queue else {
            return true;
        };
        let must_apply = db
            .outbox
            .committed()
            .iter()
            .filter(|id| {
                db.outbox
                    .row(id)
                    .is_none_or(|r| !crate::fakes::pg::outbox::unpublishable_key(&r.routing_key))
            })
            .chain(self.mq.hostile_applies().iter())
            .all(|id| db.inbox.processed_ever(id) || db.inbox.lost_its_unique_key(id));
        // A keyed delivery given up on: its record skipped, its key gone on.
        let given_up = self
            .mq
            .given_up()
            .iter()
            .all(|id| db.inbox.processed_ever(id));
        drop(db);
        must_apply && given_up && self.mq.hostiles_dead_lettered()
    }

    /// Reads the final state.
    pub fn read(&self) -> FinalState {
        let now = now_ms();
        let db = self.pg.lock();
        let rows: Vec<_> = db.outbox.rows().collect();
        let mut fin = FinalState {
            stored: self.mq.stored.lock().expect("stored").counts(),
            parked: rows
                .iter()
                .filter(|r| r.published_ms.is_none() && r.parked_ms.is_some())
                .map(|r| r.id)
                .collect(),
            attempts: rows.iter().map(|r| (r.id, r.attempts)).collect(),
            unpublished: rows
                .iter()
                .filter(|r| r.published_ms.is_none())
                .map(|r| r.id)
                .collect(),
            overdue_published: crate::fakes::pg::partitions::overdue(
                db.outbox.partitions.as_ref(),
                &rows
                    .iter()
                    .map(|r| (r.id, r.published_ms))
                    .collect::<Vec<_>>(),
                self.outbox_retention_bound.as_millis() as u64,
                now,
            ),
            consumer: None,
        };
        if let Some(queue) = self.queue {
            let (mut dead_letters, mut dead_letters_waiting) = (BTreeMap::new(), BTreeMap::new());
            let queues = self.mq.queues.lock().expect("queues");
            for m in queues.ready(&format!("{queue}.dlq")) {
                *dead_letters.entry(m.message_id).or_insert(0) += 1;
            }
            for m in queues.waiting_dead_letters() {
                *dead_letters_waiting
                    .entry(m.message_id.clone())
                    .or_insert(0) += 1;
            }
            drop(queues);
            fin.consumer = Some(ConsumerFinal {
                effects: db
                    .inbox
                    .effects()
                    .iter()
                    .filter(|((sub, _), _)| sub == queue)
                    .map(|((_, id), n)| (*id, *n))
                    .collect(),
                rows: db.inbox.rows().map(|r| r.event_id).collect(),
                overdue_processed: crate::fakes::pg::partitions::overdue(
                    db.inbox.partitions.as_ref(),
                    &db.inbox
                        .rows()
                        .map(|r| (r.event_id, r.processed_ms))
                        .collect::<Vec<_>>(),
                    self.inbox_retention_bound.as_millis() as u64,
                    now,
                ),
                dead_letters,
                dead_letters_waiting,
                quorum: self.queue_type == outbox::QueueType::Quorum,
                dead_lettered: db
                    .inbox
                    .rows()
                    .filter(|r| r.subscription == queue && r.dead_lettered_ms.is_some())
                    .map(|r| r.event_id)
                    .collect(),
                unique_keys: db.inbox.unique_keys().clone(),
            });
        }
        fin
    }
}
