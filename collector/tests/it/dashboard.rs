//! The embedded dashboard: its files are served with their types, any page path gets the app's
//! `index.html` (the browser routes), and the API's own 404s stay JSON. Built with the
//! dashboard (`cargo xtask test` builds it first) these check the real files; a binary built
//! without it must still answer pages with the how-to-build page rather than an error.

use crate::common::*;

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
