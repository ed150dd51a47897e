//! Clients that are slow, greedy or many: the whole server (the real connection loop and
//! router, in-process on port 0) keeps answering everyone else, and each bound says which
//! flag sets it.

use std::net::SocketAddr;
use std::time::Duration;

use rankwatch_collector::ServeConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::common::{self, ARROW, samples_ipc, sketch, sketches_ipc, workload};

/// A collector serving on a loopback port until `stop`.
struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: JoinHandle<rankwatch_collector::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(adjust: impl FnOnce(&mut ServeConfig)) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let mut config = common::config(dir.path());
        config.no_alert_engine = true;
        adjust(&mut config);
        let collector = rankwatch_collector::Collector::open(&config).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel();
        let done = tokio::spawn(async move {
            rankwatch_collector::server::serve_on(collector, listener, &config, async {
                let _ = stopped.await;
            })
            .await
        });
        Server {
            addr,
            stop: Some(stop),
            done,
            _dir: dir,
        }
    }

    /// Shuts the server down and waits for it (bounded: a hang fails the test).
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(60), self.done)
            .await
            .expect("the server shuts down")
            .unwrap()
            .expect("shutdown is clean");
    }

    async fn connect(&self) -> TcpStream {
        TcpStream::connect(self.addr).await.unwrap()
    }

    /// A connection from another loopback address (every 127.x.y.z is this host's): another
    /// peer, as the collector counts them.
    async fn connect_from(&self, source: [u8; 4]) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(SocketAddr::from((source, 0)))
            .expect("any 127/8 source address binds on Linux");
        socket.connect(self.addr).await.unwrap()
    }

    /// `POST /api/v1/sql` with the query as plain text.
    async fn sql(&self, query: &[u8]) -> Answer {
        self.request(
            "POST /api/v1/sql HTTP/1.1\r\nContent-Type: text/plain",
            query,
        )
        .await
    }

    /// `POST /api/v1/ingest` of an Arrow body, with an idempotency key if given.
    async fn ingest(&self, body: &[u8], key: Option<&str>) -> Answer {
        let key = key.map_or(String::new(), |k| format!("\r\nIdempotency-Key: {k}"));
        let head = format!("POST /api/v1/ingest HTTP/1.1\r\nContent-Type: {ARROW}{key}");
        self.request(&head, body).await
    }

    /// One request on a fresh connection; the whole answer (the server closes after it).
    async fn request(&self, head: &str, body: &[u8]) -> Answer {
        let mut stream = self.connect().await;
        let head = format!(
            "{head}\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body).await.unwrap();
        read_answer(&mut stream).await
    }
}

/// An HTTP answer: status, head and body (the body as sent, chunked or not).
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

async fn read_answer(stream: &mut TcpStream) -> Answer {
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw))
        .await
        .expect("the server answers and closes")
        .unwrap();
    parse_answer(&raw)
}

