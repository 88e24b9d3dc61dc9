//! A picture of a run: one lane per host over simulated time, as an SVG
//! with no script and no dependency (`sim run ... --timeline FILE.svg`).
//!
//! A lane has a row per kind of thing its host did (commits; claims,
//! publishes, confirms, marks; deliveries, acks, nacks, handler failures,
//! inbox commits; faults that hit it), each row a strip of time buckets
//! whose shade is how many happened in that bucket (a bucket's `<title>`
//! gives the count). Above the lanes, the fault windows, one row per kind of
//! fault; a crashed host's lane is hatched while it is down; the heal is a
//! dashed line; the first violation is a red line across every lane, its
//! invariant and detail written beside it. The picture is a function of the
//! trace and the verdict only: the same seed gives the same bytes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use crate::checker::Violation;
use crate::trace::{Event, FaultKind, HandlerResult, Settle};

/// Pixels for the time axis.
const PLOT_WIDTH: f64 = 1200.0;
/// Pixels per bucket.
const BUCKET_PX: f64 = 3.0;
/// Left margin for lane and row labels.
const LABEL_WIDTH: f64 = 170.0;
/// Pixels per row.
const ROW_HEIGHT: f64 = 11.0;
/// Gap between lanes.
const LANE_GAP: f64 = 8.0;
/// Header (title, violation text) height.
const HEADER: f64 = 52.0;
/// Time axis height.
const AXIS: f64 = 26.0;

/// A kind of thing a host does, one row of its lane (in drawing order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Row {
    Commit,
    Rollback,
    Claim,
    Publish,
    Confirm,
    Mark,
    MarkFailed,
    Release,
    Delivery,
    Ack,
    Requeue,
    DeadLetter,
    HandlerFailed,
    InboxCommit,
    Replay,
    Fault,
}

impl Row {
    fn label(self) -> &'static str {
        match self {
            Row::Commit => "commit",
            Row::Rollback => "rollback",
            Row::Claim => "claim",
            Row::Publish => "publish",
            Row::Confirm => "confirm",
            Row::Mark => "mark published",
            Row::MarkFailed => "mark failed",
            Row::Release => "release",
            Row::Delivery => "delivery",
            Row::Ack => "ack",
            Row::Requeue => "nack, requeue",
            Row::DeadLetter => "nack, dead-letter",
            Row::HandlerFailed => "handler failed",
            Row::InboxCommit => "inbox commit",
            Row::Replay => "replay",
            Row::Fault => "fault",
        }
    }

    fn color(self) -> &'static str {
        match self {
            Row::Commit => "#2b8a3e",
            Row::Rollback => "#868e96",
            Row::Claim => "#1c7ed6",
            Row::Publish => "#4263eb",
            Row::Confirm => "#7048e8",
            Row::Mark => "#0c8599",
            Row::MarkFailed => "#e8590c",
            Row::Release => "#f59f00",
            Row::Delivery => "#5c940d",
            Row::Ack => "#2f9e44",
            Row::Requeue => "#f08c00",
            Row::DeadLetter => "#c2255c",
            Row::HandlerFailed => "#e03131",
            Row::InboxCommit => "#087f5b",
            Row::Replay => "#9c36b5",
            Row::Fault => "#c92a2a",
        }
    }
}

/// The host a client name belongs to: `drainer-2#3` (third incarnation)
/// is host `drainer-2`.
fn host_of(client: &str) -> &str {
    client.split_once('#').map_or(client, |(h, _)| h)
}

/// Lanes in reading order: the producer, drainers, consumers, the rest.
fn lane_rank(host: &str) -> (u8, &str) {
    let rank = if host == "workload" {
        0
    } else if host.starts_with("drainer") {
        1
    } else if host.starts_with("consumer") {
        2
    } else {
        3
    };
    (rank, host)
}

