//! One collector per data directory: a second one, in the same process or as a second
//! `rankwatch serve`, is refused with a message naming the holder, and touches nothing (before
//! the lock, it deleted the first one's Parquet parts as leftovers not in its manifest).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use rankwatch_collector::Collector;

#[tokio::test]
async fn a_second_collector_on_the_same_directory_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path()).await;
    ingest_runs(&first, &["held"], 2, 20).await;
    first.flush().await.unwrap();
    let before = files_under(dir.path());
    assert!(
        before
            .iter()
            .any(|(p, _)| p.extension().is_some_and(|e| e == "parquet")),
        "parts were written: {before:?}"
    );

    let refused = Collector::open(&config(dir.path()))
        .await
        .unwrap_err()
        .to_string();
    let pid = format!("pid {}", std::process::id());
    assert!(
        refused.contains("is in use by another collector") && refused.contains(&pid),
        "{refused}"
    );
    assert_eq!(
        files_under(dir.path()),
        before,
        "the refused collector touched nothing"
    );
    let series = get(&first, "/api/v1/runs/held/series?metric=loss&rank=0").await;
    assert_eq!(series.status, 200);

    // Released when the first one ends: the next one opens and has the data.
    first.shutdown().await.unwrap();
    let next = open(dir.path()).await;
    let runs = get(&next, "/api/v1/runs").await.json();
    assert_eq!(runs["runs"][0]["run"], "held", "{runs}");
    next.shutdown().await.unwrap();
}

#[test]
fn a_second_rankwatch_serve_exits_with_a_message_and_the_first_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let serve = |dir: &Path| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_rankwatch"));
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir)
            .env("RANKWATCH_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command.spawn().expect("rankwatch binary starts")
    };
    let mut first = serve(dir.path());
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(first.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let address = line.trim().rsplit(' ').next().unwrap().to_owned();
    assert!(address.starts_with("http://127.0.0.1:"), "{line}");

    let mut second = serve(dir.path());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = second.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            second.kill().unwrap();
            first.kill().unwrap();
            panic!("the second collector kept running beside the first");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    second
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let health = ureq::get(format!("{address}/healthz")).call();
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(!status.success(), "the second collector exits non-zero");
    assert!(
        stderr.contains(&format!(
            "data directory {} is in use by another collector (pid {}",
            dir.path().display(),
            first.id()
        )),
        "{stderr}"
    );
    assert_eq!(health.unwrap().status(), 200, "the first one still serves");
}
