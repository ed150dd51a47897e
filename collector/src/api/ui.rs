//! The web dashboard, embedded in the binary: `web/dist` (built by `cargo xtask web`) is
//! compiled in, so `rankwatch serve` alone serves the full UI with no other server.
//!
//! Every GET that no API route answers lands here. A file of the dashboard is served as is;
//! any other path outside `/api/` gets `index.html`, because the dashboard routes in the
//! browser (`/runs/demo/layers` is a page, not a file). Unknown `/api/` paths keep their JSON
//! 404. A binary built before the dashboard was gets a page that says how to build it, rather
//! than a blank one. Responses say `no-cache`: the files are small, and a browser must never
//! pair a new `index.html` with an old wasm module after an upgrade. Text assets are stored
//! compressed too (`file.br`, `file.gz`, written once by `cargo xtask web`): a browser that
//! accepts Brotli gets the 1.6 MB module in about a quarter of that, at no cost per request.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
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

/// The encodings a dashboard file may be stored in beside itself (`cargo xtask web` writes
/// them), best first, with the suffix of the stored copy.
const STORED_ENCODINGS: [(&str, &str); 2] = [("br", "br"), ("gzip", "gz")];

/// Whether `accept` (an `Accept-Encoding` value) allows `coding`: named, or `*`, with a
/// non-zero q-value (RFC 9110 § 12.5.3; `br;q=0` refuses Brotli).
fn accepts(accept: &str, coding: &str) -> bool {
    let mut named = None;
    let mut wildcard = None;
    for item in accept.split(',') {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or("").trim();
        let q = parts
            .find_map(|p| p.trim().strip_prefix("q=").map(str::to_owned))
            .map_or(1.0, |q| q.trim().parse::<f32>().unwrap_or(0.0));
        if name.eq_ignore_ascii_case(coding) {
            named = Some(q > 0.0);
        } else if name == "*" {
            wildcard = Some(q > 0.0);
        }
    }
    named.or(wildcard).unwrap_or(false)
}

fn file(path: &str, accept_encoding: &str) -> Option<Response> {
    let asset = Dashboard::get(path)?;
    let mime = mime_guess::from_path(path).first_or_octet_stream();
    // The smallest stored copy the browser takes (Brotli, then gzip), else the file itself.
    let (data, encoding) = STORED_ENCODINGS
        .iter()
        .filter(|(coding, _)| accepts(accept_encoding, coding))
        .find_map(|(coding, suffix)| {
            Dashboard::get(&format!("{path}.{suffix}")).map(|c| (c.data, Some(*coding)))
        })
        .unwrap_or((asset.data, None));
    // Embedded files are `'static`: the body borrows them, no copy per request.
    let mut response = (
        [(header::CONTENT_TYPE, mime.as_ref().to_owned())],
        Body::from(data),
    )
        .into_response();
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if let Some(coding) = encoding {
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding));
    }
    Some(response)
}

/// The router's fallback: dashboard files and pages, or the API's 404.
pub(super) async fn fallback(method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let path = uri.path();
    let accept_encoding = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if path.starts_with("/api/") || path == "/metrics" {
        return Error::NotFound.into_response();
    }
    if method != Method::GET && method != Method::HEAD {
        return Error::NotFound.into_response();
    }
    let relative = path.trim_start_matches('/');
    if !relative.is_empty()
        && let Some(response) = file(relative, accept_encoding)
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
    file("index.html", accept_encoding)
        .unwrap_or_else(|| (StatusCode::OK, Html(NOT_BUILT)).into_response())
}

#[cfg(test)]
mod tests {
    use super::accepts;

    #[test]
    fn accept_encoding_is_read_with_its_q_values() {
        let browser = "gzip, deflate, br, zstd";
        assert!(accepts(browser, "br") && accepts(browser, "gzip"));
        assert!(!accepts("gzip", "br"));
        assert!(!accepts("br;q=0, gzip", "br") && accepts("br;q=0, gzip", "gzip"));
        assert!(accepts("BR;q=0.5", "br"));
        assert!(accepts("*", "br") && !accepts("*, br;q=0", "br"));
        assert!(!accepts("", "gzip") && !accepts("identity", "gzip"));
        assert!(!accepts("gzip;q=nonsense", "gzip"));
    }
}
