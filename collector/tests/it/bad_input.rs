//! Bad input gets a 4xx that names the problem, the daemon keeps serving, and nothing already
//! stored changes. The decoder is fuzzed with proptest: random bytes and mutations of valid
//! Arrow IPC streams never panic and never store anything.

use crate::common::*;
use arrow_array::{Float64Array, Int32Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use proptest::prelude::*;
use rankwatch_collector::Collector;
use serde_json::json;
use std::sync::Arc;

async fn stored(c: &Collector) -> serde_json::Value {
    let runs = get(c, "/api/v1/runs").await.json();
    json!([
        runs,
        get(c, "/api/v1/runs/good/series?metric=loss&rank=0")
            .await
            .json()
    ])
}

async fn refuse(
    c: &Collector,
    content_type: &str,
    uri: &str,
    key: Option<&str>,
    body: Vec<u8>,
    status: u16,
    needle: &str,
) {
    let before = stored(c).await;
    let r = post(c, uri, content_type, key, body).await;
    assert_eq!(r.status.as_u16(), status, "{uri}: {}", r.text());
    let message = r.error();
    assert!(
        message.contains(needle),
        "expected {needle:?} in {message:?}"
    );
    assert_eq!(stored(c).await, before, "nothing stored changed");
    assert_eq!(get(c, "/healthz").await.status, 200);
}

#[tokio::test]
async fn each_kind_of_bad_input_is_refused_with_a_message_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.max_body_bytes = 64 * 1024;
    config.max_batch_rows = 1000;
    config.max_series_per_run = 50;
    let c = Collector::open(&config).await.unwrap();
    let good = workload("good", 2, 5, 2);
    assert_eq!(
        post(&c, "/api/v1/ingest", ARROW, None, samples_ipc(&good, false))
            .await
            .status,
        200
    );
    let valid = samples_ipc(&good[..4], false);
    let ingest = "/api/v1/ingest";

    refuse(
        &c,
        ARROW,
        ingest,
        None,
        b"not arrow at all".to_vec(),
        400,
        "malformed arrow ipc",
    )
    .await;
    refuse(
        &c,
        ARROW,
        ingest,
        None,
        valid[..valid.len() / 2].to_vec(),
        400,
        "malformed arrow ipc",
    )
    .await;
    refuse(&c, ARROW, ingest, None, Vec::new(), 400, "arrow").await;
    // Wrong schema: a column missing, a wrong type.
    let wrong = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("run", DataType::Int32, false),
            Field::new("value", DataType::Float64, false),
        ])),
        vec![
            Arc::new(Int32Array::from(vec![1])),
            Arc::new(Float64Array::from(vec![1.0])),
        ],
    )
    .unwrap();
    refuse(
        &c,
        ARROW,
        ingest,
        None,
        ipc(&wrong, false),
        400,
        "table samples",
    )
    .await;
    refuse(
        &c,
        ARROW,
        "/api/v1/ingest?table=sketches",
        None,
        valid.clone(),
        400,
        "table sketches",
    )
    .await;
    refuse(
        &c,
        ARROW,
        "/api/v1/ingest?table=nope",
        None,
        valid.clone(),
        400,
        "unknown table",
    )
    .await;
    refuse(
        &c,
        "text/csv",
        ingest,
        None,
        valid.clone(),
        415,
        "unsupported content type",
    )
    .await;
    // JSON errors name the position or the field.
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        b"{\"run\": \"x\", ".to_vec(),
        400,
        "malformed json body",
    )
    .await;
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        br#"{"run":"x","samples":[{"step":1,"metric":"loss","value":"lots"}]}"#.to_vec(),
        400,
        "samples[0].value: invalid value: string \"lots\", expected a number or one of \"NaN\"",
    )
    .await;
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        br#"{"run":"x","bogus":1}"#.to_vec(),
        400,
        "unknown field `bogus`",
    )
    .await;
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        br#"{"run":"x"}"#.to_vec(),
        400,
        "holds nothing",
    )
    .await;
    // Oversized bodies and batches.
    refuse(
        &c,
        ARROW,
        ingest,
        None,
        vec![0u8; 70 * 1024],
        413,
        "exceeds the limit of 65536 bytes",
    )
    .await;
    let many: Vec<_> = (0..1001)
        .map(|s| sample("good", Some(0), s, "loss", None, None, 1.0))
        .collect();
    refuse(
        &c,
        ARROW,
        ingest,
        None,
        samples_ipc(&many, true),
        413,
        "1001 rows exceeds the limit of 1000",
    )
    .await;
    // Hostile run ids, in the body and in the key.
    for (run, why) in [
        ("../x", "invalid run id"),
        ("", "invalid run id"),
        (&"r".repeat(10_000)[..], "invalid run id"),
    ] {
        let body = json!({"run": run, "samples": [{"rank": 0, "step": 1, "metric": "loss", "value": 1.0}]});
        refuse(
            &c,
            "application/json",
            ingest,
            None,
            body.to_string().into_bytes(),
            400,
            why,
        )
        .await;
    }
    refuse(
        &c,
        ARROW,
        ingest,
        Some("../x/0/s/1"),
        valid.clone(),
        400,
        "Idempotency-Key",
    )
    .await;
    refuse(
        &c,
        ARROW,
        ingest,
        Some("other/0/s/1"),
        valid.clone(),
        400,
        "names run \"other\"",
    )
    .await;
    let r = get(&c, "/api/v1/runs/..%2Fetc/series?metric=loss").await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.error().contains("invalid run id"));
    // A world size the alert engine would have to allocate per step (this aborted the
    // collector: 103 GB for u32::MAX ranks), in either body format.
    let body = json!({"run": "huge", "info": {"world_size": u32::MAX}, "samples": [{"rank": 0, "step": 1, "metric": "loss", "value": 1.0}]});
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        body.to_string().into_bytes(),
        400,
        "world_size 4294967295 is above this collector's limit of 16384 ranks (--max-world-size)",
    )
    .await;
    let mut huge = info("huge", 2, 2);
    huge.world_size = 16_385;
    refuse(
        &c,
        ARROW,
        "/api/v1/ingest?table=runs",
        None,
        ipc(
            &rankwatch_analytics::schema::runs::to_batch(&[huge]).unwrap(),
            false,
        ),
        400,
        "limit of 16384 ranks",
    )
    .await;
    // Unknown metric names and sites.
    let body = json!({"run": "good", "samples": [{"rank": 0, "step": 1, "metric": "spectral.ratoi", "layer": 0, "value": 1.0}]});
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        body.to_string().into_bytes(),
        400,
        "unknown metric",
    )
    .await;
    let body = json!({"run": "good", "samples": [{"rank": 0, "step": 1, "metric": "act_max", "layer": 0, "site": "elbow", "value": 1.0}]});
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        body.to_string().into_bytes(),
        400,
        "unknown site \"elbow\"",
    )
    .await;
    // A flood of distinct series (user scalars, layers) hits the per-run cardinality limit.
    let flood: Vec<_> = (0..100)
        .map(|i| json!({"rank": 0, "step": 1, "metric": format!("user/m{i}"), "value": 1.0}))
        .collect();
    let body = json!({"run": "good", "samples": flood});
    refuse(
        &c,
        "application/json",
        ingest,
        None,
        body.to_string().into_bytes(),
        422,
        "over the limit of 50",
    )
    .await;
    // Bad query parameters.
    for (uri, needle) in [
        (
            "/api/v1/runs/good/series?metric=loss&points=0",
            "points must be between",
        ),
        (
            "/api/v1/runs/good/series?metric=loss&from=9&to=2",
            "from (9) is after to (2)",
        ),
        (
            "/api/v1/runs/good/series?metric=loss&rank=minus",
            "invalid query string",
        ),
        ("/api/v1/runs/good/series", "missing field `metric`"),
        (
            "/api/v1/runs/good/heatmap?metric=act_max&site=elbow",
            "unknown site",
        ),
        ("/api/v1/alerts?state=sleeping", "unknown alert state"),
    ] {
        let r = get(&c, uri).await;
        assert_eq!(r.status, 400, "{uri}: {}", r.text());
        assert!(r.error().contains(needle), "{uri}: {}", r.error());
    }
    assert_eq!(get(&c, "/api/v1/runs/nobody/catalog").await.status, 404);
    // SQL is read-only.
    for sql in [
        "CREATE TABLE t (a INT)",
        "INSERT INTO samples VALUES (1)",
        "DROP TABLE samples",
        "COPY samples TO '/tmp/x.parquet'",
        "SET datafusion.execution.batch_size = 1",
    ] {
        let r = post(
            &c,
            "/api/v1/sql",
            "application/json",
            None,
            json!({ "sql": sql }).to_string().into_bytes(),
        )
        .await;
        assert_eq!(r.status, 400, "{sql}: {}", r.text());
        assert!(r.error().starts_with("sql:"), "{sql}: {}", r.error());
    }
    let r = post(
        &c,
        "/api/v1/sql",
        "application/json",
        None,
        json!({ "sql": "SELECT nope FROM samples" })
            .to_string()
            .into_bytes(),
    )
    .await;
    assert_eq!(r.status, 400);
    // Still serving, data intact.
    assert_eq!(
        get(&c, "/api/v1/runs/good/series?metric=loss&rank=0")
            .await
            .json()["series"][0]["buckets"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn tokens_guard_ingest_and_reads_separately() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.ingest_token = Some("in-secret".into());
    config.read_token = Some("read-secret".into());
    let c = Collector::open(&config).await.unwrap();
    let body = samples_ipc(&workload("t", 1, 2, 1), false);
    let send = |token: Option<&'static str>, uri: &'static str, body: Vec<u8>| {
        let mut r = axum::http::Request::post(uri).header("content-type", ARROW);
        if let Some(t) = token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        r.body(axum::body::Body::from(body)).unwrap()
    };
    assert_eq!(
        call(&c, send(None, "/api/v1/ingest", body.clone()))
            .await
            .status,
        401
    );
    assert_eq!(
        call(
            &c,
            send(Some("read-secret"), "/api/v1/ingest", body.clone())
        )
        .await
        .status,
        401
    );
    assert_eq!(
        call(&c, send(Some("in-secret"), "/api/v1/ingest", body.clone()))
            .await
            .status,
        200
    );
    let read = |token: Option<&str>| {
        let mut r = axum::http::Request::get("/api/v1/runs");
        if let Some(t) = token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        r.body(axum::body::Body::empty()).unwrap()
    };
    assert_eq!(call(&c, read(None)).await.status, 401);
    assert_eq!(call(&c, read(Some("in-secret"))).await.status, 401);
    assert_eq!(call(&c, read(Some("read-secret"))).await.status, 200);
    assert_eq!(get(&c, "/healthz").await.status, 200);
    c.shutdown().await.unwrap();
}

/// With no --queue-wait, a collector at twice its hot budget refuses at once.
#[tokio::test]
async fn over_the_memory_budget_ingest_answers_429_with_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.hot_budget_bytes = 4 * 1024;
    config.queue_wait = std::time::Duration::ZERO;
    let c = Collector::open(&config).await.unwrap();
    let mut statuses = Vec::new();
    for i in 0..20 {
        let r = post(
            &c,
            "/api/v1/ingest",
            ARROW,
            None,
            samples_ipc(&workload("bp", 4, 10 + i, 4), false),
        )
        .await;
        if r.status == 429 {
            assert_eq!(r.headers["retry-after"], "1");
            assert!(r.error().contains("memory budget"));
        }
        statuses.push(r.status.as_u16());
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    c.flush().await.unwrap();
    assert_eq!(
        post(
            &c,
            "/api/v1/ingest",
            ARROW,
            None,
            samples_ipc(&workload("bp", 1, 1, 1), false)
        )
        .await
        .status,
        200
    );
    c.shutdown().await.unwrap();
}

/// With --queue-wait, a batch that finds the hot buffer at twice its budget waits for the
/// flush it asks for instead of being refused: the same 20 batches as above are all stored,
/// and the collector counts the waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_memory_budget_ingest_waits_for_the_flush_that_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.hot_budget_bytes = 4 * 1024;
    config.queue_wait = std::time::Duration::from_secs(30);
    let c = Collector::open(&config).await.unwrap();
    let mut rows = 0;
    for i in 0..20 {
        let workload = workload(&format!("bp{i}"), 4, 10 + i, 4);
        rows += workload.len();
        let r = post(
            &c,
            "/api/v1/ingest",
            ARROW,
            None,
            samples_ipc(&workload, false),
        )
        .await;
        assert_eq!(r.status, 200, "batch {i}: {}", r.text());
    }
    let metrics = get(&c, "/metrics").await.text();
    let counted = |name: &str| metric_value(&metrics, name);
    let waits = counted("rankwatch_hot_buffer_room_waits_total");
    assert!(waits >= 1.0, "{metrics}");
    assert!(counted("rankwatch_flushes_total") >= 1.0, "{metrics}");
    assert_eq!(
        counted("rankwatch_hot_buffer_room_wait_seconds_count"),
        waits
    );
    // Each wait ended with the flush that took the buffer, not at its 30 s --queue-wait (a
    // lost wake-up would still end in a stored batch, only 30 s later).
    let waited = counted("rankwatch_hot_buffer_room_wait_seconds_sum");
    assert!(waited / waits < 5.0, "{waits} waits took {waited} s");
    let stored = sql(&c, "SELECT count(*) AS n FROM samples WHERE run LIKE 'bp%'").await;
    assert_eq!(stored[0]["n"].as_u64(), Some(rows as u64));
    c.shutdown().await.unwrap();
}