/// Which lane and row an event is drawn in, if any.
fn placed(e: &Event) -> Option<(&str, Row)> {
    Some(match e {
        Event::Committed { client, .. } => (host_of(client), Row::Commit),
        Event::RolledBack { client, .. } => (host_of(client), Row::Rollback),
        // An empty claim is the drainer polling: not drawn.
        Event::ClaimReturned { replica, ids } if !ids.is_empty() => (host_of(replica), Row::Claim),
        Event::PublishSent { client, .. } => (host_of(client), Row::Publish),
        Event::ConfirmReceived { client, .. } => (host_of(client), Row::Confirm),
        Event::MarkedPublished { replica, .. } => (host_of(replica), Row::Mark),
        Event::MarkedFailed { replica, .. } => (host_of(replica), Row::MarkFailed),
        Event::Released { replica, .. } => (host_of(replica), Row::Release),
        Event::Delivered { client, .. } => (host_of(client), Row::Delivery),
        Event::Settled { client, settle, .. } => (
            host_of(client),
            match settle {
                Settle::Ack => Row::Ack,
                Settle::Requeue => Row::Requeue,
                Settle::DeadLetter => Row::DeadLetter,
            },
        ),
        Event::HandlerRan {
            client,
            result: HandlerResult::Failed | HandlerResult::Overran,
            ..
        } => (host_of(client), Row::HandlerFailed),
        Event::InboxCommitted { client, .. } => (host_of(client), Row::InboxCommit),
        Event::Replayed { client, .. } | Event::ReplayReleased { client, .. } => {
            (host_of(client), Row::Replay)
        }
        _ => return None,
    })
}

/// XML text escaping.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// At most `n` characters of `s`, with an ellipsis if cut.
fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// One lane: counts per row per bucket, the point faults that hit it, and
/// when its host was down.
#[derive(Default)]
struct Lane {
    rows: BTreeMap<Row, BTreeMap<usize, u32>>,
    faults: BTreeMap<usize, Vec<String>>,
    down: Vec<(Duration, Option<Duration>)>,
}

impl Lane {
    /// One more `row` in `bucket`.
    fn count(&mut self, row: Row, bucket: usize) {
        *self.rows.entry(row).or_default().entry(bucket).or_insert(0) += 1;
    }
}

/// The lanes in reading order (see [`lane_rank`]).
type Lanes = BTreeMap<(u8, String), Lane>;

/// `host`'s lane, made if new.
fn lane<'l>(lanes: &'l mut Lanes, host: &str) -> &'l mut Lane {
    let (rank, name) = lane_rank(host);
    lanes.entry((rank, name.to_owned())).or_default()
}

/// Fault windows by kind, opened and closed in order.
type Windows = BTreeMap<FaultKind, Vec<(Duration, Option<Duration>, String)>>;

/// A run's trace gathered for drawing: per-host lanes, fault windows, the
/// point faults not tied to a host, and the heal.
struct Gathered {
    end: Duration,
    lanes: Lanes,
    windows: Windows,
    loose: BTreeMap<usize, Vec<String>>,
    heal: Option<Duration>,
}

impl Gathered {
    fn new(events: &[(Duration, Event)]) -> Self {
        let end = events
            .last()
            .map_or(Duration::from_secs(1), |(at, _)| *at)
            .max(Duration::from_millis(100));
        let mut g = Self {
            end,
            lanes: Lanes::new(),
            windows: Windows::new(),
            loose: BTreeMap::new(),
            heal: None,
        };
        for (at, e) in events {
            g.add(*at, e);
        }
        g
    }

    fn bucket_of(&self, at: Duration) -> usize {
        let buckets = (PLOT_WIDTH / BUCKET_PX) as usize;
        ((at.as_secs_f64() / self.end.as_secs_f64() * buckets as f64) as usize).min(buckets - 1)
    }

    fn add(&mut self, at: Duration, e: &Event) {
        let bucket = self.bucket_of(at);
        if let Some((host, row)) = placed(e) {
            lane(&mut self.lanes, host).count(row, bucket);
            return;
        }
        match e {
            Event::FaultStart { kind, detail } => {
                let windows = self.windows.entry(*kind).or_default();
                windows.push((at, None, detail.clone()));
            }
            Event::FaultEnd { kind } => {
                if let Some(w) = self
                    .windows
                    .get_mut(kind)
                    .and_then(|ws| ws.iter_mut().find(|w| w.1.is_none()))
                {
                    w.1 = Some(at);
                }
            }
            Event::Fault { kind, detail } => {
                let text = format!("{:.3} s {kind:?}: {detail}", at.as_secs_f64());
                let who = detail.split_whitespace().next().unwrap_or("");
                if who.contains('#') || who == "workload" {
                    let l = lane(&mut self.lanes, host_of(who));
                    l.count(Row::Fault, bucket);
                    l.faults.entry(bucket).or_default().push(text);
                } else {
                    self.loose.entry(bucket).or_default().push(text);
                }
            }
            Event::Host { host, up } => {
                let l = lane(&mut self.lanes, host);
                if *up {
                    if let Some(d) = l.down.iter_mut().rev().find(|d| d.1.is_none()) {
                        d.1 = Some(at);
                    }
                } else {
                    l.down.push((at, None));
                }
            }
            Event::Heal => self.heal = Some(at),
            _ => {}
        }
    }

