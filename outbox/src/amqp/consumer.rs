//! The consumer side of the RabbitMQ adapter: subscription topology with the
//! auto-derived dead-letter queue (ADR-018 amendment #433), prefetch, and one
//! consumer per subscriber worker, each on a channel of its own so a worker's
//! batch is acked with one `multiple` frame.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_core::Stream;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, ExchangeBindOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use super::{CLOSE_TIMEOUT, LapinBroker, channel_err};
use crate::core::ports::{
    BUCKET_HEADER, ConsumerBroker, DLQ_EXCHANGE, Delivery, DeliverySource, SubscriptionSpec,
    Unsettled,
};
use crate::core::topology::{
    ArgumentValue, QueueArguments, dlq_arguments, partition_arguments, queue_arguments,
};
use crate::error::BrokerError;

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

/// `args` as an AMQP field table.
fn field_table(args: QueueArguments) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in args {
        let value = match value {
            ArgumentValue::Text(t) => text(&t),
            ArgumentValue::Int(i) => AMQPValue::LongLongInt(i),
            ArgumentValue::Bool(b) => AMQPValue::Boolean(b),
        };
        table.insert(name.into(), value);
    }
    table
}

/// The binding of bucket `bucket` to a partition queue on `<queue>.route`.
fn bucket_binding(bucket: u16) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-match".into(), text("all"));
    args.insert(BUCKET_HEADER.into(), text(&bucket.to_string()));
    args
}

/// A queue declaration's error; one that exists with other arguments
/// (`PRECONDITION_FAILED`, whose text names the queue and the argument)
/// also names the setting that chose them.
fn declare_err(spec: &SubscriptionSpec, e: lapin::Error) -> BrokerError {
    let precondition = matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Soft(
                lapin::protocol::AMQPSoftError::PRECONDITIONFAILED
            ))
    );
    if !precondition {
        return channel_err(e);
    }
    BrokerError::Channel(format!(
        "{e}; the subscription declares a {kind} queue with the arguments of this \
         version (CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE={kind}): set it to what the queue is, \
         or move the queue (docs/rabbitmq.md: \"Moving a classic subscription to quorum\")",
        kind = spec.queue_type,
    ))
}