/// Offsets of each record-batch body in a stream, with its buffers' (offset, length).
fn batch_bodies(stream: &[u8]) -> Vec<(usize, Vec<(usize, usize)>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 8 <= stream.len() {
        let len = i32::from_le_bytes(stream[at + 4..at + 8].try_into().unwrap()) as usize;
        at += 8;
        if len == 0 {
            break;
        }
        let message = arrow_ipc::root_as_message(&stream[at..at + len]).unwrap();
        at += len;
        if let Some(batch) = message.header_as_record_batch() {
            let buffers = batch
                .buffers()
                .unwrap()
                .iter()
                .map(|b| (b.offset() as usize, b.length() as usize))
                .collect();
            out.push((at, buffers));
        }
        at += message.bodyLength() as usize;
    }
    out
}

#[tokio::test]
async fn lengths_that_would_make_the_decoder_allocate_terabytes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let valid = samples_ipc(&workload("bomb", 2, 3, 2), true);
    let (body, buffers) = batch_bodies(&valid).remove(0);
    // A zstd buffer that claims to decompress to 2^50 bytes.
    let (offset, _) = *buffers.iter().find(|(_, l)| *l >= 8).unwrap();
    let mut bomb = valid.clone();
    bomb[body + offset..body + offset + 8].copy_from_slice(&(1i64 << 50).to_le_bytes());
    let r = post(&c, "/api/v1/ingest", ARROW, None, bomb).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.error().contains("decompress to more than"),
        "{}",
        r.error()
    );
    // A message body that claims to run past the request.
    let mut long = valid.clone();
    long.truncate(body + 16);
    let r = post(&c, "/api/v1/ingest", ARROW, None, long).await;
    assert_eq!(r.status, 400);
    assert!(r.error().contains("runs past the request"), "{}", r.error());
    assert_eq!(get(&c, "/healthz").await.status, 200);
    c.shutdown().await.unwrap();
}

