//! Shared helpers: an in-process collector driven through `tower::ServiceExt::oneshot`, and
//! batch builders.

#![allow(dead_code, unreachable_pub)]

use std::path::Path;

use arrow_array::RecordBatch;
use arrow_ipc::writer::{IpcWriteOptions, StreamWriter};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use rankwatch_analytics::math::sketch::SketchKind;
use rankwatch_analytics::schema::{samples, sketches};
use rankwatch_analytics::{
    LayerLayout, MetricName, ModelLayout, RunId, RunInfo, Sample, Site, SketchRecord,
};
use rankwatch_collector::{Collector, ServeConfig};
use serde_json::Value;
use tower::ServiceExt;

pub const ARROW: &str = "application/vnd.apache.arrow.stream";

pub fn config(dir: &Path) -> ServeConfig {
    let mut c = ServeConfig::with_data_dir(dir);
    // Background flushes are driven by the tests themselves.
    c.flush_interval = std::time::Duration::from_secs(3600);
    c.compact_interval = std::time::Duration::from_secs(3600);
    c
}

/// A collector that only stores (no alert engine): for tests that count exactly what they
/// ingested.
pub async fn open_store_only(dir: &Path) -> Collector {
    let mut c = config(dir);
    c.no_alert_engine = true;
    Collector::open(&c).await.expect("collector opens")
}

pub async fn open(dir: &Path) -> Collector {
    Collector::open(&config(dir))
        .await
        .expect("collector opens")
}

/// The rows `query` answers through `/api/v1/sql` (which must answer 200).
pub async fn sql(c: &Collector, query: &str) -> Vec<serde_json::Value> {
    let q = post(
        c,
        "/api/v1/sql",
        "application/json",
        None,
        serde_json::json!({ "sql": query }).to_string().into_bytes(),
    )
    .await;
    assert_eq!(q.status, 200, "{}", q.text());
    q.json()["rows"].as_array().unwrap().clone()
}

/// The value of the series `name` (with its labels, if any, as exposed) in a `/metrics` text.
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not json ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn error(&self) -> String {
        self.json()["error"].as_str().unwrap_or_default().to_owned()
    }
}

pub async fn call(c: &Collector, request: Request<Body>) -> Reply {
    let response = c.app().oneshot(request).await.expect("router answers");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    Reply {
        status,
        headers,
        body,
    }
}

pub async fn get(c: &Collector, uri: &str) -> Reply {
    call(c, Request::get(uri).body(Body::empty()).unwrap()).await
}

/// A collector on `dir` (its alert engine off) whose store writes through `disk`: the file
/// system seam the fault tests implement.
pub async fn open_on_disk(dir: &Path, disk: rankwatch_collector::disk::SharedDisk) -> Collector {
    let mut config = config(dir);
    config.no_alert_engine = true;
    Collector::open_on(
        &config,
        rankwatch_collector::clock::SystemClock::shared(),
        disk,
    )
    .await
    .expect("collector opens")
}

pub async fn post(
    c: &Collector,
    uri: &str,
    content_type: &str,
    key: Option<&str>,
    body: Vec<u8>,
) -> Reply {
    let mut request = Request::post(uri).header("content-type", content_type);
    if let Some(k) = key {
        request = request.header("idempotency-key", k);
    }
    call(c, request.body(Body::from(body)).unwrap()).await
}

pub fn ipc(batch: &RecordBatch, zstd: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let options = if zstd {
        IpcWriteOptions::default()
            .try_with_compression(Some(arrow_ipc::CompressionType::ZSTD))
            .unwrap()
    } else {
        IpcWriteOptions::default()
    };
    let mut w = StreamWriter::try_new_with_options(&mut out, &batch.schema(), options).unwrap();
    w.write(batch).unwrap();
    w.finish().unwrap();
    drop(w);
    out
}

pub fn sample(
    run: &str,
    rank: Option<u32>,
    step: u64,
    metric: &str,
    layer: Option<u32>,
    site: Option<Site>,
    value: f64,
) -> Sample {
    Sample {
        run: RunId::new(run).unwrap(),
        rank,
        step,
        time_ms: 1_700_000_000_000 + step as i64,
        metric: MetricName::new(metric).unwrap(),
        layer,
        site,
        value,
    }
}

pub fn samples_ipc(rows: &[Sample], zstd: bool) -> Vec<u8> {
    ipc(&samples::to_batch(rows).unwrap(), zstd)
}