fn parse_answer(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    Answer {
        status,
        head: head.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

/// Sends a request head announcing `length` body bytes and `sent` of them, then stalls.
async fn stalled_post(server: &Server, path: &str, content_type: &str, length: usize) -> TcpStream {
    let mut stream = server.connect().await;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n\
         Content-Length: {length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&[b'x'; 10]).await.unwrap();
    stream
}

async fn metric(server: &Server, name: &str) -> f64 {
    let answer = server.request("GET /metrics HTTP/1.1", b"").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    answer
        .body
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_sent_byte_by_byte_is_cut_off_while_others_are_served() {
    let server = Server::start(|c| c.header_timeout = Duration::from_secs(1)).await;
    let mut slow = server.connect().await;
    slow.write_all(b"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    // Meanwhile the collector answers others.
    let answer = server.request("GET /healthz HTTP/1.1", b"").await;
    assert_eq!(answer.status, 200);
    // A header line a little at a time never completes the head; the server closes.
    let closed = async {
        let mut buf = [0u8; 256];
        loop {
            if slow.write_all(b"X-Slow: a\r\n").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            match tokio::time::timeout(Duration::from_millis(1), slow.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), closed)
        .await
        .expect("the slow connection is closed after the header timeout");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_holds_no_slot_past_the_body_timeout_and_others_are_refused_meanwhile() {
    let server = Server::start(|c| {
        c.body_timeout = Duration::from_secs(1);
        c.max_concurrent_requests = 1;
        c.queue_wait = Duration::from_millis(100);
    })
    .await;
    let mut stalled = stalled_post(&server, "/api/v1/ingest", ARROW, 1000).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The one request slot is taken: a query is refused at once, naming the flag...
    let busy = server.sql(b"SELECT 1").await;
    assert_eq!(busy.status, 429, "{busy:?}");
    assert!(busy.head.contains("retry-after: 1"), "{busy:?}");
    assert!(busy.body.contains("--max-concurrent-requests"), "{busy:?}");
    assert!(busy.body.contains("\"busy\""), "{busy:?}");
    // ...while health and the scrape, which take no slot, still answer.
    assert_eq!(
        server.request("GET /healthz HTTP/1.1", b"").await.status,
        200
    );
    assert_eq!(metric(&server, "rankwatch_inflight_requests").await, 1.0);
    // The stalled body gets 408 naming the timeout, and the connection is closed.
    let answer = read_answer(&mut stalled).await;
    assert_eq!(answer.status, 408, "{answer:?}");
    assert!(answer.body.contains("--body-timeout"), "{answer:?}");
    assert!(answer.head.contains("connection: close"), "{answer:?}");
    // The slot is free again.
    let ok = server.sql(b"SELECT 1").await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(metric(&server, "rankwatch_inflight_requests").await, 0.0);
    assert_eq!(
        metric(&server, "rankwatch_ingest_rejects_total{reason=\"busy\"}").await,
        1.0
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_bodies_in_flight_are_bounded_by_their_declared_size() {
    let server = Server::start(|c| {
        c.max_body_bytes = 60_000;
        c.max_inflight_bytes = 100_000;
        c.queue_wait = Duration::from_millis(100);
        c.body_timeout = Duration::from_secs(5);
    })
    .await;
    let _held = stalled_post(&server, "/api/v1/ingest", ARROW, 60_000).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        metric(&server, "rankwatch_inflight_body_bytes").await,
        60_000.0
    );
    // 50,000 more would pass the budget: refused before a byte of it is read.
    let refused = stalled_post(&server, "/api/v1/ingest", ARROW, 50_000).await;
    let answer = {
        let mut refused = refused;
        read_answer(&mut refused).await
    };
    assert_eq!(answer.status, 429, "{answer:?}");
    assert!(answer.body.contains("--max-inflight-bytes"), "{answer:?}");
    // A real batch that fits is stored.
    let body = samples_ipc(&workload("fits", 2, 5, 1), false);
    assert!(
        body.len() < 40_000,
        "the test batch is {} bytes",
        body.len()
    );
    let stored = server.ingest(&body, None).await;
    assert_eq!(stored.status, 200, "{stored:?}");
    assert!(stored.body.contains("\"stored\""), "{stored:?}");
    server.stop().await;
}

/// Issue 45's stalled chunked bodies: a body without Content-Length was charged the whole
/// body limit up front and held it up to --body-timeout, so a few of them took the ingest
/// budget and every agent got 429. Now it is charged as its bytes arrive (64 KiB at a time):
/// four stalled chunked bodies hold 4 × 64 KiB, and a real batch beside them is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_chunked_bodies_hold_what_they_sent_not_the_body_limit() {
    let server = Server::start(|c| {
        c.max_body_bytes = 1 << 20;
        c.max_inflight_bytes = 2 << 20;
        c.queue_wait = Duration::from_millis(100);
        c.body_timeout = Duration::from_secs(20);
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut stream = server.connect().await;
        let head = format!(
            "POST /api/v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ARROW}\r\n\
             Transfer-Encoding: chunked\r\n\r\na\r\nxxxxxxxxxx\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stalled.push(stream);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        metric(&server, "rankwatch_inflight_body_bytes").await,
        4.0 * 65_536.0,
        "each stalled body holds one step, not the 1 MiB limit"
    );
    let body = samples_ipc(&workload("beside", 2, 5, 1), false);
    let stored = server.ingest(&body, None).await;
    assert_eq!(stored.status, 200, "{stored:?}");
    // The stalled ones are still waiting, not refused.
    for stream in &mut stalled {
        let mut byte = [0u8; 1];
        let answered =
            tokio::time::timeout(Duration::from_millis(50), stream.read(&mut byte)).await;
        assert!(
            answered.is_err(),
            "a stalled body was answered: {answered:?}"
        );
    }
    drop(stalled);
    server.stop().await;
}

/// Issue 45's decompression bombs: the in-flight budget counted compressed bytes, so a zstd
/// body of a few KiB decoding to 50 MiB was decoded whatever the budget. Now a body whose
/// buffers decode to more than `--max-body-bytes` is refused (`413`) before a byte is decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_decoding_past_the_body_limit_is_refused_before_it_is_decoded() {
    use std::sync::Arc;
    let server = Server::start(|c| {
        c.max_body_bytes = 1 << 20;
        c.max_inflight_bytes = 2 << 20;
    })
    .await;
    let batch =
        rankwatch_analytics::schema::samples::to_batch(&workload("bomb", 1, 1, 1)[..1]).unwrap();
    let metric = batch.schema().index_of("metric").unwrap();
    let mut columns = batch.columns().to_vec();
    // 20 MiB that zstd shrinks about a hundredfold (a random letter every 100 bytes): under the
    // framing check's 1000-fold bound, far over the body limit once decoded.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let text: String = (0..20 << 20)
        .map(|i| {
            if i % 100 == 0 {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                char::from(b'a' + (seed >> 59) as u8 % 26)
            } else {
                'm'
            }
        })
        .collect();
    columns[metric] = Arc::new(arrow_array::StringArray::from(vec![text]));
    let bomb = common::ipc(
        &arrow_array::RecordBatch::try_new(batch.schema(), columns).unwrap(),
        true,
    );
    assert!(bomb.len() < 1 << 20, "the bomb is {} bytes", bomb.len());
    let answer = server.ingest(&bomb, None).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert!(
        answer.body.contains("decode to") && answer.body.contains("--max-body-bytes"),
        "{answer:?}"
    );
    server.stop().await;
}

/// The decoded size is charged to the in-flight budget with the body: a zstd batch whose
/// compressed bytes fit beside a stalled body but whose decoded rows do not waits, then gets
/// `429`; once the room is free it is stored. (Before, only its compressed bytes were charged
/// and it was decoded at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoded_bytes_are_charged_to_the_in_flight_budget() {
    let server = Server::start(|c| {
        c.max_body_bytes = 2 << 20;
        c.max_inflight_bytes = 2 << 20;
        c.queue_wait = Duration::from_millis(200);
        c.body_timeout = Duration::from_secs(20);
    })
    .await;
    let body = common::ipc(
        &rankwatch_analytics::schema::samples::to_batch(&workload("zstd", 8, 400, 4)).unwrap(),
        true,
    );
    let decoded = rankwatch_collector::decode::preflight(&body, usize::MAX).unwrap();
    let held = 1_200_000;
    let free = (2 << 20) - held;
    assert!(
        body.len() < free && body.len() + decoded > free && decoded < 2 << 20,
        "compressed {} bytes, decoded {decoded}",
        body.len()
    );
    let stalled = stalled_post(&server, "/api/v1/ingest", ARROW, held).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = server.ingest(&body, None).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(refused.body.contains("--max-inflight-bytes"), "{refused:?}");
    drop(stalled);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stored = server.ingest(&body, None).await;
    assert_eq!(stored.status, 200, "{stored:?}");
    assert_eq!(
        metric(&server, "rankwatch_inflight_body_bytes").await,
        0.0,
        "every charge is returned"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_are_capped_and_end_cleanly_at_shutdown() {
    let server = Server::start(|c| c.max_event_streams = 2).await;
    let mut streams = Vec::new();
    for _ in 0..2 {
        let mut s = server.connect().await;
        s.write_all(b"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut head = vec![0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut head))
            .await
            .expect("the stream opens")
            .unwrap();
        assert!(
            String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&head[..n])
        );
        streams.push(s);
    }
    let third = server.request("GET /api/v1/events HTTP/1.1", b"").await;
    assert_eq!(third.status, 429, "{third:?}");
    assert!(third.body.contains("--max-event-streams"), "{third:?}");
    assert_eq!(metric(&server, "rankwatch_sse_clients").await, 2.0);

    server.stop().await;
    // Each stream was ended by the server (the chunked body's last chunk), not cut.
    for mut s in streams {
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
            .await
            .expect("the stream is closed")
            .unwrap();
        assert!(
            rest.ends_with(b"0\r\n\r\n"),
            "{:?}",
            String::from_utf8_lossy(&rest)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_wait_for_one_to_close() {
    let server = Server::start(|c| c.max_connections = 4).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(server.connect().await);
    }
    // Let the loop accept the four.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A fifth is queued by the kernel, not served...
    let mut fifth = server.connect().await;
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), fifth.read(&mut buf))
            .await
            .is_err(),
        "a fifth connection was served while four were open"
    );
    // ...until one of the four closes.
    drop(idle.pop());
    let answer = read_answer(&mut fifth).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    drop(idle);
    server.stop().await;
}

/// Issue 45 item 10: one address may hold `--max-connections-per-peer` connections; past it a
/// connection is answered 429 naming the flag (before, it waited in the backlog behind the
/// global cap like everyone's), and other addresses are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_past_its_cap_is_refused_with_the_reason_and_others_are_served() {
    let server = Server::start(|c| c.max_connections_per_peer = 3).await;
    let greedy = [127, 0, 0, 7];
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(server.connect_from(greedy).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let healthz = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    let mut fourth = server.connect_from(greedy).await;
    fourth.write_all(healthz).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut fourth))
        .await
        .expect("the refusal comes at once");
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(
        refused
            .body
            .contains("too many connections from 127.0.0.7: 3 open")
            && refused.body.contains("--max-connections-per-peer"),
        "{refused:?}"
    );
    // Another address is served while the greedy one holds its three.
    let mut other = server.connect_from([127, 0, 0, 8]).await;
    other.write_all(healthz).await.unwrap();
    assert_eq!(read_answer(&mut other).await.status, 200);
    // A place given back is a place for the same address again.
    drop(idle.pop());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut again = server.connect_from(greedy).await;
    again.write_all(healthz).await.unwrap();
    assert_eq!(read_answer(&mut again).await.status, 200);
    drop(idle);
    server.stop().await;
}

/// Issue 45's clients that never read: each pipelines requests for the OpenAPI document with
/// a tiny receive window and reads nothing, so the server's writes block. hyper has no write
/// timeout, so they held every connection permit for ever and a newcomer's `/healthz` was
/// never accepted. Now a write that makes no progress for `--write-timeout` closes its
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_their_answers_are_cut_off_and_others_are_served() {
    let server = Server::start(|c| {
        c.max_connections = 8;
        c.write_timeout = Duration::from_secs(2);
    })
    .await;
    let requests = b"GET /api/v1/openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(400);
    let mut hogs = Vec::new();
    for _ in 0..8 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(1024).unwrap();
        let stream = socket.connect(server.addr).await.unwrap();
        let (reader, mut writer) = stream.into_split();
        let requests = requests.clone();
        let sending = tokio::spawn(async move {
            let _ = writer.write_all(&requests).await;
            writer
        });
        hogs.push((reader, sending));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let answered = tokio::time::timeout(
        Duration::from_secs(20),
        server.request("GET /healthz HTTP/1.1", b""),
    )
    .await
    .expect("a newcomer is served while the clients that never read hold their connections");
    assert_eq!(answered.status, 200, "{answered:?}");
    // The ones that never read were closed: their reads end (after what the kernel held).
    for (mut reader, _) in hogs {
        let mut sink = vec![0u8; 1 << 16];
        let ended = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                match reader.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "a connection that never read is still open");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_over_the_memory_pool_fails_naming_the_limit_and_the_collector_goes_on() {
    let server = Server::start(|c| c.query_memory = 256 << 10).await;
    let body = samples_ipc(&workload("big", 8, 400, 8), false);
    let stored = server.ingest(&body, None).await;
    assert_eq!(stored.status, 200, "{stored:?}");
    // Every value into one string: an aggregate that cannot spill.
    let sql = b"SELECT string_agg(CAST(value AS VARCHAR) || metric, ',') FROM samples";
    let answer = server.sql(sql).await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(answer.body.contains("--query-memory"), "{answer:?}");
    let small = server.sql(b"SELECT count(*) AS n FROM samples").await;
    assert_eq!(small.status, 200, "{small:?}");
    assert!(small.body.contains("28800"), "{small:?}");
    server.stop().await;
}

/// Issue 45's SQL results outside the memory pool: a function whose result's size is set by an
/// argument allocated it inside DataFusion (`repeat('x', 2000000000)` four times at once took
/// more than 20 GB with the read token), and the answer was collected whole whatever its
/// size. Such functions are refused, naming why, wherever they appear; the answer stops at
/// `--sql-max-result-bytes` and says it was truncated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_answers_are_bounded_in_bytes_and_amplifying_functions_are_refused() {
    let server = Server::start(|c| {
        c.sql_max_rows = 1_000_000;
        c.sql_max_result_bytes = 1 << 20;
    })
    .await;
    for sql in [
        "SELECT repeat('x', 200000000) AS x",
        "SELECT length(x) FROM (SELECT lpad('a', 200000000, 'b') AS x)",
        "SELECT count(*) FROM samples WHERE metric IN (SELECT rpad(metric, 200000000) FROM samples)",
        "SELECT x FROM (SELECT repeat(metric, 10000000) AS x FROM samples) LIMIT 1",
    ] {
        let answer = server.sql(sql.as_bytes()).await;
        assert_eq!(
            answer.status,
            400,
            "{sql}: {}",
            &answer.body[..answer.body.len().min(300)]
        );
        assert!(
            answer.body.contains("is not available here") && answer.body.contains("--query-memory"),
            "{sql}: {}",
            &answer.body[..answer.body.len().min(300)]
        );
    }
    let body = samples_ipc(&workload("big", 8, 400, 8), false);
    assert_eq!(server.ingest(&body, None).await.status, 200);
    let all = server.sql(b"SELECT * FROM samples").await;
    assert_eq!(all.status, 200, "{}", &all.body[..all.body.len().min(300)]);
    let answer: serde_json::Value = serde_json::from_str(&all.body).unwrap();
    let rows = answer["rows"].as_array().unwrap().len();
    assert_eq!(answer["truncated"], true, "28,800 rows are over 1 MiB");
    assert!(rows > 0 && rows < 28_800, "{rows} rows");
    // What fits is answered whole.
    let count = server.sql(b"SELECT count(*) AS n FROM samples").await;
    assert!(
        count.body.contains("28800") && count.body.contains("\"truncated\":false"),
        "{count:?}"
    );
    server.stop().await;
}

/// `WITH` levels each doubling the last level's `s` with `op`, from `seed`: 2^depth times
/// the seed, from a query a few hundred bytes long.
fn doubling(seed: &str, depth: usize, op: impl Fn(&str) -> String) -> String {
    let mut sql = format!("WITH l0 AS ({seed})");
    for i in 1..=depth {
        sql += &format!(", l{i} AS (SELECT {} AS s FROM l{})", op("s"), i - 1);
    }
    sql + &format!(" SELECT length(s) AS n FROM l{depth}")
}

#[tokio::test]
async fn sql_functions_cannot_grow_a_value_past_the_limit_from_the_querys_own_text() {
    let server = Server::start(|c| {
        c.sql_max_rows = 1_000_000;
        c.sql_max_result_bytes = 1 << 20;
    })
    .await;
    let body = samples_ipc(&workload("grow", 2, 50, 4), false);
    assert_eq!(server.ingest(&body, None).await.status, 200);
    // Each would make 2^27 bytes a row (128 MiB; 1 GiB at depth 30) where the answer may hold
    // 1 MiB. Before the guard these were made whole and answered `200` (length only).
    let attacks = [
        doubling("SELECT 'x' AS s", 27, |s| format!("{s} || {s}")),
        doubling("SELECT 'x' AS s", 27, |s| format!("concat({s}, {s})")),
        doubling("SELECT metric AS s FROM samples", 27, |s| {
            format!("{s} || {s}")
        }),
        doubling("SELECT metric AS s FROM samples", 27, |s| {
            format!("concat_ws({s}, {s}, '')")
        }),
        doubling("SELECT metric AS s FROM samples", 27, |s| {
            format!("regexp_replace({s}, '.*', '$0$0', 'g')")
        }),
        // One call whose result is past the limit at once: a replacement per character.
        format!(
            "SELECT length(replace(repeated, 'x', '{}')) AS n FROM (SELECT {} AS repeated)",
            "y".repeat(120),
            "'x' || ".repeat(60) + "'x'"
        ),
        // A literal is copied into every row of a batch: at most 1 MiB / 8,192 rows, or 256
        // bytes, whichever is more.
        format!("SELECT '{}' AS s FROM samples", "z".repeat(300)),
        // A join copies each row of a side up to a batch's rows: thirty 100-byte columns,
        // 3,000 bytes a row, 24 MB a batch. Before, made and answered (`200`, one row).
        format!(
            "WITH w AS (SELECT {}) SELECT w.* FROM w CROSS JOIN samples LIMIT 1",
            (0..30)
                .map(|i| format!("'{}' AS c{i}", "w".repeat(100)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ];
    for sql in &attacks {
        let answer = server.sql(sql.as_bytes()).await;
        assert_eq!(
            answer.status,
            400,
            "{}…: {}",
            &sql[..120],
            &answer.body[..answer.body.len().min(300)]
        );
        assert!(
            answer.body.contains("--sql-max-result-bytes"),
            "{}…: {}",
            &sql[..120],
            &answer.body[..answer.body.len().min(300)]
        );
    }
    // Below the limit the same functions answer as DataFusion does, with the operator's
    // column names and NULL rule.
    let fine = server
        .sql(
            b"SELECT metric || '/' || CAST(rank AS VARCHAR) AS key, count(*) AS n, \
              replace(min(metric), '_', '.') AS dotted, concat_ws('-', 'a', 'b') AS ws, \
              min(site) || NULL AS gone, 'a' || 'b' \
              FROM samples GROUP BY metric || '/' || CAST(rank AS VARCHAR) \
              ORDER BY key LIMIT 2",
        )
        .await;
    assert_eq!(fine.status, 200, "{}", fine.body);
    let answer: serde_json::Value = serde_json::from_str(&fine.body).unwrap();
    let rows = answer["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{answer}");
    let first = &rows[0];
    let key = first["key"].as_str().unwrap();
    assert!(key.ends_with("/0") && key.len() > 2, "{answer}");
    assert!(first["n"].as_u64().unwrap() > 0, "{answer}");
    assert!(!first["dotted"].as_str().unwrap().contains('_'), "{answer}");
    assert_eq!(first["ws"], "a-b", "{answer}");
    assert!(first["gone"].is_null(), "|| with NULL is NULL: {answer}");
    assert_eq!(
        first["Utf8(\"a\") || Utf8(\"b\")"], "ab",
        "the operator's name: {answer}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_expression_nested_past_the_limit_is_refused_before_it_overflows_the_stack() {
    let server = Server::start(|_| {}).await;
    // A thousand `||` overflowed the answering thread's stack and aborted the collector.
    for sql in [
        format!("SELECT length({}'x') AS n", "'x' || ".repeat(1000)),
        format!("SELECT {}1 AS n", "1 + ".repeat(5000)),
    ] {
        let answer = server.sql(sql.as_bytes()).await;
        assert_eq!(answer.status, 400, "{}", answer.body);
        assert!(
            answer.body.contains("nest more than 64 deep"),
            "{}",
            answer.body
        );
    }
    // Nested calls and brackets the parser counts itself, refusing past 50.
    let sql = format!("SELECT {}1{} AS n", "abs(".repeat(1000), ")".repeat(1000));
    let answer = server.sql(sql.as_bytes()).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer.body.contains("RecursionLimitExceeded"),
        "{}",
        answer.body
    );
    // Up to the limit the query is answered, on the test's own 2 MiB worker stack.
    let sql = format!("SELECT length({}'x') AS n", "'x' || ".repeat(62));
    let answer = server.sql(sql.as_bytes()).await;
    assert!(
        answer.status == 200 && answer.body.contains("\"n\":63"),
        "{answer:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn sql_over_lists_aggregates_and_windows_is_answered_within_budget_or_refused_by_name() {
    // Default limits: 64 MiB a batch, 8 KiB a value.
    let server = Server::start(|_| {}).await;
    let body = samples_ipc(&workload("w", 8, 200, 2), false);
    assert_eq!(server.ingest(&body, None).await.status, 200);
    // 4,160 rows in one batch: an unnest measured by the whole list (256 bytes a row, not 4
    // an element) refused it.
    let sketches: Vec<_> = (0..520)
        .flat_map(|step| (0..8).map(move |rank| sketch("w", rank, step, vec![0.5; 64])))
        .collect();
    let head = format!("POST /api/v1/ingest?table=sketches HTTP/1.1\r\nContent-Type: {ARROW}");
    let r = server.request(&head, &sketches_ipc(&sketches)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // What a user asks of the sketches' vectors: a join carrying them, an unnest of them.
    // Measured by row (64 floats), not by the whole column.
    for sql in [
        "SELECT k.step, k.vector, s.value FROM sketches k JOIN samples s \
         ON k.step = s.step AND k.rank = s.rank WHERE k.step < 50 LIMIT 5",
        "SELECT step, unnest(vector) AS v FROM sketches WHERE step < 20 LIMIT 5",
        "SELECT step, unnest(vector) AS v FROM sketches ORDER BY v DESC LIMIT 5",
        "SELECT log(3, power(3, value)) = value AS same FROM samples LIMIT 5",
    ] {
        let answer = server.sql(sql.as_bytes()).await;
        assert_eq!(answer.status, 200, "{sql}: {}", answer.body);
        assert!(
            answer.body.contains("\"rows\":[{"),
            "{sql}: {}",
            answer.body
        );
        // The optimiser still sees `power` inside `log` (a wrapper hid it, and rounding made
        // some rows false).
        assert!(
            !answer.body.contains("\"same\":false"),
            "{sql}: {}",
            answer.body
        );
    }
    // An aggregate's result is bounded by the pool while it is built; before anything copies
    // it into rows it must fit a value. Before, this copied 600 KB into every row.
    let answer = server
        .sql(
            b"SELECT count(s) AS n FROM (SELECT (SELECT string_agg(metric, ',') FROM samples) \
              AS s FROM samples)",
        )
        .await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer
            .body
            .contains("an aggregate or window made a value of"),
        "{}",
        answer.body
    );
    // A cast to a fixed-size type makes its width a row, NULL or not: 100 KB × 8,192 rows
    // (answered `200` before; at FixedSizeBinary(2147483647) the allocation aborted).
    let answer = server
        .sql(b"SELECT arrow_cast(NULL, 'FixedSizeBinary(100000)') AS x FROM samples LIMIT 1")
        .await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer.body.contains("a cast makes") || answer.body.contains("writes a literal of"),
        "{}",
        answer.body
    );
    // Accumulating aggregates over a running window: quadratic inside the operator.
    let answer = server
        .sql(b"SELECT string_agg(metric, '') OVER (ORDER BY step) AS s FROM samples")
        .await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer
            .body
            .contains("string_agg is not available as a window function"),
        "{}",
        answer.body
    );
    // Nesting DataFusion builds itself, which no check on the text sees: twenty WITH levels
    // of sixty terms each, merged by the optimiser into one expression 1,200 deep. Before, it
    // overflowed the answering thread's stack and aborted the collector.
    let mut sql =
        String::from("WITH l0 AS (SELECT CAST(step AS VARCHAR) AS s FROM samples LIMIT 3)");
    for i in 1..=20 {
        sql += &format!(
            ", l{i} AS (SELECT s{} AS s FROM l{})",
            " || 'a'".repeat(60),
            i - 1
        );
    }
    sql += " SELECT length(s) AS n FROM l20";
    let answer = server.sql(sql.as_bytes()).await;
    assert!(
        answer.status == 400 || answer.status == 200,
        "an answer, not a dropped connection: {answer:?}"
    );
    // And the collector is still there.
    let answer = server.sql(b"SELECT count(*) AS n FROM samples").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    server.stop().await;
}

/// The soft limit on open files of this process (from /proc).
fn open_file_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_goes_on_beside_two_thousand_idle_sockets_and_hundreds_of_stalled_clients() {
    // Both ends of every socket live in this process: keep well inside its open-file limit.
    let idle_count = 2000.min(open_file_limit() / 3);
    let server = Server::start(|c| {
        c.header_timeout = Duration::from_secs(60);
        c.body_timeout = Duration::from_secs(60);
        // Every client here is one address; this test is of the global bounds (the per-address
        // cap has its own test below).
        c.max_connections_per_peer = 0;
    })
    .await;
    let seed = samples_ipc(&workload("big", 8, 200, 8), false);
    let r = server.ingest(&seed, None).await;
    assert_eq!(r.status, 200, "{r:?}");

    let mut held = Vec::new();
    // Idle: connected, nothing sent.
    for _ in 0..idle_count {
        held.push(server.connect().await);
    }
    // Slowloris: half a request head each.
    for _ in 0..200 {
        let mut s = server.connect().await;
        s.write_all(b"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    // Answers never read.
    for _ in 0..200 {
        let mut s = server.connect().await;
        s.write_all(
            b"GET /api/v1/runs/big/heatmap?metric=spectral.ratio&points=1000 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        )
        .await
        .unwrap();
        held.push(s);
    }
    // Stalled bodies: announced, never sent.
    for _ in 0..100 {
        held.push(stalled_post(&server, "/api/v1/ingest", ARROW, 50_000).await);
    }

    // Meanwhile a writer sends 200 batches, each acknowledged.
    let mut latencies = Vec::new();
    for i in 0..200u64 {
        let rows: Vec<_> = (0..20)
            .map(|j| {
                common::sample(
                    "honest",
                    Some(0),
                    i * 20 + j,
                    "loss",
                    None,
                    None,
                    (i * 20 + j) as f64,
                )
            })
            .collect();
        let body = samples_ipc(&rows, false);
        let started = std::time::Instant::now();
        let answer = server.ingest(&body, Some(&format!("honest/0/s/{i}"))).await;
        latencies.push(started.elapsed());
        assert_eq!(answer.status, 200, "batch {i}: {answer:?}");
    }
    latencies.sort();
    let p = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "ingest beside {} idle, 200 slowloris, 200 unread answers, 100 stalled bodies: p50 {:?}, p99 {:?}, max {:?}",
        idle_count,
        p(0.5),
        p(0.99),
        latencies.last().unwrap()
    );
    // Nothing acknowledged is missing.
    let count = server
        .sql(b"SELECT count(*) AS n, sum(value) AS s FROM samples WHERE run = 'honest'")
        .await;
    assert_eq!(count.status, 200, "{count:?}");
    assert!(count.body.contains("\"n\":4000"), "{count:?}");
    assert!(
        count
            .body
            .contains(&format!("\"s\":{}", (0..4000u64).sum::<u64>())),
        "{count:?}"
    );
    drop(held);
    server.stop().await;
}
