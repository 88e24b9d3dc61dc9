//! Keyed deliveries given up on at once, on an ordered subscription: one
//! that is no envelope, is over the size limit, or holds data the inbox
//! refuses still takes its place in its key's order. Before it is
//! dead-lettered it leaves a durable record under its subscription, key
//! and number (a dead-lettered inbox row whose payload says what came), so
//! the key's later events are held behind it until an operator skips it,
//! exactly as behind an event whose handler failed for good. Without the
//! record nothing held the key and its later events took effect past an
//! event that never did.

use sha2::{Digest, Sha256};

use super::consume::Prepared;
use super::outcome::DeliveryOutcome;
use super::{Handler, Subscriber};
use crate::core::ports::{
    Clock, ConsumerBroker, Delivery, InboxEntry, InboxStore, InsertOutcome, KeySeq, TxBounds,
};
use crate::error::StoreError;

/// Longest text of a reason or a `message_id` a record keeps.
const RECORD_TEXT_MAX: usize = 512;

impl<S, B, C, H> Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
    /// What a delivery given up on at once (`outcome`: undecodable, too
    /// large or unstorable) is settled with. Unkeyed, or on an unordered
    /// subscription, that is `outcome` (dead-lettered). Keyed on an
    /// ordered subscription it is recorded first ([`record_given_up`]):
    /// dead-lettered once the record holds its key (or once its event took
    /// effect already), requeued behind an earlier event of its key that
    /// waits for a retry, held (acked) behind one that is dead-lettered,
    /// and requeued, no attempt counted, when the database could not take
    /// the record: it comes back and is recorded then.
    ///
    /// [`record_given_up`]: Self::record_given_up
    pub(super) async fn settle_given_up(
        &self,
        prepared: &Prepared,
        outcome: DeliveryOutcome,
    ) -> DeliveryOutcome {
        let Some(ordering) = prepared
            .delivery
            .ordering
            .as_ref()
            .filter(|_| self.settings.spec.partitions > 0)
        else {
            return outcome;
        };
        let queue = &self.settings.spec.queue;
        let reason = reason_of(&outcome);
        let payload = record_payload(&prepared.delivery, &reason);
        let entry = InboxEntry {
            event_id: given_up_id(&prepared.delivery, queue, ordering),
            subscription: queue,
            routing_key: &prepared.delivery.routing_key,
            payload: &payload,
            fresh_budget: false,
            ordering: Some(ordering),
        };
        match self.record_given_up(&entry, &reason).await {
            Ok(InsertOutcome::BehindRetry) => DeliveryOutcome::Deferred,
            Ok(InsertOutcome::Held) => DeliveryOutcome::Held,
            Ok(_) => outcome,
            Err(e) => {
                tracing::warn!(
                    queue = %queue,
                    key = ?ordering.key,
                    seq = ordering.seq,
                    error = %e,
                    "a keyed delivery given up on could not be recorded to hold its key; \
                     requeued to be recorded when it comes back"
                );
                DeliveryOutcome::Requeued
            }
        }
    }

    /// Records `entry` (keyed) dead-lettered for `reason` in a transaction
    /// of its own, under its key's lock: inserted (or found unprocessed)
    /// and marked dead-lettered at once, unless an earlier event of its
    /// key holds it back (then recorded waiting or held, as any delivery
    /// of the key would be) or its event took effect already. Returns what
    /// the insert found.
    pub(super) async fn record_given_up(
        &self,
        entry: &InboxEntry<'_>,
        reason: &str,
    ) -> Result<InsertOutcome, StoreError> {
        let bounds = TxBounds::for_handler(self.settings.handler_timeout);
        let mut tx = self.store.inbox_begin(bounds).await?;
        match self.record_in(&mut tx, entry, reason).await {
            Ok(found) => {
                self.store.inbox_commit(tx).await?;
                Ok(found)
            }
            Err(e) => {
                self.store.inbox_rollback(tx).await;
                Err(e)
            }
        }
    }

    /// The statements of [`record_given_up`](Self::record_given_up).
    async fn record_in(
        &self,
        tx: &mut S::Tx,
        entry: &InboxEntry<'_>,
        reason: &str,
    ) -> Result<InsertOutcome, StoreError> {
        if let Some(o) = entry.ordering {
            self.store
                .inbox_lock_keys(tx, entry.subscription, &[o.key.as_str()])
                .await?;
        }
        let found = self.store.inbox_try_insert(tx, entry).await?;
        if matches!(
            found,
            InsertOutcome::Inserted | InsertOutcome::InFlightRetry { .. }
        ) {
            self.store.inbox_savepoint(tx).await?;
            // A budget of one: dead-lettered with this record.
            self.store
                .inbox_record_failure(tx, entry, reason, 1)
                .await?;
        }
        Ok(found)
    }
}

