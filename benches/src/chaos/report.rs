//! The report of a chaos run: markdown for people, JSON for tools, and an
//! SVG of events committed, published and applied per second with the
//! faults marked.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use super::judge::{Judgement, Outcome};
use super::plan::Planned;

/// A fault as it happened: planned, then injected (and healed) at these
/// times from the start of production.
#[derive(Debug, Clone)]
pub struct Injected {
    pub planned: Planned,
    pub began: Duration,
    pub ended: Duration,
    /// What went wrong injecting it, if anything (the run still counts it
    /// as injected only if this is empty).
    pub trouble: Option<String>,
}

/// Everything the report shows.
pub struct Report<'a> {
    pub command: String,
    pub seed: u64,
    pub events: u64,
    pub rate: f64,
    pub wall: Duration,
    pub faults: &'a [Injected],
    pub outcome: &'a Outcome,
    pub judgement: &'a Judgement,
    /// Summed subscriber counters (a lower bound: a killed process's last
    /// second is missing).
    pub counters: &'a BTreeMap<String, u64>,
    /// Per second from the start of production: committed, and applied per
    /// subscription.
    pub committed_per_second: &'a BTreeMap<u64, u64>,
    pub applied_per_second: &'a BTreeMap<String, BTreeMap<u64, u64>>,
}