    /// The picture's height.
    fn height(&self) -> f64 {
        let fault_rows = self.windows.len() + usize::from(!self.loose.is_empty());
        let mut height = HEADER + fault_rows as f64 * ROW_HEIGHT + LANE_GAP;
        for l in self.lanes.values() {
            height += (l.rows.len().max(1)) as f64 * ROW_HEIGHT + 14.0 + LANE_GAP;
        }
        height + AXIS
    }
}

/// The SVG being written, and where time falls on it.
struct Canvas {
    s: String,
    end: Duration,
    width: f64,
}

impl Canvas {
    fn x_of(&self, at: Duration) -> f64 {
        LABEL_WIDTH + at.as_secs_f64() / self.end.as_secs_f64() * PLOT_WIDTH
    }

    fn rect(&mut self, (x, y, w, h): (f64, f64, f64, f64), fill: &str, extra: &str) {
        let _ = write!(
            self.s,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" fill="{fill}"{extra}"#,
            w.max(1.0)
        );
    }

    /// The document's start, the title and the verdict.
    fn header(&mut self, height: f64, title: &str, verdict: &str, failed: bool) {
        let (width, s) = (self.width, &mut self.s);
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="10">"#
        );
        let _ = writeln!(
            s,
            r##"<defs><pattern id="down" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="3" height="6" fill="#adb5bd" opacity="0.6"/></pattern></defs>"##
        );
        let _ = writeln!(
            s,
            r#"<rect width="{width:.0}" height="{height:.0}" fill="white"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="8" y="16" font-size="13" font-weight="bold">{}</text>"#,
            esc(title)
        );
        let _ = writeln!(
            s,
            r##"<text x="8" y="34" fill="{}">{}</text>"##,
            if failed { "#c92a2a" } else { "#2b8a3e" },
            esc(&clip(verdict, 220))
        );
    }

    /// One row per fault kind with its windows, then the loose faults' row;
    /// the `y` below them.
    fn faults(&mut self, g: &Gathered, mut y: f64) -> f64 {
        for (kind, ws) in &g.windows {
            let _ = writeln!(
                self.s,
                r##"<text x="8" y="{:.1}" fill="#c92a2a">{kind:?}</text>"##,
                y + ROW_HEIGHT - 2.0
            );
            for (from, to, detail) in ws {
                let x0 = self.x_of(*from);
                let x1 = self.x_of(to.unwrap_or(self.end));
                let at = (x0, y + 1.0, x1 - x0, ROW_HEIGHT - 2.0);
                self.rect(at, "#ffa8a8", "><title>");
                let _ = writeln!(
                    self.s,
                    "{:.3}–{:.3} s {kind:?}: {}</title></rect>",
                    from.as_secs_f64(),
                    to.unwrap_or(self.end).as_secs_f64(),
                    esc(detail)
                );
            }
            y += ROW_HEIGHT;
        }
        if !g.loose.is_empty() {
            let _ = writeln!(
                self.s,
                r##"<text x="8" y="{:.1}" fill="#c92a2a">other faults</text>"##,
                y + ROW_HEIGHT - 2.0
            );
            for (b, texts) in &g.loose {
                let x = LABEL_WIDTH + *b as f64 * BUCKET_PX;
                let at = (x, y + 1.0, BUCKET_PX, ROW_HEIGHT - 2.0);
                self.rect(at, Row::Fault.color(), "><title>");
                let _ = writeln!(self.s, "{}</title></rect>", esc(&texts.join("\n")));
            }
            y += ROW_HEIGHT;
        }
        y
    }

    /// One host's lane at `y`: its name, when it was down, its rows of
    /// counts; the lane's height.
    fn lane(&mut self, host: &str, l: &Lane, y: f64) -> f64 {
        let lane_h = l.rows.len().max(1) as f64 * ROW_HEIGHT + 14.0;
        let width = self.width;
        let _ = writeln!(
            self.s,
            r##"<rect x="0" y="{y:.1}" width="{width:.0}" height="{lane_h:.1}" fill="#f8f9fa" stroke="#dee2e6"/>"##
        );
        let _ = writeln!(
            self.s,
            r#"<text x="8" y="{:.1}" font-weight="bold">{}</text>"#,
            y + 11.0,
            esc(host)
        );
        for (from, to) in &l.down {
            let x0 = self.x_of(*from);
            let x1 = self.x_of(to.unwrap_or(self.end));
            self.rect((x0, y, x1 - x0, lane_h), "url(#down)", "><title>");
            let _ = writeln!(
                self.s,
                "{} down {:.3}–{:.3} s</title></rect>",
                esc(host),
                from.as_secs_f64(),
                to.unwrap_or(self.end).as_secs_f64()
            );
        }
        let mut ry = y + 14.0;
        for (row, counts) in &l.rows {
            self.counts(*row, counts, l, ry);
            ry += ROW_HEIGHT;
        }
        lane_h
    }

    /// One row of a lane: a cell per bucket, darker for more.
    fn counts(&mut self, row: Row, counts: &BTreeMap<usize, u32>, l: &Lane, ry: f64) {
        let max = counts.values().copied().max().unwrap_or(1).max(1);
        let _ = writeln!(
            self.s,
            r##"<text x="20" y="{:.1}" fill="#495057">{}</text>"##,
            ry + ROW_HEIGHT - 2.0,
            row.label()
        );
        for (b, n) in counts {
            let x = LABEL_WIDTH + *b as f64 * BUCKET_PX;
            let opacity = 0.3 + 0.7 * f64::from(*n) / f64::from(max);
            let at = (x, ry + 1.0, BUCKET_PX, ROW_HEIGHT - 2.0);
            self.rect(
                at,
                row.color(),
                &format!(r#" opacity="{opacity:.2}"><title>"#),
            );
            let what = match (row, l.faults.get(b)) {
                (Row::Fault, Some(texts)) => texts.join("\n"),
                _ => format!("{n} × {}", row.label()),
            };
            let _ = writeln!(self.s, "{}</title></rect>", esc(&what));
        }
    }

    /// The time axis: about ten ticks on round seconds.
    fn axis(&mut self, top: f64, bottom: f64) {
        let secs = self.end.as_secs_f64();
        let step = [
            0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
        ]
        .into_iter()
        .find(|st| secs / st <= 12.0)
        .unwrap_or(600.0);
        let mut t = 0.0;
        while t <= secs + 1e-9 {
            let x = self.x_of(Duration::from_secs_f64(t));
            let _ = writeln!(
                self.s,
                r##"<line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{:.1}" stroke="#ced4da" stroke-width="0.5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{t:.1} s</text>"##,
                bottom,
                bottom + 14.0
            );
            t += step;
        }
    }

    /// The heal's line.
    fn heal(&mut self, at: Duration, bottom: f64) {
        let x = self.x_of(at);
        let _ = writeln!(
            self.s,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="#2b8a3e" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="#2b8a3e">heal</text>"##,
            HEADER - 6.0,
            x + 3.0,
            HEADER - 2.0
        );
    }

    /// The first violation's line.
    fn violation(&mut self, v: &Violation, verdict: &str, bottom: f64) {
        let x = self.x_of(v.at.unwrap_or(self.end));
        let _ = writeln!(
            self.s,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="#c92a2a" stroke-width="2"><title>{}</title></line><text x="{:.1}" y="{:.1}" fill="#c92a2a" font-weight="bold">{}</text>"##,
            HEADER - 14.0,
            esc(verdict),
            x + 3.0,
            HEADER - 8.0,
            esc(&v.invariant.to_string())
        );
    }
}