/// Why a delivery was given up on, in words.
fn reason_of(outcome: &DeliveryOutcome) -> String {
    let text = match outcome {
        DeliveryOutcome::Undecodable { reason } => format!("not an envelope: {reason}"),
        DeliveryOutcome::TooLarge { bytes, limit } => {
            format!("{bytes} bytes, over the subscriber's limit of {limit}")
        }
        DeliveryOutcome::Unstorable { reason } => format!("the inbox refused it: {reason}"),
        other => format!("given up on: {}", other.label()),
    };
    printable(&text)
}

/// `text` cut to [`RECORD_TEXT_MAX`] bytes with every control character
/// replaced: what a record keeps must be storable (`jsonb` refuses
/// `\u0000`) and fit one log line.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(RECORD_TEXT_MAX));
    for c in text.chars() {
        if out.len() + c.len_utf8() > RECORD_TEXT_MAX {
            break;
        }
        out.push(if c.is_control() { '?' } else { c });
    }
    out
}

/// The record's payload: JSON saying what came (never its body, which may
/// be huge or unstorable). It is no envelope, so a replay of the record
/// answers `Undecodable` and leaves it dead-lettered; a skip lets the key
/// go on.
fn record_payload(delivery: &Delivery, reason: &str) -> Vec<u8> {
    let record = serde_json::json!({
        "given_up": {
            "reason": reason,
            "bytes": delivery.body.len(),
            "message_id": delivery.message_id.as_deref().map(printable),
            "routing_key": printable(&delivery.routing_key),
        }
    });
    serde_json::to_vec(&record).expect("a JSON value encodes")
}

/// The record's event id: the delivery's `message_id` when it is a UUID
/// (the drainer sets it to the envelope id, so a redelivery, or a copy of
/// an event that took effect, finds its row); else one derived from the
/// subscription, key and number (UUID version 8), the same for every
/// redelivery.
fn given_up_id(delivery: &Delivery, queue: &str, ordering: &KeySeq) -> uuid::Uuid {
    if let Some(id) = delivery
        .message_id
        .as_deref()
        .and_then(|m| uuid::Uuid::parse_str(m).ok())
    {
        return id;
    }
    let digest = Sha256::new()
        .chain_update(b"canopy-outbox given up\0")
        .chain_update(queue.as_bytes())
        .chain_update(b"\0")
        .chain_update(ordering.key.as_bytes())
        .chain_update(b"\0")
        .chain_update(ordering.seq.to_be_bytes())
        .finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    uuid::Uuid::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(message_id: Option<&str>) -> Delivery {
        Delivery {
            tag: 1,
            message_id: message_id.map(str::to_owned),
            routing_key: "orders.changed".into(),
            body: b"\xff not json".to_vec(),
            redelivered: false,
            trace: None,
            ordering: None,
        }
    }

    #[test]
    fn a_records_id_is_the_message_id_or_one_of_its_key_and_number() {
        let key = |seq| KeySeq {
            key: "acct-1".into(),
            seq,
        };
        let id = uuid::Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0042);
        assert_eq!(
            given_up_id(&delivery(Some(&id.to_string())), "q", &key(2)),
            id
        );
        let a = given_up_id(&delivery(Some("not a uuid")), "q", &key(2));
        assert_eq!(a, given_up_id(&delivery(None), "q", &key(2)));
        assert_eq!(a.get_version_num(), 8);
        assert_ne!(a, given_up_id(&delivery(None), "q", &key(3)));
        assert_ne!(a, given_up_id(&delivery(None), "other", &key(2)));
    }

    #[test]
    fn a_records_payload_is_storable_json_and_no_envelope() {
        let mut d = delivery(Some("id\0with\u{1b}controls"));
        d.routing_key = "k\0".into();
        let payload = record_payload(&d, &printable("bad\0reason"));
        let text = String::from_utf8(payload.clone()).unwrap();
        assert!(
            !text.contains("\\u0000") && !text.contains("\\u001b"),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_slice(&payload).unwrap();
        assert_eq!(v["given_up"]["bytes"], 10);
        assert!(crate::envelope::EventEnvelope::decode_delivery(&payload).is_err());
        assert_eq!(printable(&"é".repeat(1000)).len(), RECORD_TEXT_MAX);
    }
}
