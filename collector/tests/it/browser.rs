//! What a web page could make the user's browser send to a tokenless loopback collector is
//! refused, and nothing is deleted: a `text/plain` form post to retention (before: 200, every
//! run deleted, one written a second earlier included), a cross-origin delete, a request under
//! a rebound host name. The dashboard's own requests and the agents' still pass. Deletion
//! needs an admin token once any token is set.

use axum::body::Body;
use axum::http::Request;

use crate::common::*;
use rankwatch_collector::Collector;

const HOST: &str = "127.0.0.1:7070";

async fn send(
    c: &Collector,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", HOST);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    call(c, request.body(Body::from(body.to_owned())).unwrap()).await
}

#[tokio::test]
async fn a_foreign_page_cannot_delete_runs_or_read_through_a_rebound_name() {
    let dir = tempfile::tempdir().unwrap();
    let c = open_store_only(dir.path()).await;
    ingest_runs(&c, &["kept-a", "kept-b"], 1, 3).await;
    let before = run_names(&c).await;
    assert_eq!(before.len(), 2);
    let wipe = r#"{"max_age":"1ms"}"#;

    // The form post of the report: text/plain, from another site.
    let r = send(
        &c,
        "POST",
        "/api/v1/retention",
        &[
            ("content-type", "text/plain"),
            ("origin", "https://evil.example"),
        ],
        wipe,
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["reason"], "forbidden");
    assert!(
        r.error().contains("\"https://evil.example\" refused"),
        "{}",
        r.error()
    );
    // The same body as text/plain without an Origin (not a browser, but not JSON either).
    let r = send(
        &c,
        "POST",
        "/api/v1/retention",
        &[("content-type", "text/plain")],
        wipe,
    )
    .await;
    assert_eq!(r.status, 415, "{}", r.text());
    assert!(r.error().contains("\"text/plain\""), "{}", r.error());
    // A cross-origin delete, a probe switch, a rule override.
    let r = send(
        &c,
        "DELETE",
        "/api/v1/runs/kept-a",
        &[("origin", "https://evil.example")],
        "",
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = send(
        &c,
        "PUT",
        "/api/v1/runs/kept-a/probes",
        &[("content-type", "application/json"), ("origin", "null")],
        r#"{"on":true}"#,
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    // DNS rebinding: the page's own name in Host, same-origin to the browser.
    let mut request = Request::get("/api/v1/runs").header("host", "evil.example:7070");
    request = request.header("origin", "http://evil.example:7070");
    let r = call(&c, request.body(Body::empty()).unwrap()).await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.error().contains("DNS rebinding"), "{}", r.error());
    assert_eq!(run_names(&c).await, before, "nothing was deleted");

    // The dashboard (same origin) and the CLI (no Origin) still work; a fresh run is spared
    // by a 1 ms age: it is inside the active window.
    let r = send(
        &c,
        "PUT",
        "/api/v1/runs/kept-a/probes",
        &[
            ("content-type", "application/json"),
            ("origin", "http://127.0.0.1:7070"),
        ],
        r#"{"on":true}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = send(
        &c,
        "POST",
        "/api/v1/retention",
        &[("content-type", "application/json")],
        wipe,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["deleted"],
        serde_json::json!([]),
        "active runs are not retention's to delete"
    );
    let r = send(&c, "DELETE", "/api/v1/runs/kept-a", &[], "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(run_names(&c).await, ["kept-b"]);
    c.shutdown().await.unwrap();
}

#[tokio::test]
async fn with_tokens_but_no_admin_token_deletion_is_refused_even_with_the_ingest_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.no_alert_engine = true;
    config.ingest_token = Some("in".into());
    let c = Collector::open(&config).await.unwrap();
    let mut request = Request::post("/api/v1/ingest")
        .header("content-type", ARROW)
        .header("authorization", "Bearer in");
    request = request.header("host", HOST);
    let r = call(
        &c,
        request
            .body(Body::from(samples_ipc(&workload("t", 1, 3, 1), false)))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = send(
        &c,
        "DELETE",
        "/api/v1/runs/t",
        &[("authorization", "Bearer in")],
        "",
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.error().contains("--admin-token"), "{}", r.error());
    let r = send(
        &c,
        "POST",
        "/api/v1/retention",
        &[
            ("authorization", "Bearer in"),
            ("content-type", "application/json"),
        ],
        r#"{"max_age":"1d"}"#,
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(run_names(&c).await, ["t"]);
    c.shutdown().await.unwrap();
}

/// Issue 45's attack on the compose deployment: listening on 0.0.0.0 without tokens
/// (`RANKWATCH_INSECURE=true`), a page on a rebound name — its own name in Host and a matching
/// Origin — read the runs (200) and deleted one (200). The Host allow-list now holds whatever
/// the listen address; loopback names and any IP address still pass, a name only when allowed
/// (the compose file passes `--allowed-host collector`), and so does a request with a token.
#[tokio::test]
async fn on_every_interface_without_tokens_a_rebound_name_can_neither_read_nor_delete() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.no_alert_engine = true;
    config.listen = "0.0.0.0:7070".parse().unwrap();
    config.insecure = true;
    let c = Collector::open(&config).await.unwrap();
    ingest_runs(&c, &["demo", "kept"], 1, 3).await;
    let rebound = |method: &str, uri: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("host", "evil.example:7070")
            .header("origin", "http://evil.example:7070")
            .body(Body::empty())
            .unwrap()
    };
    let r = call(&c, rebound("GET", "/api/v1/runs")).await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.error().contains("--allowed-host evil.example"),
        "{}",
        r.error()
    );
    let r = call(&c, rebound("DELETE", "/api/v1/runs/demo")).await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = call(&c, rebound("GET", "/runs/demo")).await;
    assert_eq!(r.status, 403, "the dashboard's pages too: {}", r.text());
    assert_eq!(run_names(&c).await, ["demo", "kept"], "nothing was deleted");
    // Agents post to an address, the published port is 127.0.0.1:7070; a name needs allowing.
    let runs = |host: &str| {
        Request::get("/api/v1/runs")
            .header("host", host)
            .body(Body::empty())
            .unwrap()
    };
    for host in ["10.1.2.3:7070", "127.0.0.1:7070", "localhost:7070"] {
        let r = call(&c, runs(host)).await;
        assert_eq!(r.status, 200, "{host}: {}", r.text());
    }
    let r = call(&c, runs("collector:7070")).await;
    assert_eq!(r.status, 403, "{}", r.text());
    c.shutdown().await.unwrap();
    // As the compose file starts it: Prometheus scrapes `collector:7070`.
    let dir = tempfile::tempdir().unwrap();
    config.data_dir = dir.path().to_owned();
    config.allowed_hosts = vec!["collector".into()];
    let c = Collector::open(&config).await.unwrap();
    assert_eq!(call(&c, runs("collector:7070")).await.status, 200);
    assert_eq!(call(&c, runs("evil.example:7070")).await.status, 403);
    c.shutdown().await.unwrap();

    // With a read token, a request bearing it may name any host (a proxy's name, say).
    let dir = tempfile::tempdir().unwrap();
    let mut config = self::config(dir.path());
    config.no_alert_engine = true;
    config.listen = "0.0.0.0:7070".parse().unwrap();
    config.read_token = Some("r".into());
    config.ingest_token = Some("i".into());
    let c = Collector::open(&config).await.unwrap();
    let request = |token: Option<&str>| {
        let mut b = Request::get("/api/v1/runs").header("host", "rankwatch.corp");
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        b.body(Body::empty()).unwrap()
    };
    assert_eq!(call(&c, request(Some("r"))).await.status, 200);
    assert_eq!(call(&c, request(None)).await.status, 403);
    c.shutdown().await.unwrap();
}
