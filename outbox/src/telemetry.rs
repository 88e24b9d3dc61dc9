//! What the library reports: span names and attributes, and metric names.
//!
//! # Spans
//!
//! Spans are `tracing` spans; they cost nothing without a subscriber, and
//! with [`tracing-opentelemetry`](https://docs.rs/tracing-opentelemetry)
//! they become OpenTelemetry spans named by their `otel.name` field, with
//! the [messaging semantic conventions]' attributes
//! (`messaging.system = "rabbitmq"`, `messaging.operation.name`,
//! `messaging.operation.type`, `messaging.destination.name` = the exchange,
//! `messaging.message.id`, `messaging.rabbitmq.destination.routing_key`,
//! `messaging.batch.message_count`).
//!
//! | span (`otel.name`) | kind | where | attributes beyond the above |
//! |---|---|---|---|
//! | `create <exchange or "outbox">` | producer | `publish_tx`, `publish_many_tx` | message id (one envelope) or batch count |
//! | `outbox.batch` | internal | one per claim that found rows (or was expected to: a commit woke the drainer, or the last claim was full) | `outbox.replica`, rows, `outbox.outcome`, published, nacked, mark-lost |
//! | `outbox.claim` | internal | child of the batch | |
//! | `outbox.poll` | internal, DEBUG | a claim on the tick; its batch, if it finds rows, follows from it | `outbox.replica` |
//! | `send <exchange>` | producer | child of the batch: the publishes | batch count; one link per row to the context it was written under |
//! | `outbox.settle` | internal | child of the batch: the last confirms | |
//! | `outbox.mark` | internal | child of the batch | |
//! | `outbox.reconnect` | internal | the drainer replacing its connection | |
//! | `outbox.janitor` | internal | one retention sweep | deleted |
//! | `process <queue>` | consumer | one per delivery; parent: the context the delivery carries | `messaging.destination.subscription.name`, delivery tag, `outbox.inbox.outcome` |
//! | `outbox.replay` | internal | an operator's replay | subscription, rows |
//!
//! # Trace context
//!
//! See [`crate::trace_context`]: `publish_tx` stores the W3C context of its
//! `create` span (with the `otel` feature) in the envelope's headers, the
//! drainer sets it as the `traceparent`/`tracestate` AMQP headers and links
//! its `send` span to it, the subscriber's `process` span continues it.
//!
//! # Metrics
//!
//! Through the [`metrics`](https://docs.rs/metrics) facade (nothing is
//! recorded until the service installs a recorder; the admin router's
//! `/metrics` renders the Prometheus exporter's, see
//! `http::install_prometheus_recorder`). Durations are histograms in
//! seconds; counters end in `_total`.
//!
//! [messaging semantic conventions]: https://opentelemetry.io/docs/specs/semconv/messaging/rabbitmq/

/// Drainer metric names (no labels).
pub mod drainer {
    /// Counter: rows confirmed by the broker and marked published.
    pub const PUBLISHED: &str = "canopy_mq_outbox_published_total";
    /// Counter: rows the broker refused (or that could not be published),
    /// recorded as a row-culpable attempt.
    pub const NACKED: &str = "canopy_mq_outbox_nacked_total";
    /// Counter: rows parked after `max_attempts` row-culpable failures.
    pub const PARKED: &str = "canopy_mq_outbox_parked_total";
    /// Counter: claims handed back after an infrastructure failure
    /// (attempts untouched).
    pub const RELEASED: &str = "canopy_mq_outbox_released_total";
    /// Counter: confirmed rows whose mark found the lease gone (another
    /// replica reclaimed them; they will be published again).
    pub const MARK_LOST: &str = "canopy_mq_outbox_mark_lost_total";
    /// Histogram (seconds): one claim statement.
    pub const CLAIM_DURATION: &str = "canopy_mq_outbox_claim_duration_seconds";
    /// Histogram (seconds): one batch's Phase 2, first publish to last
    /// confirm.
    pub const PUBLISH_DURATION: &str = "canopy_mq_outbox_publish_duration_seconds";
    /// Histogram (seconds): one batch's marks.
    pub const MARK_DURATION: &str = "canopy_mq_outbox_mark_duration_seconds";
    /// Histogram (seconds), per row: from the row's write (`enqueued_at`,
    /// the writing transaction's start) to the broker's confirm.
    pub const COMMIT_TO_CONFIRM: &str = "canopy_mq_outbox_commit_to_confirm_seconds";
    /// Gauge: 1 when the outbox keeps up (see readiness), else 0.
    pub const READY: &str = "canopy_mq_outbox_ready";
}

