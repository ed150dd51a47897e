//! The collector's read API as the pages call it, and the one `fetch` every page goes through.
//!
//! The answers are the contract's own types (`rankwatch-api`, the crate the collector
//! serialises from), so a field renamed there is a compile error here rather than a page that
//! silently shows nothing. Non-finite floats arrive as [`Num`]; [`NumExt`] reads the nullable
//! ones.
//!
//! Every failure becomes an [`ApiError`] whose text is shown to the user as is: the HTTP status
//! and the collector's own `error` text, or a plain "cannot reach the collector" when the
//! request never got an answer (the collector restarting, say).
//!
//! Identical GETs asked in the same turn of the event loop are one request: the overview's
//! loss and perplexity charts both draw `loss` and refresh on the same live tick, so without
//! this the collector answered the same series twice per refresh.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;

use futures_util::FutureExt;
use futures_util::future::LocalBoxFuture;

use rankwatch_api::ErrorBody;
pub(crate) use rankwatch_api::{
    AckRequest, Alert, Alerts, BucketRange, Catalog, CatalogMetric, ConsistencyReport, Cosine,
    Heatmap, Incident, Incidents, Matchers, NewSilence, Num, ProbeSwitch, RulesAnswer, RunSummary,
    Runs, Series, SeriesAnswer, SetProbes, Silence, Workers,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;

/// Reading the contract's nullable floats.
pub(crate) trait NumExt {
    /// The value, non-finite ones included; `None` when there is none.
    fn value(self) -> Option<f64>;
    /// The value when it is a finite number.
    fn finite(self) -> Option<f64>;
}

impl NumExt for Option<Num> {
    fn value(self) -> Option<f64> {
        self.map(Num::get)
    }

    fn finite(self) -> Option<f64> {
        self.and_then(Num::finite)
    }
}

/// Reading the rules in force (the dashboard reads a few thresholds to draw healthy bands).
pub(crate) trait RulesExt {
    /// `rules[rule][key]` when it is a number.
    fn number(&self, rule: &str, key: &str) -> Option<f64>;
}

impl RulesExt for RulesAnswer {
    fn number(&self, rule: &str, key: &str) -> Option<f64> {
        self.rules.get(rule)?.get(key)?.as_f64()
    }
}

/// Why a request failed, in words for the page.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ApiError {
    /// No answer at all: the collector is down or restarting.
    Unreachable,
    /// 401: a read token is needed (or the one stored is wrong).
    Unauthorized(String),
    /// Any other non-2xx answer, with the collector's message.
    Status(u16, String),
    /// An answer the dashboard cannot read.
    Unreadable(String),
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Unreachable => f.write_str("cannot reach the collector (is it running?)"),
            ApiError::Unauthorized(m) => write!(f, "the collector wants a read token: {m}"),
            ApiError::Status(404, m) => write!(f, "not found: {m}"),
            ApiError::Status(code, m) => write!(f, "the collector answered {code}: {m}"),
            ApiError::Unreadable(m) => write!(f, "unreadable answer from the collector: {m}"),
        }
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

const TOKEN_KEY: &str = "rankwatch.read_token";

fn storage() -> Option<web_sys::Storage> {
    web_sys::window()?.local_storage().ok().flatten()
}

/// The read token the user entered, kept in local storage.
pub(crate) fn read_token() -> Option<String> {
    storage()?
        .get_item(TOKEN_KEY)
        .ok()
        .flatten()
        .filter(|t| !t.is_empty())
}

pub(crate) fn set_read_token(token: &str) {
    if let Some(s) = storage() {
        let _ = if token.is_empty() {
            s.remove_item(TOKEN_KEY)
        } else {
            s.set_item(TOKEN_KEY, token)
        };
    }
}

const USER_KEY: &str = "rankwatch.user";

/// The name this browser acknowledges and silences under (asked once, kept).
pub(crate) fn user_name() -> String {
    storage()
        .and_then(|s| s.get_item(USER_KEY).ok().flatten())
        .filter(|n| !n.trim().is_empty())
        .unwrap_or_else(|| "dashboard".to_owned())
}

pub(crate) fn set_user_name(name: &str) {
    if let Some(s) = storage() {
        let _ = s.set_item(USER_KEY, name.trim());
    }
}

/// Percent-encodes a query value or path segment.
pub(crate) fn enc(s: &str) -> String {
    String::from(js_sys::encode_uri_component(s))
}

