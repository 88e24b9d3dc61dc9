//! The arguments a subscription declares its queues with, decided here once
//! for every broker adapter: the RabbitMQ adapter turns them into a field
//! table, and the simulation sends them to its fake broker, which honours
//! what they say (a declaration that would let a dead letter be dropped
//! drops it there too).

use super::ports::{
    DLQ_DELIVERY_LIMIT, DLQ_EXCHANGE, QUORUM_DELIVERY_LIMIT, QueueType, SubscriptionSpec,
};

/// One queue argument's value.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ArgumentValue {
    /// A long string.
    Text(String),
    /// A signed 64-bit integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
}

/// A queue declaration's arguments (`x-…`), in the order they are set.
pub type QueueArguments = Vec<(&'static str, ArgumentValue)>;

fn text(value: &str) -> ArgumentValue {
    ArgumentValue::Text(value.to_owned())
}

/// The subscription queue's arguments, every one that decides whether a
/// message can be dropped set explicitly: its kind, where it dead-letters
/// (`canopy.dlq`, routing key the queue's name) and, for a quorum queue,
/// dead-lettering that cannot lose a message (`at-least-once`, which
/// RabbitMQ only honours with `x-overflow = reject-publish`: with another
/// overflow it silently falls back to at-most-once) and the delivery limit
/// ([`QUORUM_DELIVERY_LIMIT`], far above the inbox's own attempt budget).
pub fn queue_arguments(spec: &SubscriptionSpec) -> QueueArguments {
    let mut args = vec![
        ("x-queue-type", text(spec.queue_type.as_str())),
        ("x-dead-letter-exchange", text(DLQ_EXCHANGE)),
        ("x-dead-letter-routing-key", text(&spec.queue)),
    ];
    if spec.queue_type == QueueType::Quorum {
        args.push(("x-dead-letter-strategy", text("at-least-once")));
        args.push(("x-overflow", text("reject-publish")));
        args.push((
            "x-delivery-limit",
            ArgumentValue::Int(QUORUM_DELIVERY_LIMIT.into()),
        ));
    }
    args
}

/// A partition queue's arguments: the subscription queue's, and a single
/// active consumer (one consumer of one replica at a time gets its
/// deliveries; the others wait, and the next takes over, the unsettled
/// deliveries redelivered first in their order, when it goes).
pub fn partition_arguments(spec: &SubscriptionSpec) -> QueueArguments {
    let mut args = queue_arguments(spec);
    args.push(("x-single-active-consumer", ArgumentValue::Bool(true)));
    args
}

/// The arguments of the queues a subscription consumes from: each
/// partition queue's on an ordered subscription, else the queue's.
pub fn consumed_arguments(spec: &SubscriptionSpec) -> QueueArguments {
    if spec.partitions > 0 {
        partition_arguments(spec)
    } else {
        queue_arguments(spec)
    }
}

/// `<queue>.dlq`'s arguments: the same kind as the queue; a quorum one
/// refuses publishes when full rather than dropping its oldest (a full
/// dead-letter queue makes at-least-once dead-lettering keep the message in
/// the subscription queue and retry), and has in effect no delivery limit
/// ([`DLQ_DELIVERY_LIMIT`]).
pub fn dlq_arguments(spec: &SubscriptionSpec) -> QueueArguments {
    let mut args = vec![("x-queue-type", text(spec.queue_type.as_str()))];
    if spec.queue_type == QueueType::Quorum {
        args.push(("x-overflow", text("reject-publish")));
        args.push((
            "x-delivery-limit",
            ArgumentValue::Int(DLQ_DELIVERY_LIMIT.into()),
        ));
    }
    args
}

/// The text of argument `name` in `args`, if set to a text.
pub fn text_argument<'a>(
    args: &'a [(impl AsRef<str>, ArgumentValue)],
    name: &str,
) -> Option<&'a str> {
    args.iter().find_map(|(n, v)| match v {
        ArgumentValue::Text(t) if n.as_ref() == name => Some(t.as_str()),
        _ => None,
    })
}
