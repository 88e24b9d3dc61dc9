//! `Publisher`: writes envelopes into `event_outbox` inside the caller's
//! transaction (ADR-018's `publish_tx`). Once `publish_tx` returns Ok and the
//! caller commits, the drainer will publish the event at least once; if the
//! caller rolls back, the event never existed.

use std::collections::BTreeSet;

use sqlx::{PgPool, Postgres, Transaction};

use tracing::{Instrument, Span, field};

use super::sql;
use crate::envelope::{EnvelopeLimits, EventEnvelope};
use crate::error::PublishError;
use crate::telemetry::propagation;

/// Name of the outbox primary-key constraint (PostgreSQL's default name).
const PKEY: &str = "event_outbox_pkey";

/// Writes envelopes into the outbox.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox::{EventEnvelope, Publisher};
/// let publisher = Publisher::new(pool.clone());
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES (42)").execute(&mut *tx).await?;
/// publisher
///     .publish_tx(&mut tx, &EventEnvelope::new("orders.created", serde_json::json!({"id": 42})))
///     .await?;
/// tx.commit().await?; // the order and its event commit together
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Publisher {
    pool: PgPool,
    limits: EnvelopeLimits,
}

impl Publisher {
    /// A publisher with the default [`EnvelopeLimits`].
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            limits: EnvelopeLimits::default(),
        }
    }

    /// Replaces the envelope limits.
    #[must_use]
    pub fn with_limits(mut self, limits: EnvelopeLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> &EnvelopeLimits {
        &self.limits
    }

    /// Writes `envelope` into the caller's transaction. Validation errors are
    /// returned before anything is written.
    ///
    /// Runs in a `create outbox` span (a child of the caller's); with the
    /// `otel` feature, that span's W3C context is stored in the envelope's
    /// `traceparent`/`tracestate` headers (unless it has a `traceparent`
    /// already), so the drainer and the consumer continue the trace.
    pub async fn publish_tx(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        envelope: &EventEnvelope,
    ) -> Result<(), PublishError> {
        let span = create_span();
        span.record("messaging.message.id", field::display(envelope.id));
        span.record(
            "messaging.rabbitmq.destination.routing_key",
            envelope.routing_key.as_str(),
        );
        let trace = propagation::capture(&span);
        let body = envelope.encode_traced(&self.limits, trace.as_ref())?;
        // Unkeyed envelopes take the statement they always took.
        let statement = match envelope.ordering_key {
            None => sql::INSERT,
            Some(_) => sql::INSERT_KEYED,
        };
        let mut query = sqlx::query(statement)
            .bind(envelope.id)
            .bind(&envelope.routing_key)
            .bind(body);
        if let Some(key) = &envelope.ordering_key {
            query = query.bind(key);
        }
        query
            .execute(&mut **tx)
            .instrument(span)
            .await
            .map_err(|e| map_insert_err(e, Some(envelope.id)))?;
        Ok(())
    }

    /// Writes many envelopes into the caller's transaction in one round-trip.
    /// Every envelope is validated before anything is written; one invalid
    /// envelope refuses the whole call.
    ///
    /// One `create outbox` span for the call; with the `otel` feature its
    /// context goes into each envelope that has no `traceparent` of its own.
    pub async fn publish_many_tx(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        envelopes: &[EventEnvelope],
    ) -> Result<(), PublishError> {
        if envelopes.is_empty() {
            return Ok(());
        }
        let span = create_span();
        span.record("messaging.batch.message_count", envelopes.len());
        let trace = propagation::capture(&span);
        let mut seen = BTreeSet::new();
        let mut ids = Vec::with_capacity(envelopes.len());
        let mut keys = Vec::with_capacity(envelopes.len());
        let mut bodies = Vec::with_capacity(envelopes.len());
        for env in envelopes {
            if !seen.insert(env.id) {
                return Err(PublishError::DuplicateId { id: env.id });
            }
            bodies.push(env.encode_traced(&self.limits, trace.as_ref())?);
            ids.push(env.id);
            keys.push(env.routing_key.as_str());
        }
        let ordering: Vec<Option<&str>> = envelopes
            .iter()
            .map(|e| e.ordering_key.as_deref())
            .collect();
        let keyed = ordering.iter().any(Option::is_some);
        let mut query = sqlx::query(if keyed {
            sql::INSERT_MANY_KEYED
        } else {
            sql::INSERT_MANY
        })
        .bind(&ids)
        .bind(&keys)
        .bind(&bodies);
        if keyed {
            query = query.bind(&ordering);
        }
        query
            .execute(&mut **tx)
            .instrument(span)
            .await
            .map_err(|e| map_insert_err(e, None))?;
        Ok(())
    }

    /// Writes `envelope` in a one-shot transaction of its own (for call sites
    /// with no domain transaction in scope).
    pub async fn publish(&self, envelope: &EventEnvelope) -> Result<(), PublishError> {
        envelope.validate(&self.limits)?;
        let mut tx = self.pool.begin().await.map_err(PublishError::Database)?;
        self.publish_tx(&mut tx, envelope).await?;
        tx.commit().await.map_err(PublishError::Database)
    }

    /// Unpublished, unparked rows (parked rows are counted separately by the
    /// stats task).
    pub async fn outbox_pending_count(&self) -> Result<u64, PublishError> {
        let n: i64 = sqlx::query_scalar(sql::PENDING_COUNT)
            .fetch_one(&self.pool)
            .await
            .map_err(PublishError::Database)?;
        Ok(n.max(0) as u64)
    }
}

/// The `create outbox` span of one `publish_tx` or `publish_many_tx` call
/// (the message's creation context, in the semantic conventions' terms).
fn create_span() -> Span {
    tracing::info_span!(
        "create",
        otel.name = "create outbox",
        otel.kind = "producer",
        messaging.system = "rabbitmq",
        messaging.operation.name = "create",
        messaging.operation.type = "create",
        messaging.message.id = field::Empty,
        messaging.rabbitmq.destination.routing_key = field::Empty,
        messaging.batch.message_count = field::Empty,
    )
}

fn map_insert_err(e: sqlx::Error, id: Option<uuid::Uuid>) -> PublishError {
    if let sqlx::Error::Database(db) = &e
        && db.constraint() == Some(PKEY)
    {
        let id = id.or_else(|| db_detail_id(db.as_ref()));
        if let Some(id) = id {
            return PublishError::DuplicateId { id };
        }
    }
    PublishError::Database(e)
}

/// Pulls the id out of "Key (id)=(…) already exists." where the batch insert
/// does not tell us which envelope collided.
fn db_detail_id(db: &dyn sqlx::error::DatabaseError) -> Option<uuid::Uuid> {
    let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    let detail = pg.detail()?;
    let start = detail.find("=(")? + 2;
    let end = start + detail[start..].find(')')?;
    detail[start..end].parse().ok()
}
