//! The `OutboxStore` port over the fake PostgreSQL, for the production
//! drainer and janitor. Besides doing what the sqlx adapter does (the same
//! statements; the key window, the claim, the mark of published rows and
//! the release alone on sessions of the drainer's own that commit
//! asynchronously, the rest on ordinary sessions), it records the replica's
//! view of its calls:
//! when it asked for a claim, what the claim returned, when it asked to mark
//! or release which rows, and which calls failed. The checker's timing rules
//! (#1061's deadline, backoff after failures) read these.

use std::time::Duration;

use outbox::StoreError;
use outbox::core::ports::{
    ClaimParams, ClaimPosition, ClaimedRow, FailOutcome, KeyHead, KeySeq, KeyWindow, OutboxStats,
    OutboxStore, ParkedFilter, ParkedRow, PartitionsRetired, RowFailure, UnparkSelector,
};
use outbox::trace_context::TraceContext;
use uuid::Uuid;

use super::hooks::{Hooks, Point};
use super::net::{PgClient, unexpected};
use crate::trace::{Call, Event, Trace};
use crate::wire::{PgReply, PgRequest};

/// The `OutboxStore` port over the fake PostgreSQL.
pub struct SimStore {
    /// An ordinary session: what must survive a crash (attempts, parking,
    /// the operator's unpark and skip, the janitor, the stats).
    pg: PgClient,
    /// The drainer's own session (`outbox::pg::PgOutboxStore`): the key
    /// window, the claim, the mark of published rows, the release, each
    /// committed asynchronously.
    drain: PgClient,
    replica: String,
    hooks: Hooks,
    trace: Trace,
    /// A key window began this replica's claim: the claim call that
    /// follows is the same call in the trace (traced once, from the
    /// window's start, so the checker sees how long the replica was in it).
    in_claim: std::sync::atomic::AtomicBool,
}

impl SimStore {
    /// A store for `replica`.
    pub fn new(replica: impl Into<String>, trace: Trace, hooks: Hooks) -> Self {
        let replica = replica.into();
        Self {
            pg: PgClient::new(replica.clone(), trace.clone()),
            drain: PgClient::drainer(replica.clone(), trace.clone()),
            replica,
            hooks,
            trace,
            in_claim: Default::default(),
        }
    }

    /// Records that the replica called a mark or release for `ids`.
    fn called(&self, call: Call, ids: Vec<Uuid>) {
        self.trace.now(Event::StoreCalled {
            replica: self.replica.clone(),
            call,
            ids,
        });
    }

    /// Records a drainer call's failure (its success is recorded by the
    /// call it is part of), and passes the result on.
    fn answered_if_failed<T>(
        &self,
        call: Call,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if result.is_err() {
            return self.answered(call, result);
        }
        result
    }

    /// Records how a drainer call ended, and passes the result on.
    fn answered<T>(&self, call: Call, result: Result<T, StoreError>) -> Result<T, StoreError> {
        let replica = self.replica.clone();
        self.trace.now(match result {
            Ok(_) => Event::StoreAnswered { replica, call },
            Err(_) => Event::StoreFailed { replica, call },
        });
        result
    }

    async fn claim(&self, p: ClaimParams<'_>) -> Result<Vec<ClaimedRow>, StoreError> {
        // Like the PostgreSQL adapter: one statement on the drainer's own
        // session, no transaction around it.
        let reply = self
            .drain
            .call(PgRequest::Claim {
                replica: p.replica_id.to_owned(),
                batch_size: p.batch_size,
                lease_ttl_ms: p.lease_ttl.as_millis() as u64,
                key_heads: p.key_heads.to_vec(),
                after: p.after.map(|a| (a.enqueued_at_micros, a.id)),
            })
            .await?;
        let rows = match reply {
            PgReply::Rows(rows) => rows,
            other => return Err(unexpected(other)),
        };
        if !rows.is_empty() {
            self.hooks
                .at(Point::AfterClaim, &self.replica, &self.trace)
                .await;
        }
        Ok(rows
            .into_iter()
            .map(|r| ClaimedRow {
                id: r.id,
                routing_key: r.routing_key,
                trace: trace_of(&r.body),
                body: r.body.into_bytes(),
                attempts: r.attempts,
                age: Duration::from_millis(r.age_ms),
                ordering: r.ordering.map(|(key, seq)| KeySeq { key, seq }),
                position: Some(ClaimPosition {
                    enqueued_at_micros: r.enqueued_us,
                    id: r.id,
                }),
            })
            .collect())
    }

