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

/// The SVG of a run: `title` on top (scenario and seed), `events` the
/// trace, `violations` the verdict's (the earliest is drawn).
pub fn svg(title: &str, events: &[(Duration, Event)], violations: &[Violation]) -> String {
    let end = events
        .last()
        .map_or(Duration::from_secs(1), |(at, _)| *at)
        .max(Duration::from_millis(100));
    let buckets = (PLOT_WIDTH / BUCKET_PX) as usize;
    let bucket_of = |at: Duration| {
        ((at.as_secs_f64() / end.as_secs_f64() * buckets as f64) as usize).min(buckets - 1)
    };
    let x_of = |at: Duration| LABEL_WIDTH + at.as_secs_f64() / end.as_secs_f64() * PLOT_WIDTH;

    let mut lanes = Lanes::new();
    // Fault windows by kind, opened and closed in order.
    let mut windows: BTreeMap<FaultKind, Vec<(Duration, Option<Duration>, String)>> =
        BTreeMap::new();
    // Point faults not tied to a host.
    let mut loose: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let mut heal = None;
    for (at, e) in events {
        if let Some((host, row)) = placed(e) {
            lane(&mut lanes, host).count(row, bucket_of(*at));
            continue;
        }
        match e {
            Event::FaultStart { kind, detail } => {
                windows
                    .entry(*kind)
                    .or_default()
                    .push((*at, None, detail.clone()));
            }
            Event::FaultEnd { kind } => {
                if let Some(w) = windows
                    .get_mut(kind)
                    .and_then(|ws| ws.iter_mut().find(|w| w.1.is_none()))
                {
                    w.1 = Some(*at);
                }
            }
            Event::Fault { kind, detail } => {
                let text = format!("{:.3} s {kind:?}: {detail}", at.as_secs_f64());
                let who = detail.split_whitespace().next().unwrap_or("");
                if who.contains('#') || who == "workload" {
                    let l = lane(&mut lanes, host_of(who));
                    l.count(Row::Fault, bucket_of(*at));
                    l.faults.entry(bucket_of(*at)).or_default().push(text);
                } else {
                    loose.entry(bucket_of(*at)).or_default().push(text);
                }
            }
            Event::Host { host, up } => {
                let l = lane(&mut lanes, host);
                if *up {
                    if let Some(d) = l.down.iter_mut().rev().find(|d| d.1.is_none()) {
                        d.1 = Some(*at);
                    }
                } else {
                    l.down.push((*at, None));
                }
            }
            Event::Heal => heal = Some(*at),
            _ => {}
        }
    }
    let first = violations
        .iter()
        .filter(|v| v.at.is_some())
        .min_by_key(|v| v.at)
        .or_else(|| violations.first());

    // Layout.
    let fault_rows = windows.len() + usize::from(!loose.is_empty());
    let mut height = HEADER + fault_rows as f64 * ROW_HEIGHT + LANE_GAP;
    for l in lanes.values() {
        height += (l.rows.len().max(1)) as f64 * ROW_HEIGHT + 14.0 + LANE_GAP;
    }
    height += AXIS;
    let width = LABEL_WIDTH + PLOT_WIDTH + 20.0;

    let mut s = String::new();
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
    let verdict = match first {
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
    };
    let _ = writeln!(
        s,
        r##"<text x="8" y="34" fill="{}">{}</text>"##,
        if first.is_some() {
            "#c92a2a"
        } else {
            "#2b8a3e"
        },
        esc(&clip(&verdict, 220))
    );

    let mut y = HEADER;
    let rect = |s: &mut String, x: f64, y: f64, w: f64, h: f64, fill: &str, extra: &str| {
        let _ = write!(
            s,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" fill="{fill}"{extra}"#,
            w.max(1.0)
        );
    };
    // Fault windows.
    for (kind, ws) in &windows {
        let _ = writeln!(
            s,
            r##"<text x="8" y="{:.1}" fill="#c92a2a">{kind:?}</text>"##,
            y + ROW_HEIGHT - 2.0
        );
        for (from, to, detail) in ws {
            let x0 = x_of(*from);
            let x1 = x_of(to.unwrap_or(end));
            rect(
                &mut s,
                x0,
                y + 1.0,
                x1 - x0,
                ROW_HEIGHT - 2.0,
                "#ffa8a8",
                "><title>",
            );
            let _ = writeln!(
                s,
                "{:.3}–{:.3} s {kind:?}: {}</title></rect>",
                from.as_secs_f64(),
                to.unwrap_or(end).as_secs_f64(),
                esc(detail)
            );
        }
        y += ROW_HEIGHT;
    }
    if !loose.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="8" y="{:.1}" fill="#c92a2a">other faults</text>"##,
            y + ROW_HEIGHT - 2.0
        );
        for (b, texts) in &loose {
            let x = LABEL_WIDTH + *b as f64 * BUCKET_PX;
            rect(
                &mut s,
                x,
                y + 1.0,
                BUCKET_PX,
                ROW_HEIGHT - 2.0,
                Row::Fault.color(),
                "><title>",
            );
            let _ = writeln!(s, "{}</title></rect>", esc(&texts.join("\n")));
        }
        y += ROW_HEIGHT;
    }
    y += LANE_GAP;
    let top = y;

    // Lanes.
    for ((_, host), l) in &lanes {
        let lane_h = l.rows.len().max(1) as f64 * ROW_HEIGHT + 14.0;
        let _ = writeln!(
            s,
            r##"<rect x="0" y="{y:.1}" width="{width:.0}" height="{lane_h:.1}" fill="#f8f9fa" stroke="#dee2e6"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="8" y="{:.1}" font-weight="bold">{}</text>"#,
            y + 11.0,
            esc(host)
        );
        for (from, to) in &l.down {
            let x0 = x_of(*from);
            let x1 = x_of(to.unwrap_or(end));
            rect(&mut s, x0, y, x1 - x0, lane_h, "url(#down)", "><title>");
            let _ = writeln!(
                s,
                "{} down {:.3}–{:.3} s</title></rect>",
                esc(host),
                from.as_secs_f64(),
                to.unwrap_or(end).as_secs_f64()
            );
        }
        let mut ry = y + 14.0;
        for (row, counts) in &l.rows {
            let max = counts.values().copied().max().unwrap_or(1).max(1);
            let _ = writeln!(
                s,
                r##"<text x="20" y="{:.1}" fill="#495057">{}</text>"##,
                ry + ROW_HEIGHT - 2.0,
                row.label()
            );
            for (b, n) in counts {
                let x = LABEL_WIDTH + *b as f64 * BUCKET_PX;
                let opacity = 0.3 + 0.7 * f64::from(*n) / f64::from(max);
                rect(
                    &mut s,
                    x,
                    ry + 1.0,
                    BUCKET_PX,
                    ROW_HEIGHT - 2.0,
                    row.color(),
                    &format!(r#" opacity="{opacity:.2}"><title>"#),
                );
                let what = match (row, l.faults.get(b)) {
                    (Row::Fault, Some(texts)) => texts.join("\n"),
                    _ => format!("{n} × {}", row.label()),
                };
                let _ = writeln!(s, "{}</title></rect>", esc(&what));
            }
            ry += ROW_HEIGHT;
        }
        y += lane_h + LANE_GAP;
    }
    let bottom = y;

    // Time axis: about ten ticks on round seconds.
    let secs = end.as_secs_f64();
    let step = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
    ]
    .into_iter()
    .find(|st| secs / st <= 12.0)
    .unwrap_or(600.0);
    let mut t = 0.0;
    while t <= secs + 1e-9 {
        let x = x_of(Duration::from_secs_f64(t));
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{:.1}" stroke="#ced4da" stroke-width="0.5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{t:.1} s</text>"##,
            bottom,
            bottom + 14.0
        );
        t += step;
    }
    if let Some(at) = heal {
        let x = x_of(at);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="#2b8a3e" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="#2b8a3e">heal</text>"##,
            HEADER - 6.0,
            x + 3.0,
            HEADER - 2.0
        );
    }
    if let Some(v) = first {
        let x = x_of(v.at.unwrap_or(end));
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="#c92a2a" stroke-width="2"><title>{}</title></line><text x="{:.1}" y="{:.1}" fill="#c92a2a" font-weight="bold">{}</text>"##,
            HEADER - 14.0,
            esc(&verdict),
            x + 3.0,
            HEADER - 8.0,
            esc(&v.invariant.to_string())
        );
    }
    s.push_str("</svg>\n");
    s
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
