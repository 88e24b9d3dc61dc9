//! Traces and metrics against the real local PostgreSQL and RabbitMQ: one
//! trace from a span around `publish_tx`, through the drainer's send span
//! (linked), to the subscriber's process span (its child), with the
//! messaging semantic conventions; a W3C `traceparent` on every published
//! message, as an independent AMQP client sees it; the counters and
//! histograms on `/metrics`, rendered by the Prometheus exporter.
//!
//! The tracing subscriber and the metrics recorder are global, so this
//! binary installs both once and its tests look only at what they made.

#[path = "../../outbox/tests/common/mod.rs"]
mod common;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::core::drainer::Drainer;
use outbox::core::ports::SubscriptionSpec;
use outbox::core::subscriber::{Handler, Subscriber, SubscriberSettings};
use outbox::pg::inbox::{PgInboxStore, PgTx};
use outbox::runtime::OsEntropy;
use outbox::trace_context::TraceContext;
use outbox::{
    DrainerConfig, EventEnvelope, HandlerError, LapinBroker, PgOutboxStore, Publisher, TokioClock,
};
use outbox_admin::{AdminAuth, AdminRouter, PrometheusHandle, install_prometheus_recorder};
use sqlx::PgPool;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

struct Telemetry {
    spans: InMemorySpanExporter,
    provider: SdkTracerProvider,
    metrics: PrometheusHandle,
}

fn telemetry() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(|| {
        let spans = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(spans.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("telemetry-test"));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .expect("one tracing subscriber per test process");
        Telemetry {
            spans,
            provider,
            metrics: install_prometheus_recorder().expect("one recorder per test process"),
        }
    })
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

struct Applies;