fn fuzz_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Mutated and truncated valid streams, and random bytes: the decoder answers with an
    /// error or a valid batch, never a panic; and when it errs nothing is stored.
    #[test]
    fn the_ingest_decoder_survives_hostile_bytes(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
        noise in proptest::collection::vec(any::<u8>(), 0..512),
        use_noise in any::<bool>(),
    ) {
        let valid = samples_ipc(&workload("fz", 2, 3, 2), cut.index(2) == 1);
        let body = if use_noise {
            noise
        } else {
            let mut b = valid.clone();
            for (i, x) in &flips {
                let i = i.index(b.len());
                b[i] ^= x;
            }
            b.truncate(cut.index(b.len()) + 1);
            b
        };
        let known = |_: &rankwatch_analytics::RunId| None;
        let limits = rankwatch_collector::decode::Limits { max_rows: 10_000, max_world_size: 1024 };
        let _ = rankwatch_collector::decode::decode_arrow(&body, rankwatch_collector::decode::Table::Samples, limits, &known);
        let _ = rankwatch_collector::decode::decode_arrow(&body, rankwatch_collector::decode::Table::Sketches, limits, &known);
        let _ = rankwatch_collector::decode::decode_json(&body, limits, 0, &known);
        let _ = rankwatch_collector::decode::decode_entry(&body);
        // Through the whole router too: a 4xx, or a 200 for a still-valid stream.
        let rt = fuzz_runtime();
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let c = open(dir.path()).await;
            let r = post(&c, "/api/v1/ingest", ARROW, None, body).await;
            prop_assert!(r.status == 200 || r.status.is_client_error(), "{}", r.status);
            let runs = get(&c, "/api/v1/runs").await.json();
            if r.status != 200 {
                prop_assert_eq!(runs["runs"].as_array().unwrap().len(), 0);
            }
            c.shutdown().await.unwrap();
            Ok(())
        })?;
    }
}