impl Report<'_> {
    fn duplicates(&self) -> u64 {
        self.outcome
            .observed
            .stored
            .values()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum()
    }

    /// The markdown report.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let verdict = if self.judgement.ok() { "PASS" } else { "FAIL" };
        let _ = writeln!(md, "# Chaos run: {verdict}\n");
        let _ = writeln!(md, "`{}`\n", self.command);
        let _ = writeln!(
            md,
            "seed {}, {} events at {:.0}/s, {} faults, {:.1} s wall time\n",
            self.seed,
            self.events,
            self.rate,
            self.faults.len(),
            self.wall.as_secs_f64()
        );
        let _ = writeln!(
            md,
            "## Faults\n\n| # | planned at | fault | injected | healed |\n|---|---|---|---|---|"
        );
        for (i, f) in self.faults.iter().enumerate() {
            let healed = match &f.trouble {
                Some(t) => format!("trouble: {t}"),
                None => format!("{:.1} s", f.ended.as_secs_f64()),
            };
            let _ = writeln!(
                md,
                "| {} | {:.1} s | {} | {:.1} s | {healed} |",
                i + 1,
                f.planned.at.as_secs_f64(),
                f.planned.fault,
                f.began.as_secs_f64()
            );
        }
        self.counts(&mut md);
        self.rules(&mut md);
        md
    }

    /// The markdown's counts.
    fn counts(&self, md: &mut String) {
        let o = self.outcome;
        let _ = writeln!(md, "\n## Counts\n\n| what | count |\n|---|---|");
        let rows = [
            ("committed events", o.committed.len() as u64),
            (
                "rolled-back events (never to be published)",
                o.rolled_back.len() as u64,
            ),
            (
                "unpublishable events (must park)",
                o.of_kind("unpublishable").len() as u64,
            ),
            (
                "poison events (shipping must dead-letter)",
                o.of_kind("poison").len() as u64,
            ),
            (
                "distinct events the observer saw",
                o.observed.stored.len() as u64,
            ),
            ("duplicates published (republishes)", self.duplicates()),
            (
                "observer redeliveries (its own lost acks)",
                o.observed.redelivered,
            ),
            ("observer sessions (1 + reconnects)", o.observed.sessions),
            ("observer sessions found wedged", o.observed.wedged),
            (
                "keyed events (they spread over the run's ordering keys)",
                o.keyed.len() as u64,
            ),
            (
                "ordering keys",
                o.keyed
                    .values()
                    .map(|(k, _)| k)
                    .collect::<std::collections::BTreeSet<_>>()
                    .len() as u64,
            ),
            ("rows parked", o.parked.len() as u64),
            ("rows marked published (the audit)", o.marks.len() as u64),
        ];
        for (what, n) in rows {
            let _ = writeln!(md, "| {what} | {n} |");
        }
        for (name, s) in &o.subscriptions {
            let effects: u64 = s.effects.values().map(|n| u64::from(*n)).sum();
            let _ = writeln!(
                md,
                "| {name}: effect rows (distinct events) | {effects} ({}) |",
                s.effects.len()
            );
            let _ = writeln!(
                md,
                "| {name}: dead-lettered inbox rows, DLQ messages | {}, {} |",
                s.dead_lettered.len(),
                s.dlq.values().sum::<u32>()
            );
        }
        for (k, v) in self.counters {
            let _ = writeln!(md, "| subscribers' {k} (at least) | {v} |");
        }
    }

    /// The markdown's rules, and examples of each one broken.
    fn rules(&self, md: &mut String) {
        let _ = writeln!(
            md,
            "\n## Rules\n\n| rule | says | violations |\n|---|---|---|"
        );
        for r in &self.judgement.rules {
            let _ = writeln!(md, "| `{}` | {} | {} |", r.name, r.says, r.violations);
        }
        for r in self.judgement.rules.iter().filter(|r| r.violations > 0) {
            let _ = writeln!(md, "\n`{}`:", r.name);
            for e in &r.examples {
                let _ = writeln!(md, "- {e}");
            }
        }
    }

    /// The JSON report.
    pub fn json(&self) -> serde_json::Value {
        let o = self.outcome;
        serde_json::json!({
            "ok": self.judgement.ok(),
            "command": self.command,
            "seed": self.seed,
            "events": self.events,
            "rate": self.rate,
            "wall_secs": self.wall.as_secs_f64(),
            "faults": self.faults.iter().map(|f| serde_json::json!({
                "kind": f.planned.fault.kind(),
                "fault": f.planned.fault.to_string(),
                "planned_at_secs": f.planned.at.as_secs_f64(),
                "injected_at_secs": f.began.as_secs_f64(),
                "healed_at_secs": f.ended.as_secs_f64(),
                "trouble": f.trouble,
            })).collect::<Vec<_>>(),
            "counts": {
                "committed": o.committed.len(),
                "rolled_back": o.rolled_back.len(),
                "unpublishable": o.of_kind("unpublishable").len(),
                "poison": o.of_kind("poison").len(),
                "observed_distinct": o.observed.stored.len(),
                "duplicates_published": self.duplicates(),
                "observer_redeliveries": o.observed.redelivered,
                "observer_sessions": o.observed.sessions,
                "observer_wedged": o.observed.wedged,
                "parked": o.parked.len(),
                "marks_audited": o.marks.len(),
                "subscriptions": o.subscriptions.iter().map(|(name, s)| (name.clone(), serde_json::json!({
                    "effect_rows": s.effects.values().map(|n| u64::from(*n)).sum::<u64>(),
                    "distinct_effects": s.effects.len(),
                    "dead_lettered": s.dead_lettered.len(),
                    "dlq_messages": s.dlq.values().sum::<u32>(),
                }))).collect::<serde_json::Map<_, _>>(),
                "subscriber_counters": self.counters,
            },
            "rules": self.judgement.rules.iter().map(|r| serde_json::json!({
                "rule": r.name, "says": r.says, "violations": r.violations, "examples": r.examples,
            })).collect::<Vec<_>>(),
        })
    }

    /// Each fault's time shaded, numbered as in the markdown.
    fn shade_faults(
        &self,
        svg: &mut String,
        x: &dyn Fn(f64) -> f64,
        (h, up, down): (f64, f64, f64),
    ) {
        for (i, f) in self.faults.iter().enumerate() {
            let (a, b) = (x(f.began.as_secs_f64()), x(f.ended.as_secs_f64()));
            let _ = write!(
                svg,
                r##"<rect x="{a:.1}" y="{up}" width="{:.1}" height="{:.1}" fill="#d62728" fill-opacity="0.15"><title>{}</title></rect>"##,
                (b - a).max(2.0),
                h - up - down,
                escape(&f.planned.fault.to_string())
            );
            let _ = write!(
                svg,
                r##"<text x="{a:.1}" y="{}" fill="#d62728">{}</text>"##,
                up - 4.0,
                i + 1
            );
        }
    }

    /// The SVG plot: events per second over the run, faults shaded.
    pub fn svg(&self) -> String {
        let mut series: Vec<(&str, &str, &BTreeMap<u64, u64>)> = vec![
            ("committed", "#9e9e9e", self.committed_per_second),
            ("published", "#1f6fb2", &self.outcome.observed.per_second),
        ];
        let colors = ["#2e8b57", "#d9822b"];
        for ((name, s), color) in self.applied_per_second.iter().zip(colors) {
            series.push((name.as_str(), color, s));
        }
        let end = series
            .iter()
            .filter_map(|(_, _, s)| s.keys().next_back())
            .max()
            .copied()
            .unwrap_or(1)
            .max(
                self.faults
                    .iter()
                    .map(|f| f.ended.as_secs())
                    .max()
                    .unwrap_or(0),
            )
            + 1;
        let top = series
            .iter()
            .flat_map(|(_, _, s)| s.values())
            .max()
            .copied()
            .unwrap_or(1)
            .max(1);
        let (w, h, left, right, up, down) = (1100.0, 420.0, 60.0, 20.0, 30.0, 50.0);
        let x = |t: f64| left + (w - left - right) * t / end as f64;
        let y = |v: f64| h - down - (h - up - down) * v / top as f64;
        let mut svg = String::new();
        let _ = write!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
        );
        let _ = write!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        self.shade_faults(&mut svg, &x, (h, up, down));
        let _ = write!(
            svg,
            r#"<line x1="{left}" y1="{0}" x2="{1}" y2="{0}" stroke="black"/><line x1="{left}" y1="{up}" x2="{left}" y2="{0}" stroke="black"/>"#,
            h - down,
            w - right
        );
        ticks(&mut svg, end, top, &x, &y, (h, left, down));
        for (k, (name, color, s)) in series.iter().enumerate() {
            let points: Vec<String> = (0..end)
                .map(|t| {
                    format!(
                        "{:.1},{:.1}",
                        x(t as f64),
                        y(*s.get(&t).unwrap_or(&0) as f64)
                    )
                })
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
                points.join(" ")
            );
            let lx = left + 10.0 + 130.0 * k as f64;
            let _ = write!(
                svg,
                r#"<rect x="{lx}" y="{}" width="12" height="3" fill="{color}"/><text x="{}" y="{}">{name}/s</text>"#,
                h - 18.0,
                lx + 16.0,
                h - 14.0
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// Ten ticks on each axis, with their values.
fn ticks(
    svg: &mut String,
    end: u64,
    top: u64,
    x: &dyn Fn(f64) -> f64,
    y: &dyn Fn(f64) -> f64,
    (h, left, down): (f64, f64, f64),
) {
    let ticks = 10u64;
    for i in 0..=ticks {
        let t = end * i / ticks;
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{t} s</text>"#,
            x(t as f64),
            h - down + 15.0
        );
        let v = top * i / ticks;
        let _ = write!(
            svg,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v}</text>"#,
            left - 5.0,
            y(v as f64) + 4.0
        );
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
