//! One connection's share of the simulated ranks: ranks `c, c + C, c + 2C, …` of connection
//! `c` of `C`. At each step, in its slot of the step (connections spread evenly over it, as
//! agents whose one-second batch timers started at different moments are), it posts each of
//! its ranks' reports in turn on one keep-alive HTTP/1.1 connection, as that rank's agent
//! would: a `samples` batch, and a `sketches` batch at the steps the agent sketches, each with
//! the next idempotency key of the rank's session; behind schedule, one batch of every step
//! due (see [`drive`]). It records every answer's latency (from
//! the request's first byte to the answer's last), every refusal by status, every failed
//! connection, and how late it started each step against its slot — the generator's own lag,
//! so that a figure the generator could not keep up with is never read as the collector's.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rankwatch_agent::Table;
use rankwatch_agent::wire::{self, Row};
use rankwatch_analytics::RunId;
use rankwatch_analytics::agent_mix::{AgentMix, replica_sketch};
use rankwatch_analytics::math::SketchKind;
use tokio::net::TcpStream;

use crate::mix::{self, AgentRow};

/// What every connection shares.
pub(crate) struct Plan {
    pub(crate) run: RunId,
    pub(crate) ranks: u32,
    pub(crate) connections: u32,
    pub(crate) steps: u64,
    pub(crate) step: Duration,
    pub(crate) addr: SocketAddr,
    pub(crate) host: String,
    pub(crate) sketch_dim: usize,
    pub(crate) start: Instant,
    pub(crate) mix: AgentMix<AgentRow>,
    /// Answers so far, for the progress lines.
    pub(crate) answered: AtomicU64,
    pub(crate) failed: AtomicU64,
}

/// One connection's record.
#[derive(Default)]
pub(crate) struct Tally {
    /// Latency of each answered request in µs, by minute of the run.
    pub(crate) latency_us: Vec<Vec<u32>>,
    /// Answers by status.
    pub(crate) statuses: BTreeMap<u16, u64>,
    /// Requests that got no answer (connection refused, reset or closed).
    pub(crate) failed: u64,
    pub(crate) rows: u64,
    pub(crate) sketches: u64,
    pub(crate) body_bytes: u64,
    /// Slots this connection began more than a step late (its posts then carry several steps).
    pub(crate) late_steps: u64,
    pub(crate) max_lag: Duration,
}

impl Tally {
    pub(crate) fn merge(&mut self, other: Tally) {
        if self.latency_us.len() < other.latency_us.len() {
            self.latency_us
                .resize_with(other.latency_us.len(), Vec::new);
        }
        for (mine, theirs) in self.latency_us.iter_mut().zip(other.latency_us) {
            mine.extend(theirs);
        }
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        self.failed += other.failed;
        self.rows += other.rows;
        self.sketches += other.sketches;
        self.body_bytes += other.body_bytes;
        self.late_steps += other.late_steps;
        self.max_lag = self.max_lag.max(other.max_lag);
    }
}