impl Handler<PgTx> for Applies {
    async fn handle(&self, _tx: &mut PgTx, _event: &EventEnvelope) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn one_trace_runs_from_publish_tx_through_the_drainer_to_the_handler(pool: PgPool) {
    let t = telemetry();
    let exchange = common::unique("otel.x");
    let queue = common::unique("otel.q");
    let plain = common::PlainConsumer::start(&exchange, "orders.#").await;
    let subscriber = Arc::new(Subscriber::new(
        Arc::new(PgInboxStore::new(pool.clone())),
        Arc::new(LapinBroker::new(common::amqp_url())),
        Arc::new(TokioClock::default()),
        Arc::new(Applies),
        SubscriberSettings {
            spec: SubscriptionSpec {
                queue: queue.clone(),
                exchange: exchange.clone(),
                bindings: vec!["orders.#".into()],
                prefetch: 8,
                queue_type: outbox::QueueType::Quorum,
                partitions: 0,
                partition: None,
            },
            concurrency: 2,
            max_attempts: 3,
            max_body_bytes: 64 * 1024,
            handler_timeout: Duration::from_secs(30),
            batch_max: 4,
            batch_linger: Duration::from_millis(5),
        },
    ));
    let counters = subscriber.counters();
    let (stop, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn({
        let s = subscriber.clone();
        async move { s.run(rx).await.unwrap() }
    });
    common::wait_for_queue(&queue).await;

    // Two requests, each writing one event in its own transaction.
    let publisher = Publisher::new(pool.clone());
    let mut events = Vec::new();
    let mut requests = Vec::new();
    for n in 0..2 {
        let request = tracing::info_span!("POST /orders", n);
        let event = EventEnvelope::new("orders.created", serde_json::json!({ "n": n }));
        async {
            let mut tx = pool.begin().await.unwrap();
            publisher.publish_tx(&mut tx, &event).await.unwrap();
            tx.commit().await.unwrap();
        }
        .instrument(request.clone())
        .await;
        requests.push(request.id().expect("recorded"));
        events.push(event);
    }
    // A context the caller wrote itself is kept as it is.
    let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let carried = EventEnvelope::new("orders.carried", serde_json::json!({}))
        .with_header("traceparent", own)
        .with_header("tracestate", "vendor=opaque");
    publisher.publish(&carried).await.unwrap();
    // A valid tracestate over 512 bytes is cut down as W3C says, not
    // refused with its whole context (issue 25).
    let members: Vec<String> = (0..40).map(|i| format!("vendor{i:02}=value")).collect();
    let long_state = members.join(",");
    let long = EventEnvelope::new("orders.long_state", serde_json::json!({}))
        .with_header("traceparent", own)
        .with_header("tracestate", &long_state);
    publisher.publish(&long).await.unwrap();

    let drainer = Drainer::new(
        Arc::new(PgOutboxStore::new(pool.clone())),
        Arc::new(LapinBroker::new(common::amqp_url())),
        Arc::new(TokioClock::default()),
        Arc::new(OsEntropy::default()),
        DrainerConfig::builder()
            .exchange(&exchange)
            .replica_id("otel-1")
            .build()
            .unwrap(),
    );
    assert_eq!(drainer.tick().await.unwrap().published, 4);

    // The independent client sees a valid traceparent on each message,
    // distinct per transaction, and the caller's own one untouched.
    let seen = plain.wait_for(4, Duration::from_secs(10)).await;
    let mut parents = Vec::new();
    for m in &seen {
        let tp = m.headers.get("traceparent").expect("traceparent header");
        let tc = TraceContext::parse(tp, m.headers.get("tracestate").map(String::as_str))
            .unwrap_or_else(|e| panic!("{tp}: {e}"));
        if m.message_id == carried.id.to_string() {
            assert_eq!(tp, own);
            assert_eq!(tc.tracestate(), Some("vendor=opaque"));
        } else if m.message_id == long.id.to_string() {
            assert_eq!(tp, own);
            let state = tc.tracestate().expect("the state is kept, cut down");
            assert!(
                state.len() <= 512 && long_state.starts_with(state),
                "{state}"
            );
        } else {
            parents.push(tc);
        }
    }
    assert_eq!(parents.len(), 2);
    assert_ne!(parents[0].trace_id(), parents[1].trace_id());

    common::eventually(Duration::from_secs(10), || {
        let done = counters.snapshot().processed >= 4;
        async move { done }
    })
    .await;
    let _ = stop.send(true);
    task.await.unwrap();
    t.provider.force_flush().unwrap();
    common::delete_subscription(&common::connect().await, &queue, &exchange).await;

    let spans = t.spans.get_finished_spans().unwrap();
    let named = |name: String| spans.iter().filter(move |s| s.name == name.as_str());
    for (event, _) in events.iter().zip(&requests) {
        let id = event.id.to_string();
        let create = named("create outbox".into())
            .find(|s| attr(s, "messaging.message.id").as_deref() == Some(&id))
            .expect("a create span per publish_tx");
        let request = spans
            .iter()
            .find(|s| s.span_context.span_id() == create.parent_span_id)
            .expect("the create span's parent is exported");
        assert_eq!(request.name, "POST /orders");
        let trace_id = create.span_context.trace_id();
        assert_eq!(request.span_context.trace_id(), trace_id);
        assert_eq!(
            attr(create, "messaging.system").as_deref(),
            Some("rabbitmq")
        );
        assert_eq!(
            attr(create, "messaging.operation.type").as_deref(),
            Some("create")
        );
        assert_eq!(create.span_kind, opentelemetry::trace::SpanKind::Producer);

        // The drainer's send span links to the context the row was written
        // under.
        let send = named(format!("send {exchange}"))
            .find(|s| {
                s.links
                    .iter()
                    .any(|l| l.span_context.span_id() == create.span_context.span_id())
            })
            .expect("a send span linked to the create span");
        assert_eq!(send.span_kind, opentelemetry::trace::SpanKind::Producer);
        assert_eq!(
            attr(send, "messaging.operation.type").as_deref(),
            Some("send")
        );
        assert_eq!(
            attr(send, "messaging.destination.name").as_deref(),
            Some(exchange.as_str())
        );
        assert_eq!(
            attr(send, "messaging.batch.message_count").as_deref(),
            Some("4")
        );
        let batch = spans
            .iter()
            .find(|s| s.span_context.span_id() == send.parent_span_id)
            .expect("the send span's batch");
        assert_eq!(batch.name, "outbox.batch");
        assert_eq!(attr(batch, "outbox.outcome").as_deref(), Some("published"));
        for phase in ["outbox.claim", "outbox.settle", "outbox.mark"] {
            assert!(
                named(phase.into()).any(|s| s.parent_span_id == batch.span_context.span_id()),
                "{phase} under the batch"
            );
        }

        // The subscriber's process span continues the trace.
        let process = named(format!("process {queue}"))
            .find(|s| attr(s, "messaging.message.id").as_deref() == Some(&id))
            .expect("a process span per delivery");
        assert_eq!(process.span_context.trace_id(), trace_id);
        assert_eq!(process.parent_span_id, create.span_context.span_id());
        assert_eq!(process.span_kind, opentelemetry::trace::SpanKind::Consumer);
        assert_eq!(
            attr(process, "messaging.rabbitmq.destination.routing_key").as_deref(),
            Some("orders.created")
        );
        assert_eq!(
            attr(process, "messaging.destination.subscription.name").as_deref(),
            Some(queue.as_str())
        );
        assert_eq!(
            attr(process, "outbox.inbox.outcome").as_deref(),
            Some("processed")
        );
    }
    let carried_process = named(format!("process {queue}"))
        .find(|s| attr(s, "messaging.message.id").as_deref() == Some(&carried.id.to_string()))
        .expect("the carried event's process span");
    assert_eq!(
        carried_process.span_context.trace_id(),
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap()
    );
    assert_eq!(
        carried_process.parent_span_id,
        SpanId::from_hex("b7ad6b7169203331").unwrap()
    );

    // The counters and histograms, through the exporter.
    let router = AdminRouter::new(AdminAuth::open_insecure())
        .metrics(t.metrics.clone())
        .build();
    let text = get_metrics(router).await;
    let label = format!("subscription=\"{queue}\"");
    for line in [
        format!("canopy_mq_subscriber_delivered_total{{{label}}} 4"),
        format!("canopy_mq_subscriber_processed_total{{{label}}} 4"),
        format!("canopy_mq_subscriber_handler_duration_seconds_count{{{label}}} 4"),
    ] {
        assert!(text.contains(&line), "{line} missing from\n{text}");
    }
    for name in [
        "canopy_mq_outbox_published_total",
        "canopy_mq_outbox_claim_duration_seconds_bucket",
        "canopy_mq_outbox_publish_duration_seconds_count",
        "canopy_mq_outbox_mark_duration_seconds_sum",
        "canopy_mq_outbox_commit_to_confirm_seconds_count",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
}

async fn get_metrics(router: axum::Router) -> String {
    use tower::ServiceExt;
    let req = axum::http::Request::get("/metrics")
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = router.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), axum::http::StatusCode::OK);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 22)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn a_subscription_name_cannot_break_the_metrics_text() {
    let t = telemetry();
    let evil = "evil\"\n} 1\nfake_metric{";
    metrics::counter!(
        outbox::telemetry::subscriber::DELIVERED,
        outbox::telemetry::subscriber::LABEL => evil
    )
    .increment(1);
    let router = AdminRouter::new(AdminAuth::open_insecure())
        .metrics(t.metrics.clone())
        .build();
    let text = get_metrics(router).await;
    assert!(
        text.lines()
            .all(|l| l.is_empty() || l.starts_with('#') || l.starts_with("canopy_mq_")),
        "{text}"
    );
    assert!(!text.contains("\nfake_metric"), "{text}");
}

#[tokio::test]
async fn metrics_without_an_exporter_is_a_json_404() {
    let router = AdminRouter::new(AdminAuth::open_insecure()).build();
    use tower::ServiceExt;
    let req = axum::http::Request::get("/metrics")
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = router.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), axum::http::StatusCode::NOT_FOUND);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn an_idle_drainer_polls_without_batch_spans(pool: PgPool) {
    let t = telemetry();
    let replica = common::unique("idle");
    let drainer = Drainer::new(
        Arc::new(PgOutboxStore::new(pool.clone())),
        Arc::new(LapinBroker::new(common::amqp_url())),
        Arc::new(TokioClock::default()),
        Arc::new(OsEntropy::default()),
        DrainerConfig::builder()
            .exchange(common::unique("idle.x"))
            .replica_id(&replica)
            .tick_ms(20)
            .build()
            .unwrap(),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(drainer.run(rx));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _ = stop.send(true);
    task.await.unwrap();
    t.provider.force_flush().unwrap();
    let mine: Vec<String> = t
        .spans
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| attr(s, "outbox.replica").as_deref() == Some(replica.as_str()))
        .map(|s| s.name.to_string())
        .collect();
    assert!(
        mine.len() >= 5 && mine.iter().all(|n| n == "outbox.poll"),
        "polls only, at DEBUG: {mine:?}"
    );
}