async fn put_probes(c: &Collector, run: &str, body: &str) -> Reply {
    let request = axum::http::Request::put(format!("/api/v1/runs/{run}/probes"))
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_owned()))
        .unwrap();
    call(c, request).await
}

#[tokio::test]
async fn a_probe_switch_takes_only_on_or_off_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let c = Collector::open(&config(dir.path())).await.unwrap();
        let unset = get(&c, "/api/v1/runs/job-1/probes").await;
        assert_eq!(unset.status, 200);
        assert_eq!(
            (unset.json()["on"].clone(), unset.json()["revision"].clone()),
            (json!(null), json!(0))
        );
        for (body, needle) in [
            ("{}", "missing field `on`"),
            (r#"{"on": "yes"}"#, "expected {\"on\": true|false}"),
            (r#"{"on": true, "extra": 1}"#, "unknown field `extra`"),
            ("not json", "expected {\"on\": true|false}"),
        ] {
            let r = put_probes(&c, "job-1", body).await;
            assert_eq!(r.status.as_u16(), 400, "{body}: {}", r.text());
            assert!(r.error().contains(needle), "{body}: {}", r.error());
        }
        let r = put_probes(&c, "bad%20run!", r#"{"on": true}"#).await;
        assert_eq!(r.status.as_u16(), 400, "{}", r.text());
        let on = put_probes(&c, "job-1", r#"{"on": true}"#).await.json();
        assert_eq!(
            (on["on"].clone(), on["revision"].clone()),
            (json!(true), json!(1))
        );
        let off = put_probes(&c, "job-1", r#"{"on": false}"#).await.json();
        assert_eq!(
            (off["on"].clone(), off["revision"].clone()),
            (json!(false), json!(2))
        );
        c.shutdown().await.unwrap();
    }
    let c = Collector::open(&config(dir.path())).await.unwrap();
    let kept = get(&c, "/api/v1/runs/job-1/probes").await.json();
    assert_eq!(
        (kept["on"].clone(), kept["revision"].clone()),
        (json!(false), json!(2))
    );
}

#[tokio::test]
async fn a_run_id_differing_from_an_existing_one_only_in_case_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    ingest_runs(&c, &["Run-1"], 1, 2).await;
    let body = samples_ipc(&workload("run-1", 1, 2, 1), false);
    let r = post(&c, "/api/v1/ingest", ARROW, None, body).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.error().contains("\"run-1\"")
            && r.error().contains("\"Run-1\"")
            && r.error().contains("case"),
        "{}",
        r.error()
    );
    // The same run again, and an unrelated one, are fine.
    ingest_runs(&c, &["Run-1", "run-2"], 1, 2).await;
    assert_eq!(run_names(&c).await, ["Run-1", "run-2"]);
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_batch_of_another_wire_protocol_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let c = Collector::open(&config(dir.path())).await.unwrap();
    let body = samples_ipc(&workload("versions", 1, 2, 1), false);
    let send = |protocol: Option<String>| {
        let mut request = axum::http::Request::post("/api/v1/ingest")
            .header("content-type", ARROW)
            .header(rankwatch_api::VERSION_HEADER, "9.0.0");
        if let Some(p) = protocol {
            request = request.header(rankwatch_api::PROTOCOL_HEADER, p);
        }
        call(
            &c,
            request.body(axum::body::Body::from(body.clone())).unwrap(),
        )
    };
    let other = send(Some((rankwatch_api::WIRE_PROTOCOL + 1).to_string())).await;
    assert_eq!(other.status, 400, "{}", other.text());
    assert_eq!(other.json()["reason"], "incompatible_version");
    let message = other.error();
    for needle in [
        "agent rankwatch 9.0.0".to_owned(),
        format!("this collector (rankwatch {})", rankwatch_api::VERSION),
        format!("wire protocol {}", rankwatch_api::WIRE_PROTOCOL + 1),
        "rankwatch sync".to_owned(),
    ] {
        assert!(message.contains(&needle), "{needle:?} not in {message:?}");
    }
    assert_eq!(get(&c, "/api/v1/runs").await.json()["runs"], json!([]));
    let garbled = send(Some("two".into())).await;
    assert_eq!(garbled.status, 400);
    assert!(garbled.error().contains("\"two\""), "{}", garbled.error());
    // The same release number is not required: the protocol is what must agree.
    assert_eq!(
        send(Some(rankwatch_api::WIRE_PROTOCOL.to_string()))
            .await
            .status,
        200
    );
    assert_eq!(send(None).await.status, 200);
}

/// Issue 45's series-cap race: the cap was checked against the series already applied, and a
/// batch's series are applied only after its fsync, so batches in flight together each passed
/// and a run reached many times its cap. Now the new series of admitted batches are reserved:
/// 16 concurrent batches of 5 new series each against a cap of 10 store at most 10 series, and
/// the rest are refused with 422 naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_batches_cannot_take_a_run_past_its_series_cap() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.no_alert_engine = true;
    config.max_series_per_run = 10;
    let c = Collector::open(&config).await.unwrap();
    let bodies: Vec<Vec<u8>> = (0..16u32)
        .map(|b| {
            let rows: Vec<_> = (0..5u32)
                .map(|r| sample("capped", Some(b * 5 + r), 0, "loss", None, None, 1.0))
                .collect();
            samples_ipc(&rows, false)
        })
        .collect();
    let replies = futures_util::future::join_all(
        bodies
            .into_iter()
            .map(|body| post(&c, "/api/v1/ingest", ARROW, None, body)),
    )
    .await;
    let accepted = replies.iter().filter(|r| r.status == 200).count();
    for r in replies.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 422, "{}", r.text());
        assert!(r.error().contains("over the limit of 10"), "{}", r.error());
    }
    let runs = get(&c, "/api/v1/runs").await.json();
    let series = runs["runs"][0]["series"].as_u64().unwrap();
    assert!(
        series <= 10,
        "{series} series stored, {accepted} batches accepted"
    );
    assert_eq!(series, accepted as u64 * 5);
    assert!(accepted >= 1);
    c.shutdown().await.unwrap();
}