pub fn sketch(run: &str, rank: u32, step: u64, vector: Vec<f32>) -> SketchRecord {
    let norm = vector
        .iter()
        .map(|v| (*v as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    SketchRecord {
        run: RunId::new(run).unwrap(),
        rank,
        step,
        time_ms: 1_700_000_000_000,
        kind: SketchKind::Rademacher,
        seed: 7,
        norm,
        vector,
    }
}

pub fn sketches_ipc(rows: &[SketchRecord]) -> Vec<u8> {
    ipc(&sketches::to_batch(rows).unwrap(), false)
}

pub fn info(run: &str, world: u32, layers: u32) -> RunInfo {
    RunInfo {
        run: RunId::new(run).unwrap(),
        world_size: world,
        started_at_ms: 1_700_000_000_000,
        layout: ModelLayout {
            family: "llama".into(),
            layers: (0..layers)
                .map(|i| LayerLayout {
                    index: i,
                    sites: Site::MATRICES.to_vec(),
                    attention: None,
                    experts: None,
                })
                .collect(),
        },
        tags: Default::default(),
    }
}

pub fn runs_ipc(info: &RunInfo) -> Vec<u8> {
    ipc(
        &rankwatch_analytics::schema::runs::to_batch(std::slice::from_ref(info)).unwrap(),
        false,
    )
}

/// A run of `ranks` ranks × `steps` steps: per-rank loss, per-layer spectral ratio per rank.
pub fn workload(run: &str, ranks: u32, steps: u64, layers: u32) -> Vec<Sample> {
    let mut rows = Vec::new();
    for step in 0..steps {
        for rank in 0..ranks {
            rows.push(sample(
                run,
                Some(rank),
                step,
                "loss",
                None,
                None,
                3.0 - step as f64 * 0.01 + rank as f64 * 0.001,
            ));
            for layer in 0..layers {
                rows.push(sample(
                    run,
                    Some(rank),
                    step,
                    "spectral.ratio",
                    Some(layer),
                    None,
                    1.0 + layer as f64 * 0.1 + step as f64 * 0.001,
                ));
            }
        }
    }
    rows
}

/// Every file under `dir` with its size, sorted; the lock file is left out (each collector
/// rewrites it).
pub fn files_under(dir: &Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let entry = entry.unwrap();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else if entry.file_name() != "LOCK" {
                out.push((entry.path(), meta.len()));
            }
        }
    }
    out.sort();
    out
}

/// Ingests `workload(run, ranks, steps, 1)` for each run; each batch must be accepted.
pub async fn ingest_runs(c: &Collector, runs: &[&str], ranks: u32, steps: u64) {
    for run in runs {
        let body = samples_ipc(&workload(run, ranks, steps, 1), false);
        let r = post(c, "/api/v1/ingest", ARROW, None, body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// The runs the collector lists, sorted.
pub async fn run_names(c: &Collector) -> Vec<String> {
    let mut names: Vec<String> = get(c, "/api/v1/runs").await.json()["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// The real `rankwatch serve` binary on a free loopback port, with `args`, on `dir`; returns
/// the child and the base URL it printed.
pub fn spawn_rankwatch(dir: &Path, args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_rankwatch"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .arg("--data-dir")
        .arg(dir)
        .env("RANKWATCH_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("rankwatch binary starts");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line.trim().rsplit(' ').next().unwrap().to_owned();
    assert!(base.starts_with("http://127.0.0.1:"), "{line}");
    (child, base)
}

/// An HTTP receiver stub for alert deliveries: records (path, JSON body) of every POST it
/// accepts; answers 503 to the first `fail_first` requests, and while `down` is set.
pub struct Receiver {
    /// `http://127.0.0.1:PORT`: post to any path under it.
    pub base: String,
    pub got: std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>,
    pub down: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Receiver {
    pub fn start(fail_first: usize) -> Receiver {
        use std::io::{BufRead, Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let receiver = Receiver {
            base,
            got: Default::default(),
            down: Default::default(),
        };
        let (seen, refusing) = (receiver.got.clone(), receiver.down.clone());
        std::thread::spawn(move || {
            let mut served = 0;
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                let mut length = 0;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = header.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    continue;
                }
                served += 1;
                let status = if served <= fail_first || refusing.load(Ordering::SeqCst) {
                    "503 Service Unavailable"
                } else {
                    seen.lock()
                        .unwrap()
                        .push((path, serde_json::from_slice(&body).unwrap()));
                    "200 OK"
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
            }
        });
        receiver
    }
}