/// Subscriber metric names, each labelled `subscription` (the queue).
pub mod subscriber {
    /// Counter: deliveries received.
    pub const DELIVERED: &str = "canopy_mq_subscriber_delivered_total";
    /// Counter: deliveries (and replays) whose effect committed.
    pub const PROCESSED: &str = "canopy_mq_subscriber_processed_total";
    /// Counter: deliveries absorbed by the inbox as duplicates.
    pub const DUPLICATES: &str = "canopy_mq_subscriber_duplicates_total";
    /// Counter: failed handler attempts requeued.
    pub const RETRIED: &str = "canopy_mq_subscriber_retried_total";
    /// Counter: deliveries of an ordered subscription requeued behind an
    /// earlier event of their key being retried (no attempt counted).
    pub const DEFERRED: &str = "canopy_mq_subscriber_deferred_total";
    /// Counter: deliveries of an ordered subscription recorded held behind
    /// a dead-lettered event of their key (acked, applied on its replay or
    /// skip).
    pub const HELD: &str = "canopy_mq_subscriber_held_total";
    /// Counter: deliveries dead-lettered after the attempt budget.
    pub const DEAD_LETTERED: &str = "canopy_mq_subscriber_dead_lettered_total";
    /// Counter: deliveries dead-lettered at once (not an envelope, too
    /// large, or refused by the inbox).
    pub const UNDECODABLE: &str = "canopy_mq_subscriber_undecodable_total";
    /// Histogram (seconds): one handler run.
    pub const HANDLER_DURATION: &str = "canopy_mq_subscriber_handler_duration_seconds";
    /// The label naming the subscription.
    pub const LABEL: &str = "subscription";
}

/// Propagation between `tracing` spans and [`TraceContext`]; real with the
/// `otel` feature, no-ops without it.
pub(crate) mod propagation {
    #[cfg(not(feature = "otel"))]
    use crate::trace_context::TraceContext;

    #[cfg(feature = "otel")]
    pub(crate) use super::otel::{capture, link, set_parent};

    /// The W3C context of `span` (never without `otel`).
    #[cfg(not(feature = "otel"))]
    #[inline]
    pub(crate) fn capture(_span: &tracing::Span) -> Option<TraceContext> {
        None
    }

    /// Makes `trace` the parent of `span` (a no-op without `otel`).
    #[cfg(not(feature = "otel"))]
    #[inline]
    pub(crate) fn set_parent(_span: &tracing::Span, _trace: &TraceContext) {}

    /// Links `span` to `trace` (a no-op without `otel`).
    #[cfg(not(feature = "otel"))]
    #[inline]
    pub(crate) fn link(_span: &tracing::Span, _trace: &TraceContext) {}
}

#[cfg(feature = "otel")]
mod otel {
    use std::str::FromStr;

    use opentelemetry::Context;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::trace_context::TraceContext;

    /// The W3C context of `span`, if it is recorded by OpenTelemetry.
    pub(crate) fn capture(span: &tracing::Span) -> Option<TraceContext> {
        if span.is_disabled() {
            return None;
        }
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        if !sc.is_valid() {
            return None;
        }
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        let state = sc.trace_state().header();
        TraceContext::parse(&traceparent, Some(&state)).ok()
    }

    fn span_context(trace: &TraceContext) -> Option<SpanContext> {
        let trace_id = TraceId::from_hex(trace.trace_id()).ok()?;
        let span_id = SpanId::from_hex(trace.parent_id()).ok()?;
        let flags = u8::from_str_radix(&trace.traceparent()[53..55], 16).ok()?;
        let state = trace
            .tracestate()
            .and_then(|s| TraceState::from_str(s).ok())
            .unwrap_or_default();
        Some(SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8()),
            true,
            state,
        ))
    }

    /// Makes `trace` the (remote) parent of `span`, which must not have
    /// been entered yet.
    pub(crate) fn set_parent(span: &tracing::Span, trace: &TraceContext) {
        if span.is_disabled() {
            return;
        }
        if let Some(sc) = span_context(trace) {
            let _ = span.set_parent(Context::new().with_remote_span_context(sc));
        }
    }

    /// Links `span` to `trace`.
    pub(crate) fn link(span: &tracing::Span, trace: &TraceContext) {
        if span.is_disabled() {
            return;
        }
        if let Some(sc) = span_context(trace) {
            span.add_link(sc);
        }
    }
}