/// Issue 45's unlimited runs: a million one-row runs were accepted, each costing a summary,
/// files per flush and a branch in every SQL query. Now a collector keeps at most `--max-runs`
/// (100,000 by default); a new run beyond it — concurrent first batches included — is refused
/// with 422 naming the flag, known runs still write, and a deleted run makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_collector_keeps_at_most_max_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.no_alert_engine = true;
    config.max_runs = 3;
    let c = Collector::open(&config).await.unwrap();
    let body = |run: &str, step: u64| {
        samples_ipc(
            &[sample(run, Some(0), step, "loss", None, None, 1.0)],
            false,
        )
    };
    let names: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
    let replies = futures_util::future::join_all(
        names
            .iter()
            .map(|run| post(&c, "/api/v1/ingest", ARROW, None, body(run, 0))),
    )
    .await;
    let accepted = replies.iter().filter(|r| r.status == 200).count();
    assert_eq!(
        accepted,
        3,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let refused = replies.iter().find(|r| r.status != 200).unwrap();
    assert_eq!(refused.status, 422);
    assert!(
        refused.error().contains("--max-runs 3"),
        "{}",
        refused.error()
    );
    let runs = get(&c, "/api/v1/runs").await.json();
    let kept: Vec<String> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kept.len(), 3);
    // A known run still writes; a deleted one makes room for a new one.
    let r = post(&c, "/api/v1/ingest", ARROW, None, body(&kept[0], 1)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("late", 0)).await;
    assert_eq!(r.status, 422);
    let deleted = call(
        &c,
        axum::http::Request::delete(format!("/api/v1/runs/{}", kept[1]))
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("late", 0)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    c.shutdown().await.unwrap();
}