/// `GET path` and parse the JSON answer.
pub(crate) async fn get<T: DeserializeOwned>(path: &str) -> ApiResult<T> {
    let text = get_text(path).await?;
    serde_json::from_str(&text).map_err(|e| ApiError::Unreadable(e.to_string()))
}

/// A GET sent in this turn of the event loop, awaited by everyone who asks for the same path
/// before the turn ends.
type Shared = futures_util::future::Shared<LocalBoxFuture<'static, ApiResult<String>>>;

thread_local! {
    static SENT_THIS_TURN: RefCell<HashMap<String, Shared>> = RefCell::new(HashMap::new());
}

/// Only queries made in the same turn share an answer (the charts' effects after one signal
/// change all run in it): a later caller may be asking because the data changed since, so it
/// must not get an answer the collector may have computed before.
async fn get_text(path: &str) -> ApiResult<String> {
    let shared = SENT_THIS_TURN.with_borrow_mut(|sent| {
        if let Some(shared) = sent.get(path) {
            return Some(shared.clone());
        }
        if sent.is_empty() && !forget_at_turn_end() {
            return None;
        }
        let owned = path.to_owned();
        let shared = async move { request_text("GET", &owned, None).await }
            .boxed_local()
            .shared();
        sent.insert(path.to_owned(), shared.clone());
        Some(shared)
    });
    match shared {
        Some(shared) => shared.await,
        None => request_text("GET", path, None).await,
    }
}

/// Empties the map once this turn's tasks and microtasks are done (a zero-delay timeout runs
/// in a later task). False when no timer could be set: nothing is shared then.
fn forget_at_turn_end() -> bool {
    let Some(window) = web_sys::window() else {
        return false;
    };
    let forget = Closure::once_into_js(|| SENT_THIS_TURN.with_borrow_mut(HashMap::clear));
    window
        .set_timeout_with_callback_and_timeout_and_arguments_0(forget.unchecked_ref(), 0)
        .is_ok()
}

/// `PUT path` with a JSON body and parse the JSON answer.
pub(crate) async fn put<T: DeserializeOwned>(path: &str, body: &impl Serialize) -> ApiResult<T> {
    send("PUT", path, Some(body)).await
}

/// A write (`method` with an optional JSON body), and its parsed JSON answer.
async fn send<T: DeserializeOwned>(
    method: &str,
    path: &str,
    body: Option<&impl Serialize>,
) -> ApiResult<T> {
    let body = body
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| ApiError::Unreadable(e.to_string()))?;
    let text = request_text(method, path, body).await?;
    serde_json::from_str(&text).map_err(|e| ApiError::Unreadable(e.to_string()))
}

async fn request_text(method: &str, path: &str, body: Option<String>) -> ApiResult<String> {
    let window = web_sys::window().ok_or(ApiError::Unreachable)?;
    let init = web_sys::RequestInit::new();
    init.set_method(method);
    let headers = web_sys::Headers::new().map_err(|_| ApiError::Unreachable)?;
    if let Some(token) = read_token() {
        let _ = headers.set("authorization", &format!("Bearer {token}"));
    }
    if let Some(body) = body {
        let _ = headers.set("content-type", "application/json");
        init.set_body(&JsValue::from_str(&body));
    }
    init.set_headers(&headers);
    let request = web_sys::Request::new_with_str_and_init(path, &init)
        .map_err(|e| ApiError::Unreadable(describe(&e)))?;
    let response: web_sys::Response = JsFuture::from(window.fetch_with_request(&request))
        .await
        .map_err(|_| ApiError::Unreachable)?
        .dyn_into()
        .map_err(|_| ApiError::Unreachable)?;
    let body = match response.text() {
        Ok(p) => JsFuture::from(p)
            .await
            .ok()
            .and_then(|v| v.as_string())
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    let status = response.status();
    if (200..300).contains(&status) {
        return Ok(body);
    }
    // A proxy's error page is not the contract's body: show its start instead.
    let message = serde_json::from_str::<ErrorBody>(&body)
        .map(|b| b.error)
        .unwrap_or_else(|_| body.chars().take(200).collect());
    Err(match status {
        401 => ApiError::Unauthorized(message),
        // A proxy in front of a restarting collector answers 502/503/504.
        502..=504 if message.is_empty() => ApiError::Unreachable,
        _ => ApiError::Status(status, message),
    })
}

fn describe(v: &JsValue) -> String {
    v.as_string()
        .or_else(|| {
            js_sys::Reflect::get(v, &"message".into())
                .ok()
                .and_then(|m| m.as_string())
        })
        .unwrap_or_else(|| "unknown error".into())
}

/// The step range and resolution of a downsampled query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Window {
    pub(crate) from: Option<u64>,
    pub(crate) to: Option<u64>,
    pub(crate) points: u32,
}