/// Connection `conn`'s ranks, for the plan's steps. Training does not wait for the collector:
/// at each of its slots the connection posts, for each of its ranks, every step that came due
/// since that rank's last post, in one `samples` batch (and one `sketches` batch if any of them
/// sketched), as an agent that seals whatever its queue holds once a second does. A connection
/// the collector keeps waiting therefore sends fewer, larger batches, not a growing backlog,
/// and the run ends on time with every row sent.
pub(crate) async fn drive(conn: u32, plan: Arc<Plan>) -> Tally {
    let mut tally = Tally::default();
    let ranks: Vec<u32> = (conn..plan.ranks)
        .step_by(plan.connections as usize)
        .collect();
    // Each rank's agent session numbers its batches from 1.
    let mut seqs = vec![0u64; ranks.len()];
    let session = format!("loadgen-{}", std::process::id());
    let mut client = Client::new(plan.addr);
    let phase = plan
        .step
        .mul_f64(f64::from(conn) / f64::from(plan.connections));
    let first = plan.start + phase;
    // Steps before this one have been posted.
    let mut next = 0u64;
    while next < plan.steps {
        let slot = first + plan.step * next as u32;
        tokio::time::sleep_until(slot.into()).await;
        let lag = Instant::now().saturating_duration_since(slot);
        tally.max_lag = tally.max_lag.max(lag);
        if lag > plan.step {
            tally.late_steps += 1;
        }
        // Every step due by now, the one of this slot included.
        let due = (Instant::now().saturating_duration_since(first).as_nanos()
            / plan.step.as_nanos().max(1)) as u64;
        let through = due.clamp(next, plan.steps - 1);
        for (i, &rank) in ranks.iter().enumerate() {
            let time_ms = rankwatch_agent::now_ms();
            let mut rows = Vec::new();
            let mut sketches = Vec::new();
            for step in next..=through {
                let (points, sketch) = mix::report(&plan.mix, rank, step, plan.ranks);
                rows.extend(points.into_iter().map(|point| Row {
                    step,
                    time_ms,
                    point,
                }));
                if sketch {
                    // The SDK's default sketch; ranks agree about as well as the captured
                    // run's (cos to the mean ~0.6), so the collector sees a healthy run.
                    sketches.push(replica_sketch(
                        &plan.run,
                        rank,
                        step,
                        time_ms,
                        SketchKind::CountSketch,
                        plan.sketch_dim,
                        1.0,
                    ));
                }
            }
            let mut bodies = Vec::with_capacity(2);
            match wire::samples_body(&plan.run, &rows) {
                Ok(body) => bodies.push((Table::Samples, body)),
                Err(e) => panic!("the agent's encoder refused the mix: {e}"),
            }
            tally.rows += rows.len() as u64;
            if !sketches.is_empty() {
                match wire::sketches_body(&sketches) {
                    Ok(body) => bodies.push((Table::Sketches, body)),
                    Err(e) => panic!("the agent's encoder refused a sketch: {e}"),
                }
                tally.sketches += sketches.len() as u64;
            }
            for (table, body) in bodies {
                seqs[i] += 1;
                let key = wire::idempotency_key(&plan.run, rank, &session, seqs[i]);
                tally.body_bytes += body.len() as u64;
                let sent = Instant::now();
                match client.post(&plan.host, table, &key, body).await {
                    Some(status) => {
                        let minute =
                            (sent.saturating_duration_since(plan.start)).as_secs() as usize / 60;
                        if tally.latency_us.len() <= minute {
                            tally.latency_us.resize_with(minute + 1, Vec::new);
                        }
                        let us = sent.elapsed().as_micros().min(u32::MAX as u128) as u32;
                        tally.latency_us[minute].push(us);
                        *tally.statuses.entry(status).or_default() += 1;
                        plan.answered.fetch_add(1, Relaxed);
                    }
                    None => {
                        tally.failed += 1;
                        plan.failed.fetch_add(1, Relaxed);
                    }
                }
            }
        }
        next = through + 1;
    }
    tally
}

/// One keep-alive HTTP/1.1 connection, opened again after it fails.
pub(crate) struct Client {
    addr: SocketAddr,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Client {
    pub(crate) fn new(addr: SocketAddr) -> Client {
        Client { addr, sender: None }
    }

    /// Posts one batch; its answer's status, or `None` if there was no answer.
    pub(crate) async fn post(
        &mut self,
        host: &str,
        table: Table,
        key: &str,
        body: Vec<u8>,
    ) -> Option<u16> {
        let sender = match &mut self.sender {
            Some(sender) => sender,
            None => self.sender.insert(connect(self.addr).await?),
        };
        let mut request = Request::post(wire::ingest_path(table)).header("host", host);
        for (name, value) in wire::headers(key) {
            request = request.header(name, value);
        }
        let request = request.body(Full::new(Bytes::from(body))).ok()?;
        let answer = async {
            sender.ready().await.ok()?;
            let response = sender.send_request(request).await.ok()?;
            let status = response.status().as_u16();
            // The whole answer, as the agent reads it.
            response.into_body().collect().await.ok()?;
            Some(status)
        }
        .await;
        if answer.is_none() {
            self.sender = None;
        }
        answer
    }
}

async fn connect(addr: SocketAddr) -> Option<SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(connection);
    Some(sender)
}
