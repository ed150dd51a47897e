//! What a web browser can be made to send, refused.
//!
//! On the default setup — loopback, no tokens — the network location is the only protection,
//! and a browser carries requests across it: any page the user visits can `POST` to
//! `http://127.0.0.1:7070` (a form, or `fetch` in `no-cors` mode, sends a "simple" request
//! without asking first), and a page on a name that the attacker re-points at 127.0.0.1 (DNS
//! rebinding) is even same-origin to the browser. Two checks close this, as Jupyter and the
//! Vite/webpack dev servers do:
//!
//! - **Host**: when the collector listens on loopback, a request naming a `Host` must name a
//!   loopback host (`localhost`, `*.localhost`, `127.x.x.x`, `[::1]`) or one given with
//!   `--allowed-host`. A rebinding page sends its own name and is refused, reads included.
//! - **Origin**: a request that changes state (`POST`, `PUT`, `PATCH`, `DELETE`) and carries
//!   an `Origin` must come from the collector's own origin (the dashboard) or one given with
//!   `--allowed-origin`. Browsers always send `Origin` on such requests; agents, the CLI and
//!   curl send none and are not affected.
//!
//! The state-changing JSON routes also refuse a body that is not `application/json` (415), so a
//! form post cannot reach them, and deletion needs an admin token whenever any token is set
//! (see `auth`).

use std::net::IpAddr;

use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::error::Error;

/// Which hosts and origins a browser's requests may name.
#[derive(Debug, Clone, Default)]
pub struct BrowserPolicy {
    /// Check `Host` against loopback names and `extra_hosts` (the collector listens on
    /// loopback, where rebinding is the threat).
    pub loopback_only: bool,
    /// Host names (without port) accepted besides loopback; checked too when not empty.
    pub extra_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) allowed to change state besides the collector's own.
    pub origins: Vec<String>,
}

impl BrowserPolicy {
    fn check(&self, request: &Request) -> Result<(), Error> {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok());
        if let Some(host) = host
            && (self.loopback_only || !self.extra_hosts.is_empty())
        {
            let name = host_name(host);
            let allowed = (self.loopback_only && is_loopback(name))
                || self
                    .extra_hosts
                    .iter()
                    .any(|h| h.eq_ignore_ascii_case(name));
            if !allowed {
                return Err(Error::Forbidden(format!(
                    "host {host:?} is not one this collector answers to (a guard against DNS \
                     rebinding); reach it as localhost or 127.0.0.1, or start it with \
                     --allowed-host {name}"
                )));
            }
        }
        let changes_state = matches!(
            *request.method(),
            Method::POST | Method::PUT | Method::PATCH | Method::DELETE
        );
        if let Some(origin) = request.headers().get(header::ORIGIN)
            && changes_state
        {
            let origin = origin.to_str().unwrap_or("(not text)");
            let own = host.is_some_and(|h| {
                origin
                    .split_once("://")
                    .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(h))
            });
            if !own && !self.origins.iter().any(|o| o.eq_ignore_ascii_case(origin)) {
                return Err(Error::Forbidden(format!(
                    "{} from the web page origin {origin:?} refused: only the collector's own \
                     dashboard may change state from a browser (or start it with \
                     --allowed-origin {origin})",
                    request.method()
                )));
            }
        }
        Ok(())
    }
}

/// `host[:port]` or `[v6][:port]` without the port and brackets.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    host.rsplit_once(':').map_or(host, |(name, _)| name)
}

fn is_loopback(name: &str) -> bool {
    let name = name.trim_end_matches('.');
    name.eq_ignore_ascii_case("localhost")
        || name.to_ascii_lowercase().ends_with(".localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The middleware over every route.
pub(super) async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    match state.inner.browser.check(&request) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            state.inner.requests.reject(&e);
            e.into_response()
        }
    }
}

