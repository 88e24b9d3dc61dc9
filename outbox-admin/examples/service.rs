//! A small service built on the outbox, end to end in one process:
//!
//! - `POST /orders` `{"item": "…"}` writes an order and its `orders.created`
//!   event in one transaction (`publish_tx`) and answers `201` with both ids;
//! - the drainer publishes the event to RabbitMQ (`canopy.events`);
//! - a subscriber (`service.example.shipments`, bound to `orders.#`) applies
//!   it once: one row in `shipments` per order, whatever the duplicates;
//! - the admin router is mounted: `/readyz`, `/metrics` (Prometheus), and
//!   `/v1/admin/*` (with `CANOPY_MQ_ADMIN_TOKEN`, or `CANOPY_MQ_ADMIN_OPEN=true`
//!   to try it on localhost without one);
//! - the operator console at `/admin` (pending, parked and dead-lettered
//!   events; unpark, skip and replay), signed into with the admin token;
//! - `GET /orders/{id}` says whether the order's shipment exists yet.
//!
//! Every span is printed to stdout when it ends, with its trace and parent
//! ids, so one order can be followed from `POST /orders` through `create
//! outbox`, the drainer's `send canopy.events` (linked) to `process
//! service.example.shipments` (a child, in the same trace).
//!
//! ```sh
//! CANOPY_MQ_ADMIN_OPEN=true cargo run --release -p outbox-admin --example service
//! curl -s -XPOST localhost:8080/orders -H 'content-type: application/json' -d '{"item":"tea"}'
//! curl -s localhost:8080/orders/1
//! curl -s localhost:8080/metrics | grep canopy_mq_
//! curl -si localhost:8080/readyz
//! ```
//!
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/outbox_service_example`,
//! created if missing), `AMQP_URL` (default the local broker) and
//! `SERVICE_ADDR` (default `127.0.0.1:8080`) override the defaults; every
//! `CANOPY_MQ_*` variable applies as in any service.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use outbox::{EventEnvelope, Handler, HandlerError, Outbox, PgTx, Publisher, SubscriberSettings};
use outbox_admin::{AdminAuth, AdminRouter, ConsoleSettings, install_prometheus_recorder};
use sqlx::PgPool;
use sqlx::migrate::MigrateDatabase;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const QUEUE: &str = "service.example.shipments";

#[derive(Clone)]
struct App {
    pool: PgPool,
    publisher: Publisher,
}

#[derive(serde::Deserialize)]
struct NewOrder {
    item: String,
}

async fn create_order(State(app): State<App>, Json(order): Json<NewOrder>) -> Response {
    let span = tracing::info_span!("POST /orders", otel.kind = "server");
    async move {
        let result: Result<_, Box<dyn std::error::Error>> = async {
            let mut tx = app.pool.begin().await?;
            let id: i64 = sqlx::query_scalar("INSERT INTO orders (item) VALUES ($1) RETURNING id")
                .bind(&order.item)
                .fetch_one(&mut *tx)
                .await?;
            let event = EventEnvelope::new(
                "orders.created",
                serde_json::json!({ "id": id, "item": order.item }),
            );
            app.publisher.publish_tx(&mut tx, &event).await?;
            tx.commit().await?;
            Ok((id, event.id))
        }
        .await;
        match result {
            Ok((id, event_id)) => (
                StatusCode::CREATED,
                Json(serde_json::json!({ "id": id, "event_id": event_id })),
            )
                .into_response(),
            Err(e) => {
                tracing::warn!(error = %e, "order not written");
                (
                    StatusCode::BAD_REQUEST,
                    Json(serde_json::json!({ "error": e.to_string() })),
                )
                    .into_response()
            }
        }
    }
    .instrument(span)
    .await
}

async fn get_order(State(app): State<App>, Path(id): Path<i64>) -> Response {
    let row: Result<Option<(String, bool)>, _> = sqlx::query_as(
        "SELECT o.item, EXISTS (SELECT 1 FROM shipments s WHERE s.order_id = o.id)
         FROM orders o WHERE o.id = $1",
    )
    .bind(id)
    .fetch_optional(&app.pool)
    .await;
    match row {
        Ok(Some((item, shipped))) => {
            Json(serde_json::json!({ "id": id, "item": item, "shipped": shipped })).into_response()
        }
        Ok(None) => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({ "error": "no such order" })),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "error": "the database is unavailable" })),
        )
            .into_response(),
    }
}

/// Applies `orders.created`: one shipment per order, in the inbox's
/// transaction.
struct Ship;

impl Handler<PgTx> for Ship {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        let Some(order_id) = event.payload["id"].as_i64() else {
            return Err(HandlerError::msg("orders.created without an id"));
        };
        sqlx::query("INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)")
            .bind(order_id)
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Prints each finished span on one line: name, trace id, span id, parent
/// id, links and attributes.
#[derive(Debug)]
struct StdoutSpans;

impl SpanExporter for StdoutSpans {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        for s in batch {
            let attrs: Vec<String> = s
                .attributes
                .iter()
                .map(|kv| format!("{}={}", kv.key, kv.value))
                .collect();
            let links: Vec<String> = s
                .links
                .iter()
                .map(|l| l.span_context.span_id().to_string())
                .collect();
            println!(
                "span {:?} trace={} span={} parent={} kind={:?}{} {}",
                s.name,
                s.span_context.trace_id(),
                s.span_context.span_id(),
                s.parent_span_id,
                s.span_kind,
                if links.is_empty() {
                    String::new()
                } else {
                    format!(" links=[{}]", links.join(","))
                },
                attrs.join(" ")
            );
        }
        Ok(())
    }
}

/// A small service on the outbox: orders in, their events published,
/// shipments applied once, the admin routes and the operator console
/// mounted. It takes no arguments; its environment configures it.
#[derive(Debug, Parser)]
#[command(
    name = "service",
    version,
    about,
    long_about = None,
    after_help = "Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/\
                  outbox_service_example, created if missing), AMQP_URL (default the local \
                  broker), SERVICE_ADDR (default 127.0.0.1:8080), CONSOLE_READ_ONLY, \
                  CONSOLE_INSECURE_COOKIE, and every CANOPY_MQ_* variable as in any service."
)]
struct Cli {}

/// Whether the variable `name` is `true`.
fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v.trim() == "true")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    Cli::parse();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(StdoutSpans)
        .build();
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info,sqlx=warn".into()),
        ))
        .with(tracing_subscriber::fmt::layer())
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("service-example")))
        .init();
    let metrics = install_prometheus_recorder()?;
    // The admin routes' authentication, decided at boot: the token
    // (CANOPY_MQ_ADMIN_TOKEN), or open only with CANOPY_MQ_ADMIN_OPEN=true
    // and then for loopback hosts alone; a bad or missing token fails here,
    // naming the variable.
    let auth = AdminAuth::from_env()?;

    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/outbox_service_example".into());
    // The broker's nodes: CANOPY_MQ_AMQP_URLS (comma-separated), else
    // AMQP_URL, else the local node.
    let amqp_urls = std::env::var(outbox::config::vars::AMQP_URLS)
        .or_else(|_| std::env::var("AMQP_URL"))
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let addr = std::env::var("SERVICE_ADDR").unwrap_or_else(|_| "127.0.0.1:8080".into());

    // One host (the database is made if missing), or libpq's node list
    // (`h1:p1,h2:p2/db?target_session_attrs=read-write`): the pool follows
    // the writable node through a failover.
    if outbox::pg::nodes::NodeList::parse(&database_url)?.len() == 1
        && !sqlx::Postgres::database_exists(&database_url).await?
    {
        sqlx::Postgres::create_database(&database_url).await?;
    }
    let pool = outbox::pg::nodes::connect(&database_url, Default::default()).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS shipments (order_id BIGINT NOT NULL, event_id UUID NOT NULL);",
    )
    .execute(&pool)
    .await?;

    // Everything the library runs, from one entry point: the migrations,
    // the drainer (with its janitor and stats task), the subscription with
    // its handler and the inbox janitor; CANOPY_MQ_* configure each, and a
    // bad value fails here, naming the variable.
    let mut outbox = Outbox::builder(pool.clone())
        .amqp_urls(amqp_urls)
        .subscribe(SubscriberSettings::from_env(QUEUE, &["orders.#"])?, Ship)
        .start()
        .await?;

    let admin = AdminRouter::for_outbox(&outbox, auth)
        .metrics(metrics)
        // The operator console at /admin (sign in with the admin token).
        // Over plain HTTP off localhost a browser drops `Secure` cookies:
        // CONSOLE_INSECURE_COOKIE=true drops the flag for such a network;
        // CONSOLE_READ_ONLY=true takes the actions away.
        .console(
            ConsoleSettings::default()
                .read_only(flag("CONSOLE_READ_ONLY"))
                .insecure_cookie(flag("CONSOLE_INSECURE_COOKIE")),
        )
        .build();
    let app = App {
        publisher: outbox.publisher().clone(),
        pool,
    };
    let router = Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        .with_state(app)
        .merge(admin);

    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, "service example listening; Ctrl-C stops it");
    let serving = axum::serve(listener, router).with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    });
    // A subscription ends before a stop only when the broker refused to set
    // it up (a queue declared otherwise, an exchange it cannot use): the
    // service exits with that error rather than serve orders it would never
    // ship.
    tokio::select! {
        served = serving => served?,
        (queue, error) = outbox.subscription_ended() => {
            return Err(format!("subscription {queue} ended on its own: {error:?}").into());
        }
    }
    outbox.shutdown().await?;
    provider.shutdown()?;
    Ok(())
}