/// Issue 45's global limits: every run's series index lives in memory, and the per-run cap
/// times the run cap is a billion series. `--max-series` bounds them over all runs: a batch
/// that would pass it is refused with 422 naming the flag, a batch adding no new series still
/// writes, and a deleted run gives its series back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_collector_keeps_at_most_max_series_over_all_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.no_alert_engine = true;
    config.max_series = 10;
    let c = Collector::open(&config).await.unwrap();
    // Six series a run: (loss, ranks 0..6).
    let body = |run: &str, step: u64| {
        let rows: Vec<_> = (0..6)
            .map(|rank| sample(run, Some(rank), step, "loss", None, None, 1.0))
            .collect();
        samples_ipc(&rows, false)
    };
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("first", 0)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("second", 0)).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(
        r.error().contains("--max-series") && r.error().contains("12 series"),
        "{}",
        r.error()
    );
    // The first run's known series still write.
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("first", 1)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let deleted = call(
        &c,
        axum::http::Request::delete("/api/v1/runs/first")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("second", 0)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    c.shutdown().await.unwrap();

    // After a restart the index is rebuilt from Parquet and counted again.
    let c = Collector::open(&config).await.unwrap();
    let r = post(&c, "/api/v1/ingest", ARROW, None, body("third", 0)).await;
    assert_eq!(r.status, 422, "{}", r.text());
    c.shutdown().await.unwrap();
}
