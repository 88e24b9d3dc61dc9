//! The outbox gauges as the production stats task sets them, into the
//! trace: a `metrics` recorder installed once for the process that hands
//! every `canopy_mq_outbox_*` gauge set to the trace of the run on the
//! current thread (each run is on one thread, on either engine), and drops
//! everything else. The checker holds the gauges to the stats they were
//! set from (`gauges_truthful`).

use std::cell::RefCell;
use std::sync::Arc;

use metrics::{
    Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

use crate::trace::{Event, Trace};

thread_local! {
    static CURRENT: RefCell<Option<Trace>> = const { RefCell::new(None) };
}

/// Gauges of this prefix are recorded.
const PREFIX: &str = "canopy_mq_outbox_";

/// Records the outbox gauges set on this thread into `trace` until the
/// guard is dropped.
pub fn record_into(trace: &Trace) -> Recording {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        // Another recorder already installed (a host program's own) wins;
        // the gauges are then not checked.
        let _ = metrics::set_global_recorder(TraceRecorder);
    });
    CURRENT.with(|c| *c.borrow_mut() = Some(trace.clone()));
    Recording
}

/// Stops recording on drop.
pub struct Recording;

impl Drop for Recording {
    fn drop(&mut self) {
        CURRENT.with(|c| *c.borrow_mut() = None);
    }
}

struct TraceRecorder;

struct TraceGauge(String);

impl GaugeFn for TraceGauge {
    fn increment(&self, _: f64) {}
    fn decrement(&self, _: f64) {}
    fn set(&self, value: f64) {
        CURRENT.with(|c| {
            if let Some(trace) = c.borrow().as_ref() {
                trace.now(Event::Gauge {
                    name: self.0.clone(),
                    micros: (value * 1e6).round() as i64,
                });
            }
        });
    }
}

impl Recorder for TraceRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        if key.name().starts_with(PREFIX) {
            Gauge::from_arc(Arc::new(TraceGauge(key.name().to_owned())))
        } else {
            Gauge::noop()
        }
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}
