//! The write-ahead log as a crash sees it: which commits a crash of the
//! server takes back. A synchronous commit (PostgreSQL's default) returns
//! only once its WAL is flushed, and its flush covers every commit before
//! it; an asynchronous one (`synchronous_commit = off`, as the drainer's
//! own sessions run, `outbox::pg::DRAIN_SESSION_SETTINGS`) returns at once,
//! and the WAL writer flushes it within `3 × wal_writer_delay` (600 ms by
//! default). A crash before that loses it: the rows it changed are back
//! as they were, though its client was told it committed.
//!
//! Survivable because of what the drainer commits asynchronously: a claim
//! lost is a lease that never was (the rows are claimed again), a mark of
//! published rows lost means they are published again (the consumer's
//! inbox absorbs the duplicate), a release lost is a lease that expires.
//! Whatever must survive (an insert of `publish_tx`, an attempt, a park,
//! an operator's unpark or skip, every inbox commit) commits synchronously.

use super::outbox::Row;

/// How long after an asynchronous commit the WAL writer has surely
/// flushed it (`3 × wal_writer_delay`, PostgreSQL's bound).
pub const WAL_WRITER_FLUSH_MS: u64 = 600;

/// The asynchronous commits a crash would still lose, and the WAL's
/// positions: one unit per commit that wrote (PostgreSQL's are bytes; the
/// durability gates only compare them).
#[derive(Debug, Default, Clone)]
pub struct Wal {
    /// Oldest first: when each committed (the fake's milliseconds), its
    /// position, and the outbox rows it changed as they were before it.
    unflushed: Vec<(u64, u64, Vec<Row>)>,
    /// The position of the latest commit that wrote.
    inserted: u64,
    /// When the flush position reached where: (from ms, position), in the
    /// order recorded (an asynchronous commit's point lies
    /// [`WAL_WRITER_FLUSH_MS`] ahead), the old ones folded into `floor`.
    flushes: Vec<(u64, u64)>,
    /// The flush position before the oldest point of `flushes`.
    floor: u64,
    /// Promotions so far: the timeline is one more.
    promotions: u32,
}

/// Points of [`Wal::flushes`] kept before the old ones are folded.
const FLUSHES_KEPT: usize = 256;
/// How far back a flush position can be asked for (the standby's lag and
/// more).
pub const FLUSH_HISTORY_MS: u64 = 2_000;

impl Wal {
    /// An asynchronous commit at `now` that changed the rows `before`
    /// shows as they were.
    pub fn async_commit(&mut self, now: u64, before: Vec<Row>) {
        self.inserted += 1;
        self.unflushed.push((now, self.inserted, before));
        self.flushed_from(now + WAL_WRITER_FLUSH_MS, now);
    }

    /// A synchronous commit at `now`: its flush covers every commit before
    /// it.
    pub fn flush(&mut self, now: u64) {
        self.inserted += 1;
        self.unflushed.clear();
        self.flushed_from(now, now);
    }

    /// The flush position reaches `inserted` at `at` (recorded at `now`).
    fn flushed_from(&mut self, at: u64, now: u64) {
        self.flushes.push((at, self.inserted));
        if self.flushes.len() > FLUSHES_KEPT {
            let horizon = now.saturating_sub(FLUSH_HISTORY_MS);
            let floor = &mut self.floor;
            self.flushes.retain(|&(at, lsn)| {
                let old = at < horizon;
                if old {
                    *floor = (*floor).max(lsn);
                }
                !old
            });
        }
    }

    /// A clean shutdown at `now` (a switchover's): everything is flushed.
    pub fn shutdown(&mut self, now: u64) {
        self.unflushed.clear();
        self.flushed_from(now, now);
    }

    /// The position of the latest commit that wrote.
    pub fn inserted(&self) -> u64 {
        self.inserted
    }

    /// A promotion of the standby whose WAL this is, from a primary with
    /// WAL `old`: it goes on, on the timeline after `old`'s.
    pub fn promoted_after(&mut self, old: &Wal) {
        self.promotions = old.promotions + 1;
    }