impl Window {
    fn query(&self) -> String {
        let mut q = format!("&points={}", self.points.clamp(1, 10_000));
        if let Some(from) = self.from {
            q.push_str(&format!("&from={from}"));
        }
        if let Some(to) = self.to {
            q.push_str(&format!("&to={to}"));
        }
        q
    }
}

pub(crate) async fn probe_switch(run: &str) -> ApiResult<ProbeSwitch> {
    get(&format!("/api/v1/runs/{}/probes", enc(run))).await
}

pub(crate) async fn set_probe_switch(run: &str, on: bool) -> ApiResult<ProbeSwitch> {
    put(
        &format!("/api/v1/runs/{}/probes", enc(run)),
        &SetProbes { on },
    )
    .await
}

pub(crate) async fn runs() -> ApiResult<Runs> {
    get("/api/v1/runs").await
}

pub(crate) async fn catalog(run: &str) -> ApiResult<Catalog> {
    get(&format!("/api/v1/runs/{}/catalog", enc(run))).await
}

/// Every series of `metric`, optionally narrowed to one layer/site/rank.
pub(crate) async fn series(
    run: &str,
    metric: &str,
    layer: Option<u32>,
    site: Option<&str>,
    rank: Option<u32>,
    window: Window,
) -> ApiResult<SeriesAnswer> {
    let mut path = format!(
        "/api/v1/runs/{}/series?metric={}{}",
        enc(run),
        enc(metric),
        window.query()
    );
    if let Some(layer) = layer {
        path.push_str(&format!("&layer={layer}"));
    }
    if let Some(site) = site {
        path.push_str(&format!("&site={}", enc(site)));
    }
    if let Some(rank) = rank {
        path.push_str(&format!("&rank={rank}"));
    }
    get(&path).await
}

pub(crate) async fn heatmap(
    run: &str,
    metric: &str,
    site: Option<&str>,
    window: Window,
) -> ApiResult<Heatmap> {
    let mut path = format!(
        "/api/v1/runs/{}/heatmap?metric={}{}",
        enc(run),
        enc(metric),
        window.query()
    );
    if let Some(site) = site {
        path.push_str(&format!("&site={}", enc(site)));
    }
    get(&path).await
}

pub(crate) async fn workers(run: &str, step: Option<u64>) -> ApiResult<Workers> {
    let mut path = format!("/api/v1/runs/{}/workers", enc(run));
    if let Some(step) = step {
        path.push_str(&format!("?step={step}"));
    }
    get(&path).await
}

/// The run's worker-level consistency over `from`–`to` (default: the whole run).
pub(crate) async fn consistency(
    run: &str,
    from: Option<u64>,
    to: Option<u64>,
) -> ApiResult<ConsistencyReport> {
    let mut path = format!("/api/v1/runs/{}/consistency", enc(run));
    let range: Vec<String> = [("from", from), ("to", to)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
        .collect();
    if !range.is_empty() {
        path.push_str(&format!("?{}", range.join("&")));
    }
    get(&path).await
}

pub(crate) async fn alerts(run: Option<&str>) -> ApiResult<Alerts> {
    match run {
        Some(run) => get(&format!("/api/v1/alerts?run={}", enc(run))).await,
        None => get("/api/v1/alerts").await,
    }
}

pub(crate) async fn incidents(run: Option<&str>) -> ApiResult<Incidents> {
    match run {
        Some(run) => get(&format!("/api/v1/incidents?run={}", enc(run))).await,
        None => get("/api/v1/incidents").await,
    }
}

pub(crate) async fn acknowledge(id: &str, by: &str) -> ApiResult<Incident> {
    let body = AckRequest {
        by: by.to_owned(),
        comment: String::new(),
    };
    send(
        "POST",
        &format!("/api/v1/incidents/{}/ack", enc(id)),
        Some(&body),
    )
    .await
}

pub(crate) async fn unacknowledge(id: &str) -> ApiResult<Incident> {
    send(
        "DELETE",
        &format!("/api/v1/incidents/{}/ack", enc(id)),
        None::<&()>,
    )
    .await
}

pub(crate) async fn silence(request: &NewSilence) -> ApiResult<Silence> {
    send("POST", "/api/v1/silences", Some(request)).await
}

pub(crate) async fn rules(run: &str) -> ApiResult<RulesAnswer> {
    get(&format!("/api/v1/rules?run={}", enc(run))).await
}
