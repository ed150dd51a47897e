//! The embedded dashboard: its files are served with their types, any page path gets the app's
//! `index.html` (the browser routes), and the API's own 404s stay JSON. Built with the
//! dashboard (`cargo xtask test` builds it first) these check the real files; a binary built
//! without it must still answer pages with the how-to-build page rather than an error.

use crate::common::*;
use tower::ServiceExt;

#[tokio::test]
async fn pages_files_and_api_404s_are_told_apart() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let built = get(&c, "/rankwatch_web.js").await.status == 200;

    for page in ["/", "/alerts", "/runs/exp.1", "/runs/a-b/layers?metric=x"] {
        let reply = get(&c, page).await;
        assert_eq!(reply.status, 200, "{page}");
        assert!(
            reply.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/html"),
            "{page}"
        );
        if built {
            assert!(reply.text().contains("rankwatch_web.js"), "{page}");
            assert_eq!(reply.headers["cache-control"], "no-cache");
        } else {
            assert!(reply.text().contains("cargo xtask web"), "{page}");
        }
    }
    if built {
        let wasm = get(&c, "/rankwatch_web_bg.wasm").await;
        assert_eq!(wasm.headers["content-type"], "application/wasm");
        assert_eq!(&wasm.body[..4], b"\0asm");
        let js = get(&c, "/uPlot.iife.min.js").await;
        assert!(
            js.headers["content-type"]
                .to_str()
                .unwrap()
                .contains("javascript")
        );
    }
    // Missing assets and unknown API routes are 404s with the API's JSON error.
    for missing in ["/nope.js", "/api/v1/nope", "/api/v2/runs"] {
        let reply = get(&c, missing).await;
        assert_eq!(reply.status, 404, "{missing}");
        assert_eq!(reply.json()["reason"], "not_found", "{missing}");
    }
    // Only GET serves pages.
    let post = post(&c, "/runs/x", "text/plain", None, Vec::new()).await;
    assert_eq!(post.status, 404);
    c.shutdown().await.unwrap();
}

async fn get_encoded(c: &rankwatch_collector::Collector, uri: &str, accept: &str) -> Reply {
    let request = axum::http::Request::get(uri)
        .header("accept-encoding", accept)
        .body(axum::body::Body::empty())
        .unwrap();
    call(c, request).await
}

fn decode(coding: &str, body: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    match coding {
        "br" => {
            brotli::BrotliDecompress(&mut &body[..], &mut out).expect("valid brotli");
        }
        "gzip" => {
            flate2::read::GzDecoder::new(body)
                .read_to_end(&mut out)
                .expect("valid gzip");
        }
        other => panic!("unexpected coding {other}"),
    }
    out
}

#[tokio::test]
async fn a_client_that_accepts_brotli_or_gzip_gets_the_dashboard_and_the_api_compressed() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await;
    let built = get(&c, "/rankwatch_web.js").await.status == 200;
    // The dashboard's files come from their stored copies, the API's JSON is compressed on
    // the way out; both decode to exactly what an identity request gets.
    let mut uris = vec!["/api/v1/openapi.json"];
    if built {
        uris.extend([
            "/rankwatch_web_bg.wasm",
            "/rankwatch_web.js",
            "/runs/x/layers",
        ]);
    }
    for uri in uris {
        let plain = get_encoded(&c, uri, "identity").await;
        assert_eq!(plain.status, 200, "{uri}");
        assert!(plain.headers.get("content-encoding").is_none(), "{uri}");
        for (accept, coding) in [
            ("gzip, deflate, br, zstd", "br"),
            ("gzip", "gzip"),
            ("br;q=0, gzip", "gzip"),
        ] {
            let reply = get_encoded(&c, uri, accept).await;
            assert_eq!(reply.headers["content-encoding"], coding, "{uri} {accept}");
            assert_eq!(
                reply.headers["content-type"], plain.headers["content-type"],
                "{uri}"
            );
            assert!(
                reply.headers["vary"]
                    .to_str()
                    .unwrap()
                    .contains("accept-encoding"),
                "{uri}"
            );
            assert!(reply.body.len() < plain.body.len(), "{uri} {accept}");
            assert_eq!(decode(coding, &reply.body), plain.body, "{uri} {accept}");
        }
    }
    // A small answer is not worth a compressor, nor is a server-sent event stream (it must
    // reach the browser event by event); only the headers of the stream are read here.
    let small = get_encoded(&c, "/healthz", "br").await;
    assert!(small.headers.get("content-encoding").is_none());
    let events = c
        .app()
        .oneshot(
            axum::http::Request::get("/api/v1/events")
                .header("accept-encoding", "br")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    assert!(events.headers().get("content-encoding").is_none());
    drop(events);
    c.shutdown().await.unwrap();
}
