//! What a web browser can be made to send, refused.
//!
//! Without a token the network location is the only protection, and a browser carries
//! requests across it: any page the user visits can `POST` to the collector (a form, or `fetch`
//! in `no-cors` mode, sends a "simple" request without asking first), and a page on a name that
//! the attacker re-points at the collector's address (DNS rebinding) is even same-origin to the
//! browser — it can read every run and delete them. Two checks close this, as Jupyter, Grafana
//! and the Vite/webpack dev servers do:
//!
//! - **Host**: a request that carries none of the collector's tokens must name an allowed
//!   `Host` — a loopback name (`localhost`, `*.localhost`), an IP address, or a name given with
//!   `--allowed-host` — *whatever the address the collector listens on* (before, only on
//!   loopback: the compose deployment, on 0.0.0.0 without tokens, answered `Host: evil.example`
//!   and let a rebinding page delete runs). A rebinding page must use a name; an IP literal
//!   cannot be re-pointed. A request with a valid token is not a browser's doing: browsers never
//!   attach one across sites.
//! - **Origin**: a request that changes state (`POST`, `PUT`, `PATCH`, `DELETE`) and carries an
//!   `Origin` must come from the collector's own origin — the `Host` it names, when that host is
//!   allowed (or the request carries a token) — or one given with `--allowed-origin`. Before,
//!   an Origin equal to any request's Host counted as own, so a rebinding page passed. Browsers
//!   always send `Origin` on such requests; agents, the CLI and curl send none.
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
    /// Host names (without port) accepted besides loopback names and IP addresses.
    pub extra_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) allowed to change state besides the collector's own.
    pub origins: Vec<String>,
}

impl BrowserPolicy {
    /// Whether a request naming `name` (a host without port) may be answered without a token.
    fn host_allowed(&self, name: &str) -> bool {
        is_loopback(name)
            || name.parse::<IpAddr>().is_ok()
            || self
                .extra_hosts
                .iter()
                .any(|h| h.eq_ignore_ascii_case(name.trim_end_matches('.')))
    }

    /// Checks `request`; `has_token` says it carries one of the collector's tokens.
    fn check(&self, request: &Request, has_token: bool) -> Result<(), Error> {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok());
        let allowed = host.is_none_or(|h| self.host_allowed(host_name(h)));
        if let Some(host) = host
            && !allowed
            && !has_token
        {
            let name = host_name(host);
            return Err(Error::Forbidden(format!(
                "host {host:?} is not one this collector answers to without a token (a guard \
                 against DNS rebinding); reach it by localhost or its IP address, or start it \
                 with --allowed-host {name}"
            )));
        }
        let changes_state = matches!(
            *request.method(),
            Method::POST | Method::PUT | Method::PATCH | Method::DELETE
        );
        if let Some(origin) = request.headers().get(header::ORIGIN)
            && changes_state
        {
            let origin = origin.to_str().unwrap_or("(not text)");
            // The dashboard's own origin is the host it was loaded from — an allowed one.
            let own = (allowed || has_token)
                && host.is_some_and(|h| {
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
    let has_token = super::auth::bears_a_token(&state, &request);
    match state.inner.browser.check(&request, has_token) {
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
    fn loopback_names_and_addresses_pass_and_a_rebinding_name_is_refused() {
        let p = BrowserPolicy::default();
        for host in [
            "127.0.0.1:7070",
            "localhost:7070",
            "LOCALHOST",
            "[::1]:7070",
            "app.localhost",
            "127.8.9.1",
            // An address cannot be re-pointed: agents and browsers on the network use these.
            "10.0.0.1:7070",
            "[fd00::5]:7070",
        ] {
            assert!(
                p.check(&request(Method::GET, Some(host), None), false)
                    .is_ok(),
                "{host}"
            );
        }
        for host in [
            "evil.example:7070",
            "localhost.evil.example",
            "collector:7070",
            "10.0.0.1.evil.example",
        ] {
            let e = p
                .check(&request(Method::GET, Some(host), None), false)
                .unwrap_err();
            assert!(e.to_string().contains("DNS rebinding"), "{e}");
            // The same request with a token is not a browser's doing.
            assert!(
                p.check(&request(Method::GET, Some(host), None), true)
                    .is_ok()
            );
        }
        // No Host at all is not a browser.
        assert!(p.check(&request(Method::GET, None, None), false).is_ok());
        let p = BrowserPolicy {
            extra_hosts: vec!["collector".into(), "collector.lan".into()],
            ..Default::default()
        };
        for host in ["collector.lan:7070", "collector:7070", "Collector"] {
            assert!(
                p.check(&request(Method::GET, Some(host), None), false)
                    .is_ok()
            );
        }
    }

    #[test]
    fn a_rebinding_page_cannot_delete_even_with_its_own_origin() {
        // The attack of issue 45: Host evil.example and a matching Origin, no token.
        let p = BrowserPolicy::default();
        let e = p
            .check(
                &request(
                    Method::DELETE,
                    Some("evil.example:7070"),
                    Some("http://evil.example:7070"),
                ),
                false,
            )
            .unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::FORBIDDEN);
    }

    #[test]
    fn only_the_own_origin_or_a_listed_one_may_change_state() {
        let p = BrowserPolicy {
            origins: vec!["https://grafana.lan".into()],
            ..Default::default()
        };
        let host = Some("127.0.0.1:7070");
        assert!(
            p.check(
                &request(Method::POST, host, Some("http://127.0.0.1:7070")),
                false
            )
            .is_ok()
        );
        assert!(
            p.check(
                &request(Method::POST, host, Some("https://grafana.lan")),
                false
            )
            .is_ok()
        );
        assert!(
            p.check(&request(Method::POST, host, None), false).is_ok(),
            "curl, agents"
        );
        // Reads from any origin stay possible (the browser keeps the answer from the page).
        assert!(
            p.check(
                &request(Method::GET, host, Some("https://evil.example")),
                false
            )
            .is_ok()
        );
        for origin in ["https://evil.example", "null", "http://127.0.0.1:7071"] {
            for method in [Method::POST, Method::PUT, Method::DELETE, Method::PATCH] {
                let e = p
                    .check(&request(method.clone(), host, Some(origin)), false)
                    .unwrap_err();
                assert!(e.to_string().contains("refused"), "{e}");
                assert_eq!(e.status(), axum::http::StatusCode::FORBIDDEN);
            }
        }
        // A dashboard reached by a name behind a token: its own origin is the Host it names.
        let named = Some("rankwatch.corp");
        assert!(
            p.check(
                &request(Method::POST, named, Some("https://rankwatch.corp")),
                true
            )
            .is_ok()
        );
        assert!(
            p.check(
                &request(Method::POST, named, Some("https://evil.example")),
                true
            )
            .is_err()
        );
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
