//! The one entry point on the real services: `Outbox::builder` starts the
//! drainer, the inbox janitor and a subscription; an event written with its
//! publisher takes effect once; readiness covers the subscription; one
//! shutdown stops everything. Bad settings fail at start, naming what.

mod common;

use std::time::Duration;

use outbox::{
    DrainerConfig, EventEnvelope, Handler, HandlerError, Outbox, PgTx, StartError,
    SubscriberSettings,
};
use sqlx::PgPool;

struct Record;

impl Handler<PgTx> for Record {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO entry_effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

fn settings(queue: &str, exchange: &str) -> SubscriberSettings {
    let mut s = SubscriberSettings::new(queue, &["entry.#"]);
    s.spec.exchange = exchange.to_owned();
    s
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn an_event_published_through_the_entry_point_takes_effect_once(pool: PgPool) {
    sqlx::query("CREATE TABLE entry_effects (event_id UUID NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let (queue, exchange) = (common::unique("entry"), common::unique("entry.x"));
    let config = DrainerConfig::builder()
        .exchange(exchange.as_str())
        .build()
        .unwrap();
    let mut outbox = Outbox::builder(pool.clone())
        .amqp_urls(common::amqp_url())
        .drainer(config)
        .subscribe(settings(&queue, &exchange), Record)
        .start()
        .await
        .unwrap();
    assert!(format!("{outbox:?}").contains(&queue));
    // The subscription consumes before the event is published (else the
    // event would be routed nowhere).
    common::wait_for_queue(&queue).await;

    let event = EventEnvelope::new("entry.created", serde_json::json!({ "n": 1 }));
    let mut tx = pool.begin().await.unwrap();
    outbox
        .publisher()
        .publish_tx(&mut tx, &event)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM entry_effects WHERE event_id = $1")
            .bind(event.id)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    common::eventually(Duration::from_secs(20), || async { applied().await == 1 }).await;
    // Ready: the outbox keeps up and the subscription consumes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let readiness = outbox.readiness();
        if readiness.ready {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never ready: {:?}",
            readiness.reasons
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Nothing ended on its own.
    let ended = tokio::time::timeout(Duration::from_millis(200), outbox.subscription_ended()).await;
    assert!(ended.is_err(), "{ended:?}");
    outbox.shutdown().await.unwrap();
    assert_eq!(applied().await, 1);
    common::delete_subscription(&common::connect().await, &queue, &exchange).await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn bad_settings_fail_at_start_naming_what(pool: PgPool) {
    let config = DrainerConfig::builder().build().unwrap();
    let e = Outbox::builder(pool.clone())
        .amqp_urls("amqp://app:secret@10.0.0.1,,")
        .drainer(config.clone())
        .start()
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("CANOPY_MQ_AMQP_URLS="), "{text}");
    assert!(!text.contains("secret"), "{text}");

    let twice = Outbox::builder(pool)
        .amqp_urls(common::amqp_url())
        .drainer(config)
        .subscribe(settings("entry.same", "canopy.events"), Record)
        .subscribe(settings("entry.same", "canopy.events"), Record)
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(&twice, StartError::DuplicateSubscription(q) if q == "entry.same"),
        "{twice:?}"
    );
}
