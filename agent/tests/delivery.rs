//! Delivery behaviour against a scripted HTTP peer that answers like the collector: keys,
//! batching, Retry-After, refusals, an unreachable collector, queue overflow, shutdown and the
//! spool's replay. (The real collector, killed and restarted under a real training job, is in
//! the Python suite `sdk-python/tests/test_collector_outage.py`.)

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_ipc::reader::StreamReader;
use rankwatch_agent::{Agent, AgentConfig, Metric, Mode, Point};
use rankwatch_analytics::math::SketchKind;
use rankwatch_analytics::schema::{samples, sketches};
use rankwatch_analytics::{RunId, Sample, SketchRecord};

#[derive(Debug, Clone)]
struct Request {
    at: Instant,
    table: String,
    key: String,
    body: Vec<u8>,
    answered: u16,
}

/// A scripted answer: status, extra headers, body.
type Answer = (u16, Vec<(String, String)>, String);

#[derive(Clone, Default)]
struct Peer {
    script: Arc<Mutex<VecDeque<Answer>>>,
    seen: Arc<Mutex<Vec<Request>>>,
    down: Arc<AtomicBool>,
}

impl Peer {
    fn start() -> (Peer, String) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let peer = Peer::default();
        let p = peer.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let p = p.clone();
                std::thread::spawn(move || p.serve(stream));
            }
        });
        (peer, url)
    }

    fn serve(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut out = stream;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let target = line.split(' ').nth(1).unwrap_or("").to_owned();
            let (mut len, mut key) = (0usize, String::new());
            loop {
                let mut h = String::new();
                reader.read_line(&mut h).unwrap();
                let h = h.trim_end();
                if h.is_empty() {
                    break;
                }
                let (name, value) = h.split_once(':').unwrap();
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => len = value.trim().parse().unwrap(),
                    "idempotency-key" => key = value.trim().to_owned(),
                    _ => {}
                }
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            if self.down.load(Ordering::SeqCst) {
                return; // hang up without an answer: a connection failure for the client
            }
            let (status, headers, text) = self.script.lock().unwrap().pop_front().unwrap_or((
                200,
                vec![],
                r#"{"status":"stored"}"#.to_owned(),
            ));
            self.seen.lock().unwrap().push(Request {
                at: Instant::now(),
                table: target.split("table=").nth(1).unwrap_or("").to_owned(),
                key,
                body,
                answered: status,
            });
            let mut answer = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
                text.len()
            );
            for (k, v) in headers {
                answer.push_str(&format!("{k}: {v}\r\n"));
            }
            answer.push_str("\r\n");
            answer.push_str(&text);
            if out.write_all(answer.as_bytes()).is_err() {
                return;
            }
        }
    }

    fn stored(&self) -> Vec<Request> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.answered == 200)
            .cloned()
            .collect()
    }

    fn stored_samples(&self) -> Vec<Sample> {
        self.stored()
            .iter()
            .filter(|r| r.table == "samples")
            .flat_map(|r| {
                StreamReader::try_new(std::io::Cursor::new(r.body.clone()), None)
                    .unwrap()
                    .flat_map(|b| samples::from_batch(&b.unwrap()).unwrap())
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

fn config(url: &str) -> AgentConfig {
    let mut c = AgentConfig::new(RunId::new("t").unwrap(), 0, url);
    c.batch_interval = Duration::from_millis(20);
    c.backoff_base = Duration::from_millis(20);
    c.backoff_cap = Duration::from_millis(200);
    c.request_timeout = Duration::from_secs(2);
    c
}

fn loss(value: f64) -> Vec<Point> {
    vec![Point {
        metric: Metric::new("loss").unwrap(),
        rank: Some(0),
        layer: None,
        site: None,
        value,
    }]
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn every_point_arrives_once_under_sequential_keys() {
    let (peer, url) = Peer::start();
    let mut c = config(&url);
    c.batch_rows = 64;
    let agent = Agent::start(c).unwrap();
    for step in 0..1000u64 {
        assert!(agent.log(step, loss(step as f64 + 0.5)).unwrap());
    }
    assert!(agent.flush(Duration::from_secs(10)).completed);
    let mut values: Vec<f64> = peer.stored_samples().iter().map(|s| s.value).collect();
    values.sort_by(f64::total_cmp);
    assert_eq!(
        values,
        (0..1000).map(|s| s as f64 + 0.5).collect::<Vec<_>>()
    );
    let keys: Vec<String> = peer.stored().iter().map(|r| r.key.clone()).collect();
    let session = agent.session().to_owned();
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(key, &format!("t/0/{session}/{}", i + 1));
    }
    assert!(keys.len() >= 1000 / 64, "batches are bounded by batch_rows");
    let stats = agent.shutdown(Duration::from_secs(5));
    assert_eq!(stats.sent_rows, 1000);
    assert_eq!(stats.dropped_rows, 0);
}

/// The steps each stored request of `table` carries, in the order they were stored.
fn stored_steps(peer: &Peer) -> Vec<(String, Vec<u64>)> {
    peer.stored()
        .iter()
        .map(|r| {
            let batches = StreamReader::try_new(std::io::Cursor::new(r.body.clone()), None)
                .unwrap()
                .map(|b| b.unwrap());
            let steps = match r.table.as_str() {
                "samples" => batches
                    .flat_map(|b| samples::from_batch(&b).unwrap())
                    .map(|s| s.step)
                    .collect(),
                "sketches" => batches
                    .flat_map(|b| sketches::from_batch(&b).unwrap())
                    .map(|s| s.step)
                    .collect(),
                _ => Vec::new(),
            };
            (r.table.clone(), steps)
        })
        .collect()
}

#[test]
fn a_steps_sketch_arrives_before_samples_of_any_later_step() {
    // The collector's aligner closes step s once every rank sent a sample past it; the sketch
    // of s must be there by then, whichever batches the records fall into.
    let (peer, url) = Peer::start();
    let mut c = config(&url);
    c.batch_interval = Duration::from_millis(3);
    c.batch_rows = 7;
    let agent = Agent::start(c).unwrap();
    for step in 0..400u64 {
        assert!(agent.log(step, loss(1.0)).unwrap());
        if step % 3 == 0 {
            let sketch = SketchRecord {
                run: RunId::new("t").unwrap(),
                rank: 0,
                step,
                time_ms: 0,
                kind: SketchKind::Rademacher,
                seed: 1,
                norm: 1.0,
                vector: vec![1.0, 0.0],
            };
            assert!(agent.sketch(sketch).unwrap());
        }
        if step % 5 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(agent.flush(Duration::from_secs(10)).completed);
    let requests = stored_steps(&peer);
    let mut sketched = std::collections::BTreeSet::new();
    let mut batches_with_both = 0;
    for (table, steps) in &requests {
        match table.as_str() {
            "sketches" => sketched.extend(steps.iter().copied()),
            "samples" => {
                let newest = steps.iter().copied().max().unwrap();
                let due = (0..newest).filter(|s| s % 3 == 0);
                for s in due {
                    assert!(
                        sketched.contains(&s),
                        "samples up to step {newest} arrived before the sketch of step {s}"
                    );
                }
                batches_with_both += 1;
            }
            _ => {}
        }
    }
    assert_eq!(sketched.len(), 134, "every sketch arrived");
    assert!(
        batches_with_both > 10,
        "the records spread over many batches"
    );
    agent.shutdown(Duration::from_secs(5));
}

#[test]
fn retry_after_is_honoured_and_the_same_key_is_resent() {
    let (peer, url) = Peer::start();
    peer.script.lock().unwrap().push_back((
        429,
        vec![("retry-after".into(), "1".into())],
        r#"{"error":"hot buffer full","reason":"backpressure"}"#.into(),
    ));
    let agent = Agent::start(config(&url)).unwrap();
    agent.log(1, loss(1.0)).unwrap();
    assert!(agent.flush(Duration::from_secs(10)).completed);
    let seen = peer.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "one refusal, one retry");
    assert_eq!(seen[0].answered, 429);
    assert_eq!(
        seen[0].key, seen[1].key,
        "a retry reuses its idempotency key"
    );
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_millis(990),
        "retried after {gap:?}, before Retry-After"
    );
    let stats = agent.stats();
    assert_eq!(
        (stats.retries, stats.sent_rows, stats.dropped_rows),
        (1, 1, 0)
    );
}

#[test]
fn a_refused_batch_is_counted_named_and_reported_as_dropped() {
    let (peer, url) = Peer::start();
    peer.script.lock().unwrap().push_back((
        422,
        vec![],
        r#"{"error":"too many series","reason":"cardinality"}"#.into(),
    ));
    let agent = Agent::start(config(&url)).unwrap();
    agent.log(1, loss(1.0)).unwrap();
    agent.flush(Duration::from_secs(5));
    let stats = agent.stats();
    assert_eq!(stats.refused_rows, 1);
    assert_eq!(stats.dropped_rows, 1);
    assert!(stats.last_error.unwrap().contains("too many series"));
    agent.log(2, loss(2.0)).unwrap();
    agent.flush(Duration::from_secs(5));
    let dropped: Vec<_> = peer
        .stored_samples()
        .into_iter()
        .filter(|s| s.metric.as_str() == "dropped")
        .collect();
    assert_eq!(dropped.len(), 1, "the loss reaches the collector");
    assert_eq!((dropped[0].rank, dropped[0].value), (Some(0), 1.0));
}

#[test]
fn unauthorised_and_not_found_keep_the_rows_and_say_what_to_fix() {
    for (status, hint) in [(401, "ingest token"), (403, "ingest token"), (404, "base")] {
        let (peer, url) = Peer::start();
        peer.script.lock().unwrap().push_back((
            status,
            vec![],
            r#"{"error":"no","reason":"x"}"#.into(),
        ));
        let agent = Agent::start(config(&url)).unwrap();
        agent.log(1, loss(1.0)).unwrap();
        agent.flush(Duration::from_secs(5));
        // The first attempt was answered with the error; the batch was kept and sent again.
        wait_for("the kept batch to be delivered", || {
            peer.stored_samples()
                .iter()
                .any(|s| s.metric.as_str() == "loss")
        });
        let stats = agent.stats();
        assert_eq!(
            (stats.refused_rows, stats.dropped_rows),
            (0, 0),
            "{status} must not drop rows"
        );
        assert!(stats.retries >= 1, "{status} is retried");
        let error = stats.last_error.unwrap();
        assert!(
            error.contains(&status.to_string()) && error.contains(hint),
            "{status}: {error}"
        );
        let seen = peer.seen.lock().unwrap().clone();
        assert_eq!(seen[0].answered, status);
        assert_eq!(seen[0].key, seen[1].key, "the same batch, same key");
    }
}

#[test]
fn an_unreachable_collector_fills_the_spool_and_it_drains_in_order_once() {
    let (peer, url) = Peer::start();
    peer.down.store(true, Ordering::SeqCst);
    let spool = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.spool_dir = Some(spool.path().to_owned());
    let agent = Agent::start(c).unwrap();
    for step in 0..200u64 {
        agent.log(step, loss(step as f64)).unwrap();
        if step % 20 == 0 {
            std::thread::sleep(Duration::from_millis(25));
        }
    }
    wait_for("batches in the spool", || {
        agent.stats().spooled_batches >= 3
    });
    let stats = agent.stats();
    assert!(!stats.connected && stats.retries > 0 && stats.dropped_rows == 0);
    assert!(std::fs::read_dir(spool.path()).unwrap().count() > 0);
    peer.down.store(false, Ordering::SeqCst);
    assert!(agent.flush(Duration::from_secs(15)).completed);
    let stats = agent.stats();
    assert_eq!((stats.backlog_batches, stats.spooled_batches), (0, 0));
    let values: Vec<f64> = peer.stored_samples().iter().map(|s| s.value).collect();
    assert_eq!(
        values,
        (0..200).map(|s| s as f64).collect::<Vec<_>>(),
        "in order, once"
    );
    let keys: Vec<u64> = peer
        .stored()
        .iter()
        .map(|r| r.key.rsplit('/').next().unwrap().parse().unwrap())
        .collect();
    assert!(
        keys.windows(2).all(|w| w[0] < w[1]),
        "keys in sealing order: {keys:?}"
    );
    assert_eq!(
        std::fs::read_dir(spool.path()).unwrap().count(),
        0,
        "segments deleted"
    );
}

#[test]
fn a_full_queue_drops_and_counts_instead_of_waiting() {
    let (peer, url) = Peer::start();
    peer.down.store(true, Ordering::SeqCst);
    let mut c = config(&url);
    c.queue_records = 8;
    c.queue_values = 100;
    let agent = Agent::start(c).unwrap();
    let mut refused = 0;
    for step in 0..20_000u64 {
        if !agent.log(step, loss(1.0)).unwrap() {
            refused += 1;
        }
    }
    let stats = agent.stats();
    assert!(refused > 0, "a tiny queue under a burst overflows");
    assert_eq!(stats.dropped_queue_full, refused);
    assert_eq!(stats.accepted_rows + refused, 20_000);
    agent.shutdown(Duration::from_secs(3));
}

#[test]
fn shutdown_returns_while_the_collector_is_away_and_a_new_process_replays_the_spool() {
    let (peer, url) = Peer::start();
    peer.down.store(true, Ordering::SeqCst);
    let spool = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.spool_dir = Some(spool.path().to_owned());
    let agent = Agent::start(c.clone()).unwrap();
    for step in 0..50 {
        agent.log(step, loss(step as f64)).unwrap();
    }
    let started = Instant::now();
    let stats = agent.shutdown(Duration::from_secs(3));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown is bounded"
    );
    assert!(agent.is_closed());
    assert!(
        stats.spooled_batches >= 1 && stats.dropped_rows == 0,
        "{stats:?}"
    );
    let old_session = agent.session().to_owned();
    assert!(matches!(
        agent.log(51, loss(0.0)),
        Err(rankwatch_agent::Error::Closed)
    ));
    drop(agent);

    peer.down.store(false, Ordering::SeqCst);
    let again = Agent::start(c).unwrap();
    assert!(again.flush(Duration::from_secs(10)).completed);
    let values: Vec<f64> = peer.stored_samples().iter().map(|s| s.value).collect();
    assert_eq!(values, (0..50).map(|s| s as f64).collect::<Vec<_>>());
    assert!(
        peer.stored().iter().all(|r| r.key.contains(&old_session)),
        "replayed batches keep the keys they were sealed with"
    );
}

#[test]
fn offline_runs_are_synced_later_with_their_keys() {
    let (peer, url) = Peer::start();
    let spool = tempfile::tempdir().unwrap();
    let mut c = config("http://unused.invalid");
    c.mode = Mode::Offline;
    c.spool_dir = Some(spool.path().to_owned());
    let agent = Agent::start(c).unwrap();
    for step in 0..30 {
        agent.log(step, loss(step as f64)).unwrap();
    }
    agent.shutdown(Duration::from_secs(3));
    assert!(
        peer.seen.lock().unwrap().is_empty(),
        "offline never connects"
    );
    let report =
        rankwatch_agent::sync_spool(spool.path(), &url, None, Duration::from_secs(5)).unwrap();
    assert_eq!((report.rows, report.remaining), (30, 0));
    let again =
        rankwatch_agent::sync_spool(spool.path(), &url, None, Duration::from_secs(5)).unwrap();
    assert_eq!(again.rows, 0, "a synced spool is empty");
    assert_eq!(peer.stored_samples().len(), 30);
}

#[test]
fn invalid_points_are_refused_whole_with_the_reason() {
    let (_peer, url) = Peer::start();
    let agent = Agent::start(config(&url)).unwrap();
    let mut points = loss(1.0);
    points.push(Point {
        metric: Metric::new("spectral.ratio").unwrap(),
        rank: None,
        layer: None,
        site: None,
        value: 1.0,
    });
    let err = agent.log(1, points).unwrap_err().to_string();
    assert!(
        err.contains("spectral.ratio") && err.contains("needs a layer"),
        "{err}"
    );
    assert_eq!(
        agent.stats().accepted_rows,
        0,
        "nothing of the call was queued"
    );
    assert!(Metric::new("spectral.ratoi").is_err());
    assert!(Metric::new("user/lr").is_ok());
}

#[test]
fn a_refused_batch_is_kept_beside_the_spool_and_synced_once_the_collector_takes_it() {
    let (peer, url) = Peer::start();
    let refusal = || {
        (
            422u16,
            vec![],
            r#"{"error":"too many series","reason":"cardinality"}"#.to_owned(),
        )
    };
    peer.script.lock().unwrap().push_back(refusal());
    let spool = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.spool_dir = Some(spool.path().to_owned());
    let agent = Agent::start(c).unwrap();
    agent.log(1, loss(1.0)).unwrap();
    agent.flush(Duration::from_secs(5));
    let stats = agent.stats();
    assert_eq!(
        (stats.set_aside_rows, stats.refused_rows, stats.dropped_rows),
        (1, 0, 0),
        "kept, so not lost"
    );
    let message = stats.last_error.unwrap();
    assert!(
        message.contains("too many series")
            && message.contains("refused")
            && message.contains("rankwatch sync"),
        "{message}"
    );
    agent.shutdown(Duration::from_secs(3));
    let refused_key = peer.seen.lock().unwrap()[0].key.clone();

    // Still refused: kept, not deleted, and not tried twice in one sync.
    peer.script.lock().unwrap().push_back(refusal());
    let report =
        rankwatch_agent::sync_spool(spool.path(), &url, None, Duration::from_secs(5)).unwrap();
    assert_eq!(
        (report.set_aside_rows, report.refused_rows, report.rows),
        (1, 0, 0)
    );
    // The limit was raised: the next sync delivers it, under its own key.
    let report =
        rankwatch_agent::sync_spool(spool.path(), &url, None, Duration::from_secs(5)).unwrap();
    assert_eq!((report.rows, report.set_aside_rows), (1, 0));
    let seen = peer.seen.lock().unwrap().clone();
    let last = seen.last().unwrap();
    assert_eq!(
        (last.key.as_str(), last.answered),
        (refused_key.as_str(), 200)
    );
    let again =
        rankwatch_agent::sync_spool(spool.path(), &url, None, Duration::from_secs(5)).unwrap();
    assert_eq!(again.rows, 0, "delivered once");
}
