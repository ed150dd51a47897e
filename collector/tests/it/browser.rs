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
