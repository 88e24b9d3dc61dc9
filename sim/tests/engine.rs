//! What the world relies on from an engine, on whichever this build runs:
//! a held link delivers nothing until it is released, then what was held;
//! two faults holding one link end only when both have; a crashed host's
//! connections end and a restarted host runs its software again; a
//! timeout fires at its deadline however often what it bounds wakes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sim::engine::{self, Settings, Sim};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PORT: u16 = 7000;

/// Steps `sim` until `until` of simulated time.
async fn run_until(sim: &mut Sim, until: Duration) {
    while sim.elapsed() < until {
        sim.step().await.expect("the simulation runs");
    }
}

fn settings() -> Settings {
    Settings {
        step: Some(Duration::from_millis(10)),
        latency: Some((Duration::from_millis(1), Duration::from_millis(10))),
        ..Settings::seeded(7)
    }
}

/// A host that answers every byte with the same byte.
fn echo(sim: &mut Sim, starts: Arc<Mutex<u32>>) {
    sim.host("echo", move || {
        *starts.lock().unwrap() += 1;
        async move {
            let listener = engine::net::bind(PORT).await?;
            loop {
                let (mut stream, _) = listener.accept().await?;
                tokio::spawn(async move {
                    let mut b = [0u8; 1];
                    while stream.read_exact(&mut b).await.is_ok() {
                        if stream.write_all(&b).await.is_err() || stream.flush().await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
    });
}

/// A client that sends one byte every 100 ms and records when each echo
/// came back; `ended` is set when the connection ends.
fn client(sim: &mut Sim, got: Arc<Mutex<Vec<Duration>>>, ended: Arc<Mutex<bool>>) {
    sim.client("client", move || async move {
        let stream = engine::net::connect("echo", PORT).await?;
        let (mut r, mut w) = tokio::io::split(stream);
        let reader = async {
            let mut b = [0u8; 1];
            while r.read_exact(&mut b).await.is_ok() {
                got.lock().unwrap().push(engine::now());
            }
            *ended.lock().unwrap() = true;
        };
        let writer = async {
            for _ in 0..80 {
                if w.write_all(&[1]).await.is_err() || w.flush().await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::join!(reader, writer);
        Ok(())
    });
}

fn between(got: &[Duration], from: f64, to: f64) -> usize {
    got.iter()
        .filter(|t| t.as_secs_f64() >= from && t.as_secs_f64() < to)
        .count()
}

#[test]
fn a_held_link_delivers_after_the_last_of_its_faults_ends() {
    let got: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let ended: Arc<Mutex<bool>> = Arc::default();
    let (g, e) = (got.clone(), ended.clone());
    engine::simulate(settings(), move |mut sim| async move {
        echo(&mut sim, Arc::default());
        client(&mut sim, g, e);
        run_until(&mut sim, Duration::from_secs(1)).await;
        // Two faults hold the same link; the first ends at 2 s, the
        // second at 3 s.
        sim.hold("client", "echo");
        sim.hold("client", "echo");
        run_until(&mut sim, Duration::from_secs(2)).await;
        sim.release("client", "echo");
        run_until(&mut sim, Duration::from_secs(3)).await;
        sim.release("client", "echo");
        run_until(&mut sim, Duration::from_secs(5)).await;
    });
    let got = got.lock().unwrap();
    assert!(
        between(&got, 0.0, 1.0) >= 8,
        "echoes before the hold: {got:?}"
    );
    assert_eq!(
        between(&got, 1.05, 3.0),
        0,
        "nothing crosses a held link while one fault still holds it: {got:?}"
    );
    assert!(
        between(&got, 3.0, 5.0) >= 20,
        "what was held arrives after the last release, and the link carries again: {got:?}"
    );
    assert!(!*ended.lock().unwrap(), "holding a link ends no connection");
}

#[test]
fn a_crashed_host_loses_its_connections_and_restarts_its_software() {
    let got: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let ended: Arc<Mutex<bool>> = Arc::default();
    let starts: Arc<Mutex<u32>> = Arc::default();
    let (g, e, s) = (got.clone(), ended.clone(), starts.clone());
    engine::simulate(settings(), move |mut sim| async move {
        echo(&mut sim, s);
        client(&mut sim, g, e);
        run_until(&mut sim, Duration::from_secs(1)).await;
        sim.crash("echo");
        run_until(&mut sim, Duration::from_secs(2)).await;
        sim.restart("echo");
        run_until(&mut sim, Duration::from_secs(3)).await;
    });
    let got = got.lock().unwrap();
    assert!(
        between(&got, 0.0, 1.0) >= 8,
        "echoes before the crash: {got:?}"
    );
    assert_eq!(
        between(&got, 1.05, 3.0),
        0,
        "no echo from a crashed host: {got:?}"
    );
    assert!(
        *ended.lock().unwrap(),
        "the crash ended the client's connection"
    );
    assert_eq!(
        *starts.lock().unwrap(),
        2,
        "the restart ran the software again"
    );
}

/// `engine::timeout` and `engine::sleep` keep time whatever polls them:
/// a timeout around a future woken every millisecond (on madsim, a sleep
/// armed once per waker, not once per poll) fires at its deadline, and one
/// around a future that finishes first returns what it returned.
#[test]
fn a_timeout_fires_at_its_deadline_however_often_what_it_bounds_wakes() {
    let ends: Arc<Mutex<Vec<(bool, Duration)>>> = Arc::default();
    let got = ends.clone();
    engine::simulate(settings(), move |mut sim| async move {
        sim.client("client", move || async move {
            let bell = Arc::new(tokio::sync::Notify::new());
            let woken = {
                let bell = bell.clone();
                async move {
                    loop {
                        bell.notified().await;
                    }
                }
            };
            let ringer = async {
                loop {
                    engine::sleep(Duration::from_millis(1)).await;
                    bell.notify_one();
                }
            };
            let started = engine::now();
            let woken_out = tokio::select! {
                r = engine::timeout(Duration::from_millis(500), woken) => r.is_err(),
                () = ringer => false,
            };
            got.lock()
                .unwrap()
                .push((woken_out, engine::now() - started));
            let started = engine::now();
            let quick = engine::sleep(Duration::from_millis(300));
            let quick_out = engine::timeout(Duration::from_millis(500), quick)
                .await
                .is_err();
            got.lock()
                .unwrap()
                .push((quick_out, engine::now() - started));
            Ok(())
        });
        while !sim.step().await.expect("the simulation runs") {}
    });
    let ends = ends.lock().unwrap();
    let within =
        |d: Duration, ms: u64| d >= Duration::from_millis(ms) && d < Duration::from_millis(ms + 20);
    assert_eq!(ends.len(), 2, "both waits ended: {ends:?}");
    assert!(
        ends[0].0 && within(ends[0].1, 500),
        "woken every ms, timed out at 500 ms: {ends:?}"
    );
    assert!(
        !ends[1].0 && within(ends[1].1, 300),
        "finished at 300 ms, before its deadline: {ends:?}"
    );
}
