//! The commit wakeup over the fake PostgreSQL, as `DrainerHandle` runs it
//! over PostgreSQL (`runtime::listen_for_commits`): one connection LISTENs,
//! and every notification wakes the drainer between ticks. A lost or broken
//! listener only costs latency: the tick stays the fallback, so the
//! listener reconnects after `outbox::runtime::LISTEN_RETRY` and never
//! reports an error to the drainer.

use std::sync::Arc;

use super::net::{connect_pg, exchange};
use crate::trace::{Event, Trace};
use crate::wire::{PgReply, PgRequest, read_frame};

/// Listens for commits until the host goes away, waking `wakeup` for each
/// and recording that `replica` was notified (the evidence that excuses an
/// early claim).
pub async fn listen_for_commits(replica: String, wakeup: Arc<tokio::sync::Notify>, trace: Trace) {
    let client = format!("{replica}/listen");
    loop {
        if let Ok(mut stream) = connect_pg(&client).await
            && let Ok(PgReply::Ok) = exchange(&mut stream, &PgRequest::Listen).await
        {
            while let Ok(Some(PgReply::Notification)) = read_frame::<_, PgReply>(&mut stream).await
            {
                trace.now(Event::Notified {
                    replica: replica.clone(),
                });
                wakeup.notify_one();
            }
        }
        crate::engine::sleep(outbox::runtime::LISTEN_RETRY).await;
    }
}
