//! The partitioned layout (issue 28) as the fake models it: a table's rows
//! live in range partitions of their UUID v7 ids' milliseconds
//! (`migrations-partitioned/`, `outbox::pg::partitions`). The first
//! partition holds every id below the cut (the table as it was when it was
//! partitioned), one partition per width follows, and DEFAULT takes the
//! ids no partition covers. A row's partition is a function of its id and
//! the partitions that exist: a partition created while DEFAULT holds rows
//! of its range takes them along (the janitor moves them as it creates
//! it), and a dropped partition's range goes to DEFAULT from then on.

use std::collections::BTreeSet;

use crate::wire::WireRetired;

use outbox::pg::partitions::{ms_of, partition_name};
use uuid::Uuid;

/// Where a row lives. Ordered as the janitor visits partitions: the first,
/// the ranges by their start, DEFAULT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Home {
    First,
    Range(u64),
    Default,
}

/// One table's partitions, in ids' milliseconds.
#[derive(Debug, Clone)]
pub struct Partitions {
    parent: &'static str,
    width_ms: u64,
    ahead: u64,
    cut_ms: u64,
    /// The first partition is still there.
    first: bool,
    /// Range partitions after the first, by start.
    ranges: BTreeSet<u64>,
}

impl Partitions {
    /// The layout as the migrations leave it at `now_id_ms`: the cut two
    /// widths' boundaries on, `ahead` partitions from the cut.
    pub fn new(parent: &'static str, width_ms: u64, ahead: u64, now_id_ms: u64) -> Self {
        let width_ms = width_ms.max(1);
        let cut_ms = (now_id_ms / width_ms + 2) * width_ms;
        Self {
            parent,
            width_ms,
            ahead,
            cut_ms,
            first: true,
            ranges: (0..ahead).map(|i| cut_ms + i * width_ms).collect(),
        }
    }

    pub fn width_ms(&self) -> u64 {
        self.width_ms
    }

    pub fn home(&self, id: Uuid) -> Home {
        let ms = ms_of(id);
        if ms < self.cut_ms {
            return if self.first {
                Home::First
            } else {
                Home::Default
            };
        }
        let lo = ms / self.width_ms * self.width_ms;
        if self.ranges.contains(&lo) {
            Home::Range(lo)
        } else {
            Home::Default
        }
    }

    /// Its range has passed at `now_id_ms` (DEFAULT never closes).
    pub fn closed(&self, home: Home, now_id_ms: u64) -> bool {
        match home {
            Home::First => self.cut_ms <= now_id_ms,
            Home::Range(lo) => lo + self.width_ms <= now_id_ms,
            Home::Default => false,
        }
    }

    /// When its range ends, in ids' ms (DEFAULT: never).
    pub fn closes_at(&self, home: Home) -> Option<u64> {
        match home {
            Home::First => Some(self.cut_ms),
            Home::Range(lo) => Some(lo + self.width_ms),
            Home::Default => None,
        }
    }

    pub fn name(&self, home: Home) -> String {
        match home {
            Home::First => format!("{}_p_first", self.parent),
            Home::Range(lo) => partition_name(self.parent, lo),
            Home::Default => format!("{}_p_default", self.parent),
        }
    }

    /// The closed partitions, in the janitor's order.
    pub fn closed_homes(&self, now_id_ms: u64) -> Vec<Home> {
        let first = self.first.then_some(Home::First);
        first
            .into_iter()
            .chain(self.ranges.iter().map(|lo| Home::Range(*lo)))
            .filter(|h| self.closed(*h, now_id_ms))
            .collect()
    }

    /// Creates the current width's partition and `ahead` more where none
    /// covers the range; the rows DEFAULT held of that range are in it
    /// from then on. Returns their names.
    pub fn create_ahead(&mut self, now_id_ms: u64) -> Vec<String> {
        let first = now_id_ms / self.width_ms;
        let mut created = Vec::new();
        for bucket in first..=first + self.ahead {
            let lo = bucket * self.width_ms;
            let covered = (self.first && lo < self.cut_ms) || self.ranges.contains(&lo);
            // (The first partition is dropped only once closed, so a
            // bucket from now on never lies below the cut after that.)
            if covered {
                continue;
            }
            self.ranges.insert(lo);
            created.push(partition_name(self.parent, lo));
        }
        created
    }

