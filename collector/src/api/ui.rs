//! The web dashboard, embedded in the binary: `web/dist` (built by `cargo xtask web`) is
//! compiled in, so `rankwatch serve` alone serves the full UI with no other server.
//!
//! Every GET that no API route answers lands here. A file of the dashboard is served as is;
//! any other path outside `/api/` gets `index.html`, because the dashboard routes in the
//! browser (`/runs/demo/layers` is a page, not a file). Unknown `/api/` paths keep their JSON
//! 404. A binary built before the dashboard was gets a page that says how to build it, rather
//! than a blank one. Responses say `no-cache`: the files are small, and a browser must never
//! pair a new `index.html` with an old wasm module after an upgrade.

use axum::body::Body;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{Html, IntoResponse, Response};
use rust_embed::Embed;

use crate::error::Error;

#[derive(Embed)]
#[folder = "../web/dist"]
#[allow_missing = true]
struct Dashboard;

const NOT_BUILT: &str = "<!doctype html><meta charset=utf-8><title>rankwatch</title>\
<h1>rankwatch</h1><p>The dashboard was not built into this binary. Run <code>cargo xtask web</code> \
and build the collector again (or use <code>cargo xtask demo</code>, which does both). The API \
is served as usual under <a href=\"/api/v1/openapi.json\">/api/v1/</a>.</p>";

/// Whether the binary carries the dashboard.
pub(crate) fn built() -> bool {
    Dashboard::get("index.html").is_some()
}

fn file(path: &str) -> Option<Response> {
    let asset = Dashboard::get(path)?;
    let mime = mime_guess::from_path(path).first_or_octet_stream();
    // Embedded files are `'static`: the body borrows them, no copy per request.
    let mut response = (
        [(header::CONTENT_TYPE, mime.as_ref().to_owned())],
        Body::from(asset.data),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Some(response)
}

/// The router's fallback: dashboard files and pages, or the API's 404.
pub(super) async fn fallback(method: Method, uri: Uri) -> Response {
    let path = uri.path();
    if path.starts_with("/api/") || path == "/metrics" {
        return Error::NotFound.into_response();
    }
    if method != Method::GET && method != Method::HEAD {
        return Error::NotFound.into_response();
    }
    let relative = path.trim_start_matches('/');
    if !relative.is_empty()
        && let Some(response) = file(relative)
    {
        return response;
    }
    // A missing asset is a real 404; anything else is a page (run ids may hold dots:
    // `/runs/exp.1` is a page, so only the dashboard's own file types count as assets).
    let extension = relative.rsplit_once('.').map(|(_, ext)| ext).unwrap_or("");
    if matches!(
        extension,
        "js" | "wasm" | "css" | "map" | "png" | "svg" | "ico"
    ) {
        return Error::NotFound.into_response();
    }
    file("index.html").unwrap_or_else(|| (StatusCode::OK, Html(NOT_BUILT)).into_response())
}