/// The verdict line: the first violation, or PASS.
fn verdict(first: Option<&Violation>) -> String {
    match first {
        Some(v) => format!(
            "FAIL: {} at {}: {}",
            v.invariant,
            v.at.map_or("end of run".to_owned(), |a| format!(
                "{:.3} s",
                a.as_secs_f64()
            )),
            v.detail
        ),
        None => "PASS".to_owned(),
    }
}

/// The SVG of a run: `title` on top (scenario and seed), `events` the
/// trace, `violations` the verdict's (the earliest is drawn).
pub fn svg(title: &str, events: &[(Duration, Event)], violations: &[Violation]) -> String {
    let g = Gathered::new(events);
    let first = violations
        .iter()
        .filter(|v| v.at.is_some())
        .min_by_key(|v| v.at)
        .or_else(|| violations.first());
    let verdict = verdict(first);
    let mut c = Canvas {
        s: String::new(),
        end: g.end,
        width: LABEL_WIDTH + PLOT_WIDTH + 20.0,
    };
    c.header(g.height(), title, &verdict, first.is_some());
    let mut y = c.faults(&g, HEADER) + LANE_GAP;
    let top = y;
    for ((_, host), l) in &g.lanes {
        y += c.lane(host, l, y) + LANE_GAP;
    }
    c.axis(top, y);
    if let Some(at) = g.heal {
        c.heal(at, y);
    }
    if let Some(v) = first {
        c.violation(v, &verdict, y);
    }
    c.s.push_str("</svg>\n");
    c.s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Invariant;
    use uuid::Uuid;

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn run() -> Vec<(Duration, Event)> {
        let id = Uuid::nil();
        vec![
            (
                at(0),
                Event::Committed {
                    client: "workload".into(),
                    ids: vec![id],
                },
            ),
            (
                at(100),
                Event::FaultStart {
                    kind: FaultKind::Blackhole,
                    detail: "drainer-1 <-> rabbitmq & co".into(),
                },
            ),
            (
                at(200),
                Event::ClaimReturned {
                    replica: "drainer-1#1".into(),
                    ids: vec![id],
                },
            ),
            (
                at(300),
                Event::Host {
                    host: "drainer-1".into(),
                    up: false,
                },
            ),
            (
                at(400),
                Event::Fault {
                    kind: FaultKind::PgReplyLost,
                    detail: "consumer-1#2 commit".into(),
                },
            ),
            (
                at(500),
                Event::FaultEnd {
                    kind: FaultKind::Blackhole,
                },
            ),
            (
                at(600),
                Event::Host {
                    host: "drainer-1".into(),
                    up: true,
                },
            ),
            (at(700), Event::Heal),
            (
                at(800),
                Event::Settled {
                    client: "consumer-1#2".into(),
                    message_id: None,
                    settle: Settle::Ack,
                },
            ),
        ]
    }

    #[test]
    fn lanes_faults_and_the_first_violation_are_drawn() {
        let violations = [
            Violation {
                invariant: Invariant::AttemptOnlyOnHandlerFailure,
                at: Some(at(650)),
                detail: "later <one>".into(),
            },
            Violation {
                invariant: Invariant::AttemptOnlyOnHandlerFailure,
                at: Some(at(450)),
                detail: "first <one>".into(),
            },
        ];
        let svg = svg("swarm seed 48", &run(), &violations);
        assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
        // One lane per host, in reading order, incarnations folded.
        let lanes: Vec<usize> = ["workload<", "drainer-1<", "consumer-1<"]
            .iter()
            .map(|h| svg.find(&format!(">{h}")).expect(h))
            .collect();
        assert!(lanes.windows(2).all(|w| w[0] < w[1]), "{lanes:?}");
        assert!(!svg.contains("drainer-1#1"));
        // The window, the crash, the point fault, the heal.
        assert!(svg.contains("0.100–0.500 s Blackhole: drainer-1 &lt;-&gt; rabbitmq &amp; co"));
        assert!(svg.contains("drainer-1 down 0.300–0.600 s"));
        assert!(svg.contains("0.400 s PgReplyLost: consumer-1#2 commit"));
        assert!(svg.contains(">heal<"));
        // The earliest violation, escaped, not the first listed.
        assert!(svg.contains("at 0.450 s: first &lt;one&gt;"));
        assert!(!svg.contains("later"));
        balanced(&svg);
    }

    /// Every element that opens closes, in order, and no text holds a raw
    /// `<` or `&` that is not an entity (no XML parser at hand).
    fn balanced(svg: &str) {
        let mut open: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find('<') {
            let text = &rest[..i];
            for (k, _) in text.match_indices('&') {
                let entity = &text[k..];
                assert!(
                    ["&amp;", "&lt;", "&gt;", "&quot;"]
                        .iter()
                        .any(|e| entity.starts_with(e)),
                    "raw & in {text:?}"
                );
            }
            let end = rest[i..].find('>').expect("tag ends") + i;
            let tag = &rest[i + 1..end];
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name), "closing {name}");
            } else if !tag.ends_with('/') {
                open.push(tag.split_whitespace().next().expect("tag name"));
            }
            rest = &rest[end + 1..];
        }
        assert!(open.is_empty(), "left open: {open:?}");
    }

    #[test]
    fn a_passing_run_says_so_and_the_same_trace_gives_the_same_bytes() {
        let a = svg("t", &run(), &[]);
        assert!(a.contains(">PASS<"));
        balanced(&a);
        assert_eq!(a, svg("t", &run(), &[]));
    }
}