impl LapinBroker {
    /// Declares a subscription's topology on `channel`: the topic exchange,
    /// `canopy.dlq` (direct), `<queue>.dlq` bound to it with the queue's name,
    /// the queue with its arguments (`queue_arguments`: kind, dead-letter
    /// target and, for a quorum queue, lossless dead-lettering and the
    /// delivery limit), and the queue's bindings; for an ordered
    /// subscription (`spec.partitions` > 0), instead of the queue and its
    /// bindings, `<queue>.route` and the partition queue `spec.partition`
    /// names (every one if `None`), single-active-consumer, bound by its
    /// buckets. Idempotent; a queue that
    /// exists with other arguments is refused by the broker
    /// (`PRECONDITION_FAILED`), and the error names the queue, the argument
    /// and `CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE`.
    pub async fn declare_subscription(
        channel: &Channel,
        spec: &SubscriptionSpec,
    ) -> Result<(), BrokerError> {
        let durable_exchange = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let durable_queue = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .exchange_declare(
                spec.exchange.as_str().into(),
                ExchangeKind::Topic,
                durable_exchange,
                FieldTable::default(),
            )
            .await
            .map_err(channel_err)?;
        channel
            .exchange_declare(
                DLQ_EXCHANGE.into(),
                ExchangeKind::Direct,
                durable_exchange,
                FieldTable::default(),
            )
            .await
            .map_err(channel_err)?;
        let dlq = spec.dlq_name();
        channel
            .queue_declare(
                dlq.as_str().into(),
                durable_queue,
                field_table(dlq_arguments(spec)),
            )
            .await
            .map_err(|e| declare_err(spec, e))?;
        channel
            .queue_bind(
                dlq.as_str().into(),
                DLQ_EXCHANGE.into(),
                spec.queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(channel_err)?;
        if spec.partitions > 0 {
            return Self::declare_partitions(channel, spec).await;
        }
        channel
            .queue_declare(
                spec.queue.as_str().into(),
                durable_queue,
                field_table(queue_arguments(spec)),
            )
            .await
            .map_err(|e| declare_err(spec, e))?;
        for binding in &spec.bindings {
            channel
                .queue_bind(
                    spec.queue.as_str().into(),
                    spec.exchange.as_str().into(),
                    binding.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(channel_err)?;
        }
        Ok(())
    }

    /// An ordered subscription's topology past its dead-letter queue:
    /// `<queue>.route` (headers, bound to the topic exchange with each
    /// binding, its unroutable messages to `<queue>.route.rest`, a fanout
    /// bound to partition 0) and the partition queue this consumer takes
    /// (every one if `spec.partition` is `None`), bound by its buckets.
    async fn declare_partitions(
        channel: &Channel,
        spec: &SubscriptionSpec,
    ) -> Result<(), BrokerError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let (route, rest) = (spec.route_exchange(), spec.rest_exchange());
        channel
            .exchange_declare(
                rest.as_str().into(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(channel_err)?;
        let mut route_args = FieldTable::default();
        route_args.insert("alternate-exchange".into(), text(&rest));
        channel
            .exchange_declare(
                route.as_str().into(),
                ExchangeKind::Headers,
                durable,
                route_args,
            )
            .await
            .map_err(channel_err)?;
        for binding in &spec.bindings {
            channel
                .exchange_bind(
                    route.as_str().into(),
                    spec.exchange.as_str().into(),
                    binding.as_str().into(),
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(channel_err)?;
        }
        let partitions: Vec<u16> = match spec.partition {
            Some(p) => vec![p],
            None => (0..spec.partitions).collect(),
        };
        for p in partitions {
            Self::declare_partition(channel, spec, p).await?;
        }
        Ok(())
    }

    /// Partition `p`'s queue, bound to `<queue>.route` by each of its
    /// buckets (partition 0 also to `<queue>.route.rest`).
    async fn declare_partition(
        channel: &Channel,
        spec: &SubscriptionSpec,
        p: u16,
    ) -> Result<(), BrokerError> {
        let queue = spec.partition_queue(p);
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(
                queue.as_str().into(),
                durable,
                field_table(partition_arguments(spec)),
            )
            .await
            .map_err(|e| declare_err(spec, e))?;
        let mut sources: Vec<(String, FieldTable)> = spec
            .buckets_of(p)
            .map(|b| (spec.route_exchange(), bucket_binding(b)))
            .collect();
        if p == 0 {
            sources.push((spec.rest_exchange(), FieldTable::default()));
        }
        for (exchange, args) in sources {
            channel
                .queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    "".into(),
                    QueueBindOptions::default(),
                    args,
                )
                .await
                .map_err(channel_err)?;
        }
        Ok(())
    }
}

impl ConsumerBroker for LapinBroker {
    type Consumer = LapinConsumer;

    async fn subscription_open(
        &self,
        spec: &SubscriptionSpec,
    ) -> Result<LapinConsumer, BrokerError> {
        let conn = self.connection().await?;
        let channel = conn.create_channel().await.map_err(channel_err)?;
        Self::declare_subscription(&channel, spec).await?;
        channel
            .basic_qos(spec.prefetch, BasicQosOptions::default())
            .await
            .map_err(channel_err)?;
        let consumer = channel
            .basic_consume(
                spec.consumed_queue().as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(channel_err)?;
        Ok(LapinConsumer {
            channel,
            consumer: tokio::sync::Mutex::new(consumer),
            ended: AtomicBool::new(false),
            unsettled: Unsettled::default(),
        })
    }
}

/// A lapin consumer on its own channel.
pub struct LapinConsumer {
    channel: Channel,
    consumer: tokio::sync::Mutex<lapin::Consumer>,
    ended: AtomicBool,
    unsettled: Unsettled,
}

impl std::fmt::Debug for LapinConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LapinConsumer")
            .field("channel", &self.channel.id())
            .field("ended", &self.ended.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl LapinConsumer {
    /// One `basic.ack` frame.
    async fn ack(&self, tag: u64, multiple: bool) -> Result<(), BrokerError> {
        self.channel
            .basic_ack(tag, BasicAckOptions { multiple })
            .await
            .map_err(channel_err)
    }
}

impl DeliverySource for LapinConsumer {
    async fn delivery_next(&self) -> Option<Delivery> {
        if self.ended.load(Ordering::SeqCst) {
            return None;
        }
        let mut consumer = self.consumer.lock().await;
        // Another worker may have seen the end while this one waited for the
        // lock: lapin's stream does not promise to end after an error, so
        // polling it again could wait forever.
        if self.ended.load(Ordering::SeqCst) {
            return None;
        }
        let next = std::future::poll_fn(|cx| Pin::new(&mut *consumer).poll_next(cx)).await;
        match next {
            Some(Ok(d)) => {
                self.unsettled.delivered(d.delivery_tag);
                Some(Delivery {
                    tag: d.delivery_tag,
                    message_id: d.properties.message_id().as_ref().map(|m| m.to_string()),
                    routing_key: d.routing_key.to_string(),
                    body: d.data,
                    redelivered: d.redelivered,
                    trace: super::trace_from_headers(d.properties.headers().as_ref()),
                    ordering: super::ordering_from_headers(d.properties.headers().as_ref()),
                })
            }
            Some(Err(e)) => {
                tracing::warn!(error = %channel_err(e), "consumer failed");
                self.ended.store(true, Ordering::SeqCst);
                None
            }
            None => {
                self.ended.store(true, Ordering::SeqCst);
                None
            }
        }
    }

    async fn delivery_ack(&self, tag: u64) -> Result<(), BrokerError> {
        let sent = self.ack(tag, false).await;
        self.unsettled.settled(&[tag]);
        sent
    }

    async fn delivery_ack_many(&self, tags: &[u64]) -> Result<(), BrokerError> {
        self.unsettled
            .ack(tags, |tag, multiple| self.ack(tag, multiple))
            .await
    }

    async fn delivery_nack(&self, tag: u64, requeue: bool) -> Result<(), BrokerError> {
        let sent = self
            .channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    requeue,
                    ..BasicNackOptions::default()
                },
            )
            .await
            .map_err(channel_err);
        self.unsettled.settled(&[tag]);
        sent
    }

    async fn consumer_close(&self) {
        self.ended.store(true, Ordering::SeqCst);
        self.unsettled.clear();
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.channel.close(200, "OK".into())).await;
    }
}