    /// The server's timeline: 1, and one more at each promotion.
    pub fn timeline(&self) -> u32 {
        self.promotions + 1
    }

    /// The flush position at `t` (`pg_current_wal_flush_lsn()`; `t` no
    /// older than [`FLUSH_HISTORY_MS`]): the latest synchronous commit's
    /// by then, or a later asynchronous commit's that the WAL writer had
    /// surely flushed by then.
    pub fn flushed_at(&self, t: u64) -> u64 {
        self.flushes
            .iter()
            .filter(|(at, _)| *at <= t)
            .map(|(_, lsn)| *lsn)
            .fold(self.floor, u64::max)
    }

    /// The server crashed at `now`: the rows of every asynchronous commit
    /// the WAL writer had not surely flushed, as they were before it,
    /// newest commit first (so restoring them in order undoes them).
    pub fn crash(&mut self, now: u64) -> Vec<Row> {
        let lost = std::mem::take(&mut self.unflushed);
        lost.into_iter()
            .filter(|(at, _, _)| at + WAL_WRITER_FLUSH_MS > now)
            .rev()
            .flat_map(|(_, _, before)| before.into_iter().rev())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: u128, claimed_ms: Option<u64>) -> Row {
        let mut r = Row::new(uuid::Uuid::from_u128(n), "k".into(), "{}".into(), 0);
        r.claimed_ms = claimed_ms;
        r
    }

    #[test]
    fn a_crash_loses_only_the_unflushed_asynchronous_commits_newest_first() {
        let mut wal = Wal::default();
        wal.async_commit(1_000, vec![row(1, None)]);
        wal.async_commit(2_000, vec![row(2, None), row(3, Some(5))]);
        wal.async_commit(2_100, vec![row(2, Some(2_000))]);
        // The first is older than the WAL writer's bound at 2 200 ms.
        let lost = wal.crash(2_200);
        let ids: Vec<u128> = lost.iter().map(|r| r.id.as_u128()).collect();
        assert_eq!(
            ids,
            vec![2, 3, 2],
            "newest commit first, each undone in reverse"
        );
        assert_eq!(lost[0].claimed_ms, Some(2_000));
        assert_eq!(
            lost[2].claimed_ms, None,
            "row 2 ends as before its first lost commit"
        );
        assert!(wal.crash(2_300).is_empty(), "a crash empties the log");
    }

    #[test]
    fn a_synchronous_commit_flushes_every_earlier_one() {
        let mut wal = Wal::default();
        wal.async_commit(1_000, vec![row(1, None)]);
        assert_eq!(wal.flushed_at(1_001), 0, "not flushed yet");
        wal.flush(1_001);
        assert_eq!(wal.flushed_at(1_001), 2);
        assert_eq!(wal.flushed_at(1_000), 0, "as it stood before");
        assert!(wal.crash(1_001).is_empty());
    }

    #[test]
    fn the_wal_writer_flushes_an_asynchronous_commit_within_its_bound() {
        let mut wal = Wal::default();
        wal.flush(900);
        wal.async_commit(1_000, vec![row(1, None)]);
        assert_eq!(wal.flushed_at(1_000 + WAL_WRITER_FLUSH_MS - 1), 1);
        assert_eq!(wal.flushed_at(1_000 + WAL_WRITER_FLUSH_MS), 2);
    }

    #[test]
    fn old_flush_points_fold_into_the_floor() {
        let mut wal = Wal::default();
        for ms in 0..(FLUSHES_KEPT as u64 * 2) {
            wal.flush(ms * 100);
        }
        let now = FLUSHES_KEPT as u64 * 200 - 100;
        assert!(wal.flushes.len() <= FLUSHES_KEPT + 1);
        assert_eq!(wal.flushed_at(now), wal.inserted());
        let back = now - FLUSH_HISTORY_MS;
        assert_eq!(
            wal.flushed_at(back),
            back / 100 + 1,
            "exact within the history"
        );
    }
}