    pub fn drop_home(&mut self, home: Home) {
        match home {
            Home::First => self.first = false,
            Home::Range(lo) => {
                self.ranges.remove(&lo);
            }
            Home::Default => unreachable!("DEFAULT is never dropped"),
        }
    }
}

/// The rows a janitor should have removed by `now` (fake ms): each row is
/// `(id, finished_ms)`, `None` while unfinished. A finished row is overdue
/// once `bound_ms` past when its retention ends: on the plain layout, when
/// it was finished; on the partitioned one, for a row of a closed partition
/// no unfinished row holds, when its partition's newest row was finished or
/// the partition closed, whichever is later (the drop takes them all), unless
/// the row sweep should have taken it before its partition closed.
pub fn overdue(
    parts: Option<&Partitions>,
    rows: &[(Uuid, Option<u64>)],
    bound_ms: u64,
    now: u64,
) -> Vec<Uuid> {
    let late = |t: u64| t + bound_ms < now;
    let Some(parts) = parts else {
        return rows
            .iter()
            .filter(|(_, f)| f.is_some_and(late))
            .map(|(id, _)| *id)
            .collect();
    };
    let mut held = BTreeSet::new();
    let mut newest: std::collections::BTreeMap<Home, u64> = Default::default();
    for (id, f) in rows {
        let home = parts.home(*id);
        match f {
            None => {
                held.insert(home);
            }
            Some(f) => {
                let n = newest.entry(home).or_insert(*f);
                *n = (*n).max(*f);
            }
        }
    }
    let now_id = super::id_ms(now);
    rows.iter()
        .filter(|(id, f)| {
            let Some(f) = *f else { return false };
            let home = parts.home(*id);
            if !late(f) {
                return false;
            }
            if held.contains(&home) || !parts.closed(home, now_id) {
                return true;
            }
            let closed_at = super::fake_ms(parts.closes_at(home).unwrap_or(0));
            late(closed_at.max(newest[&home])) || f + bound_ms < closed_at
        })
        .map(|(id, _)| *id)
        .collect()
}

/// One row as the janitor's partition work sees it: its id, when it was
/// finished (published; processed), and whether an open transaction holds
/// it locked.
pub type RowState = (Uuid, Option<u64>, bool);

/// The closed partitions no unfinished row holds: the row sweep leaves
/// their rows to a drop.
pub fn spared(parts: &Partitions, rows: &[RowState], now: u64) -> BTreeSet<Home> {
    let held: BTreeSet<Home> = rows
        .iter()
        .filter(|(_, f, _)| f.is_none())
        .map(|(id, _, _)| parts.home(*id))
        .collect();
    parts
        .closed_homes(super::id_ms(now))
        .into_iter()
        .filter(|h| !held.contains(h))
        .collect()
}

/// `outbox::pg::partitions::retire` on one table at the fake's `now`:
/// creates the partitions ahead and drops each closed one in which every
/// row was finished more than `older_than_ms` ago and no open transaction
/// holds one. Returns what it did and the ids of the rows it dropped.
pub fn retire(
    parts: &mut Partitions,
    rows: &[RowState],
    older_than_ms: u64,
    now: u64,
) -> (WireRetired, BTreeSet<Uuid>) {
    let created = parts.create_ahead(super::id_ms(now));
    let mut dropped = Vec::new();
    let mut gone = BTreeSet::new();
    for home in parts.closed_homes(super::id_ms(now)) {
        let inside: Vec<&RowState> = rows.iter().filter(|r| parts.home(r.0) == home).collect();
        let due = inside
            .iter()
            .all(|(_, f, locked)| f.is_some_and(|f| f + older_than_ms < now) && !locked);
        if due {
            gone.extend(inside.iter().map(|r| r.0));
            dropped.push(parts.name(home));
            parts.drop_home(home);
        }
    }
    let retired = WireRetired {
        partitioned: true,
        created,
        dropped,
    };
    (retired, gone)
}