    async fn mark_published(&self, replica_id: &str, ids: &[Uuid]) -> Result<u64, StoreError> {
        self.hooks
            .at(Point::BeforeMark, &self.replica, &self.trace)
            .await;
        let reply = self
            .drain
            .call(PgRequest::MarkPublished {
                replica: replica_id.to_owned(),
                ids: ids.to_vec(),
            })
            .await?;
        self.hooks
            .at(Point::MidMark, &self.replica, &self.trace)
            .await;
        match reply {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn mark_failed(
        &self,
        replica_id: &str,
        failures: &[RowFailure],
        max_attempts: u32,
    ) -> Result<FailOutcome, StoreError> {
        let reply = self
            .pg
            .call(PgRequest::MarkFailed {
                replica: replica_id.to_owned(),
                failures: failures.iter().map(|f| (f.id, f.error.clone())).collect(),
                max_attempts,
            })
            .await?;
        match reply {
            PgReply::Failed { recorded, parked } => Ok(FailOutcome { recorded, parked }),
            other => Err(unexpected(other)),
        }
    }

    async fn release(&self, replica_id: &str, ids: &[Uuid]) -> Result<u64, StoreError> {
        match self
            .drain
            .call(PgRequest::Release {
                replica: replica_id.to_owned(),
                ids: ids.to_vec(),
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }
}

impl outbox::core::ports::Replication for SimStore {
    async fn replication_positions(
        &self,
        standbys: &[String],
    ) -> Result<outbox::core::ports::ReplicationPositions, StoreError> {
        super::net::replication_positions(&self.drain, standbys).await
    }
}

impl OutboxStore for SimStore {
    async fn outbox_key_window(
        &self,
        after: &str,
        limit: u32,
        lease_ttl: Duration,
    ) -> Result<KeyWindow, StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        // A claim may ask for a second window (the cursor wrapped): the
        // claim call began with the first.
        if !self.in_claim.swap(true, SeqCst) {
            self.trace.now(Event::ClaimCalled {
                replica: self.replica.clone(),
            });
        }
        let reply = self
            .drain
            .call(PgRequest::KeyWindow {
                after: after.to_owned(),
                limit,
                lease_ttl_ms: lease_ttl.as_millis() as u64,
            })
            .await;
        let reply = reply.inspect_err(|_| self.in_claim.store(false, SeqCst));
        match self.answered_if_failed(Call::Claim, reply)? {
            PgReply::KeyWindow(heads) => Ok(KeyWindow {
                exhausted: heads.len() < limit as usize,
                heads: heads
                    .into_iter()
                    .map(|(key, id, claimable)| KeyHead { key, id, claimable })
                    .collect(),
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_claim(&self, p: ClaimParams<'_>) -> Result<Vec<ClaimedRow>, StoreError> {
        if !self
            .in_claim
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            self.trace.now(Event::ClaimCalled {
                replica: self.replica.clone(),
            });
        }
        if p.after.is_some() {
            self.trace.now(Event::ClaimResumed {
                replica: self.replica.clone(),
            });
        }
        let rows = self.answered(Call::Claim, self.claim(p).await)?;
        self.trace.now(Event::ClaimReturned {
            replica: self.replica.clone(),
            ids: rows.iter().map(|r| r.id).collect(),
        });
        Ok(rows)
    }

    async fn outbox_mark_published(
        &self,
        replica_id: &str,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        self.called(Call::MarkPublished, ids.to_vec());
        let result = self.mark_published(replica_id, ids).await;
        self.answered(Call::MarkPublished, result)
    }

    async fn outbox_mark_failed(
        &self,
        replica_id: &str,
        failures: &[RowFailure],
        max_attempts: u32,
    ) -> Result<FailOutcome, StoreError> {
        self.called(Call::MarkFailed, failures.iter().map(|f| f.id).collect());
        let result = self.mark_failed(replica_id, failures, max_attempts).await;
        self.answered(Call::MarkFailed, result)
    }

    async fn outbox_release(&self, replica_id: &str, ids: &[Uuid]) -> Result<u64, StoreError> {
        self.called(Call::Release, ids.to_vec());
        let result = self.release(replica_id, ids).await;
        self.answered(Call::Release, result)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        let answered = match self.pg.call(PgRequest::Stats).await {
            Ok(PgReply::Stats {
                pending,
                oldest_age_ms,
                parked,
                blocked,
            }) => {
                self.trace.now(Event::StatsAnswered {
                    replica: self.replica.clone(),
                    pending,
                    oldest_age_ms,
                    parked,
                    blocked,
                });
                return Ok(OutboxStats {
                    pending,
                    oldest_unpublished_age_secs: oldest_age_ms as f64 / 1000.0,
                    parked,
                    blocked,
                });
            }
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(e),
        };
        self.trace.now(Event::StatsFailed {
            replica: self.replica.clone(),
        });
        answered
    }

    async fn outbox_delete_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        match self
            .pg
            .call(PgRequest::DeletePublished {
                older_than_ms: older_than.as_millis() as u64,
                limit,
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_retire_partitions(
        &self,
        older_than: Duration,
    ) -> Result<PartitionsRetired, StoreError> {
        match self
            .pg
            .call(PgRequest::RetirePartitions {
                older_than_ms: older_than.as_millis() as u64,
            })
            .await?
        {
            PgReply::Retired(r) => Ok(retired(r)),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_list_parked(&self, f: &ParkedFilter) -> Result<Vec<ParkedRow>, StoreError> {
        let epoch = time::OffsetDateTime::UNIX_EPOCH;
        let after = f.after.map(|c| {
            let ms = (c.parked_at - epoch).whole_milliseconds();
            (u64::try_from(ms).unwrap_or(0), c.id)
        });
        let request = PgRequest::ListParked {
            limit: f.limit,
            after,
            ids: f.ids.clone(),
            payload_field: f.payload_field.clone(),
            omit_envelope: f.omit_envelope,
        };
        match self.pg.call(request).await? {
            PgReply::Parked(rows) => Ok(rows
                .into_iter()
                .map(|r| ParkedRow {
                    id: r.id,
                    routing_key: r.routing_key,
                    attempts: r.attempts,
                    last_error: r.last_error,
                    enqueued_at: epoch + Duration::from_millis(r.enqueued_ms),
                    parked_at: epoch + Duration::from_millis(r.parked_ms),
                    ordering: r.ordering.map(|(key, seq)| KeySeq { key, seq }),
                    envelope: r.envelope,
                })
                .collect()),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_unpark(&self, selector: &UnparkSelector) -> Result<u64, StoreError> {
        match self
            .pg
            .call(PgRequest::Unpark {
                ids: ids_of(selector),
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_skip(&self, selector: &UnparkSelector) -> Result<u64, StoreError> {
        match self
            .pg
            .call(PgRequest::Skip {
                ids: ids_of(selector),
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }
}

/// The ids a selector names (`None`: every parked row).
fn ids_of(selector: &UnparkSelector) -> Option<Vec<Uuid>> {
    match selector {
        UnparkSelector::Ids(ids) => Some(ids.clone()),
        UnparkSelector::All => None,
    }
}

/// What PostgreSQL's `payload->'headers'->>'traceparent'` (and
/// `tracestate`) give for a stored envelope, validated as the adapter does.
fn trace_of(body: &str) -> Option<TraceContext> {
    #[derive(serde::Deserialize)]
    struct Headers {
        #[serde(default)]
        headers: std::collections::BTreeMap<String, String>,
    }
    if !body.contains(outbox::trace_context::TRACEPARENT) {
        return None;
    }
    let h: Headers = serde_json::from_str(body).ok()?;
    TraceContext::from_headers(&h.headers)
}

/// `PartitionsRetired` from the wire.
pub(crate) fn retired(r: crate::wire::WireRetired) -> PartitionsRetired {
    PartitionsRetired {
        partitioned: r.partitioned,
        created: r.created,
        dropped: r.dropped,
    }
}