/// Refuses a non-empty body that is not JSON: a form post cannot reach a JSON route.
pub(super) fn require_json(headers: &axum::http::HeaderMap, body: &[u8]) -> Result<(), Error> {
    if body.is_empty() {
        return Ok(());
    }
    let value = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let media = crate::decode::media_type(value.unwrap_or(""));
    if media == "application/json" {
        Ok(())
    } else {
        Err(Error::UnsupportedMediaType(if media.is_empty() {
            "(none)".into()
        } else {
            media
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, host: Option<&str>, origin: Option<&str>) -> Request {
        let mut b = Request::builder().method(method).uri("/api/v1/retention");
        if let Some(h) = host {
            b = b.header(header::HOST, h);
        }
        if let Some(o) = origin {
            b = b.header(header::ORIGIN, o);
        }
        b.body(axum::body::Body::empty()).unwrap()
    }

    #[test]
    fn loopback_hosts_pass_and_a_rebinding_name_is_refused() {
        let p = BrowserPolicy {
            loopback_only: true,
            ..Default::default()
        };
        for host in [
            "127.0.0.1:7070",
            "localhost:7070",
            "LOCALHOST",
            "[::1]:7070",
            "app.localhost",
            "127.8.9.1",
        ] {
            assert!(
                p.check(&request(Method::GET, Some(host), None)).is_ok(),
                "{host}"
            );
        }
        for host in [
            "evil.example:7070",
            "10.0.0.1:7070",
            "localhost.evil.example",
            "[::2]:7070",
        ] {
            let e = p
                .check(&request(Method::GET, Some(host), None))
                .unwrap_err();
            assert!(e.to_string().contains("DNS rebinding"), "{e}");
        }
        // No Host at all is not a browser.
        assert!(p.check(&request(Method::GET, None, None)).is_ok());
        let p = BrowserPolicy {
            loopback_only: true,
            extra_hosts: vec!["collector.lan".into()],
            ..Default::default()
        };
        assert!(
            p.check(&request(Method::GET, Some("collector.lan:7070"), None))
                .is_ok()
        );
    }

    #[test]
    fn only_the_own_origin_or_a_listed_one_may_change_state() {
        let p = BrowserPolicy {
            loopback_only: true,
            origins: vec!["https://grafana.lan".into()],
            ..Default::default()
        };
        let host = Some("127.0.0.1:7070");
        assert!(
            p.check(&request(Method::POST, host, Some("http://127.0.0.1:7070")))
                .is_ok()
        );
        assert!(
            p.check(&request(Method::POST, host, Some("https://grafana.lan")))
                .is_ok()
        );
        assert!(
            p.check(&request(Method::POST, host, None)).is_ok(),
            "curl, agents"
        );
        // Reads from any origin stay possible (the browser keeps the answer from the page).
        assert!(
            p.check(&request(Method::GET, host, Some("https://evil.example")))
                .is_ok()
        );
        for origin in ["https://evil.example", "null", "http://127.0.0.1:7071"] {
            for method in [Method::POST, Method::PUT, Method::DELETE, Method::PATCH] {
                let e = p
                    .check(&request(method.clone(), host, Some(origin)))
                    .unwrap_err();
                assert!(e.to_string().contains("refused"), "{e}");
                assert_eq!(e.status(), axum::http::StatusCode::FORBIDDEN);
            }
        }
    }

    #[test]
    fn a_json_route_takes_json_or_nothing() {
        let mut h = axum::http::HeaderMap::new();
        assert!(require_json(&h, b"").is_ok());
        assert!(require_json(&h, b"{}").is_err());
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        let e = require_json(&h, b"{\"max_age\":\"1ms\"}").unwrap_err();
        assert!(e.to_string().contains("\"text/plain\""), "{e}");
        h.insert(
            header::CONTENT_TYPE,
            "application/json; charset=utf-8".parse().unwrap(),
        );
        assert!(require_json(&h, b"{}").is_ok());
    }
}
