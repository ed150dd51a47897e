//! Typed views of the collector's read API, and the one `fetch` every page goes through.
//! Each struct holds only the fields the pages read; serde skips the rest of an answer.
//!
//! The dashboard does not share Rust types with the collector: the collector's answers are
//! built as JSON there, and the analytics crate that holds the domain types carries Arrow and
//! nalgebra, which would triple the wasm. These structs deserialise exactly the documented
//! shapes (`docs/api.md`); the browser tests are what keep the two sides in step.
//!
//! Every failure becomes an [`ApiError`] whose text is shown to the user as is: the HTTP status
//! and the collector's own `message`, or a plain "cannot reach the collector" when the request
//! never got an answer (the collector restarting, say).

use std::fmt;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;

/// A value that may be a number, `null` or one of the strings `"NaN"`, `"inf"`, `"-inf"` the
/// collector writes for non-finite floats.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Num(pub(crate) Option<f64>);

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f64),
            Text(String),
            Null,
        }
        Ok(Num(match Option::<Raw>::deserialize(d)? {
            Some(Raw::Number(x)) => Some(x),
            Some(Raw::Text(s)) => match s.to_ascii_lowercase().as_str() {
                "nan" => Some(f64::NAN),
                "inf" | "+inf" | "infinity" => Some(f64::INFINITY),
                "-inf" | "-infinity" => Some(f64::NEG_INFINITY),
                _ => None,
            },
            Some(Raw::Null) | None => None,
        }))
    }
}

impl Num {
    /// The value when it is a finite number.
    pub(crate) fn finite(self) -> Option<f64> {
        self.0.filter(|x| x.is_finite())
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct RunsAnswer {
    pub(crate) runs: Vec<RunInfo>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct RunInfo {
    pub(crate) run: String,
    pub(crate) world_size: Option<u32>,
    pub(crate) layers: Option<u32>,
    pub(crate) first_step: Option<i64>,
    pub(crate) last_step: Option<i64>,
    pub(crate) last_seen_ms: Option<i64>,
    pub(crate) alerts_firing: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Catalog {
    pub(crate) metrics: Vec<CatalogMetric>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct CatalogMetric {
    pub(crate) metric: String,
    pub(crate) scope: Option<String>,
    pub(crate) user: bool,
    pub(crate) layers: Vec<i64>,
    pub(crate) sites: Vec<String>,
    pub(crate) ranks: Vec<i64>,
}

impl Catalog {
    pub(crate) fn get(&self, metric: &str) -> Option<&CatalogMetric> {
        self.metrics.iter().find(|m| m.metric == metric)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub(crate) struct Buckets {
    pub(crate) from: i64,
    pub(crate) to: i64,
    pub(crate) width: i64,
    pub(crate) count: i64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Bucket {
    pub(crate) start: i64,
    pub(crate) nonfinite: u64,
    pub(crate) last: Num,
    pub(crate) last_step: i64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Series {
    pub(crate) layer: Option<i64>,
    pub(crate) site: Option<String>,
    pub(crate) rank: Option<i64>,
    pub(crate) buckets: Vec<Bucket>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct SeriesAnswer {
    pub(crate) buckets: Option<Buckets>,
    pub(crate) series: Vec<Series>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Heatmap {
    pub(crate) buckets: Option<Buckets>,
    pub(crate) steps: Vec<i64>,
    pub(crate) layers: Vec<i64>,
    pub(crate) last: Vec<Vec<Num>>,
    pub(crate) count: Vec<Vec<u64>>,
    pub(crate) nonfinite: Vec<Vec<u64>>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Workers {
    pub(crate) step: Option<i64>,
    pub(crate) ranks: Vec<i64>,
    pub(crate) metrics: Vec<WorkerMetric>,
    pub(crate) cosine: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct WorkerMetric {
    pub(crate) metric: String,
    pub(crate) layer: Option<i64>,
    pub(crate) values: Vec<Num>,
}

/// The rank × rank cosine matrix of `/workers`, or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cosine {
    Matrix {
        ranks: Vec<i64>,
        matrix: Vec<Vec<Num>>,
        pair_mean: Num,
    },
    Error(String),
    Missing,
}

impl Workers {
    pub(crate) fn cosine(&self) -> Cosine {
        #[derive(Deserialize)]
        struct Matrix {
            ranks: Vec<i64>,
            matrix: Vec<Vec<Num>>,
            pair_mean: Num,
        }
        match &self.cosine {
            None | Some(serde_json::Value::Null) => Cosine::Missing,
            Some(v) => {
                if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
                    return Cosine::Error(e.to_owned());
                }
                match serde_json::from_value::<Matrix>(v.clone()) {
                    Ok(m) => Cosine::Matrix {
                        ranks: m.ranks,
                        matrix: m.matrix,
                        pair_mean: m.pair_mean,
                    },
                    Err(e) => Cosine::Error(format!("unreadable cosine matrix: {e}")),
                }
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct AlertsAnswer {
    pub(crate) alerts: Vec<Alert>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Alert {
    pub(crate) id: String,
    pub(crate) run: String,
    pub(crate) rule: String,
    pub(crate) severity: String,
    pub(crate) state: String,
    pub(crate) layer: Option<i64>,
    pub(crate) site: Option<String>,
    pub(crate) rank: Option<i64>,
    #[serde(default)]
    pub(crate) outlier_ranks: Vec<i64>,
    pub(crate) value: Num,
    pub(crate) threshold: Num,
    pub(crate) first_step: i64,
    pub(crate) last_step: i64,
    pub(crate) started_at_ms: i64,
    pub(crate) updated_at_ms: i64,
    pub(crate) fired_at_ms: Option<i64>,
    pub(crate) resolved_at_ms: Option<i64>,
    pub(crate) explanation: String,
}

impl Alert {
    /// Alerts that reached `firing` (a pending one that resolved never did).
    pub(crate) fn has_fired(&self) -> bool {
        self.fired_at_ms.is_some()
    }
}

/// `GET /api/v1/rules?run=R`: the rules in force for a run, as plain JSON (the dashboard reads
/// a few thresholds from it to draw healthy bands).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct RulesAnswer {
    pub(crate) rules: serde_json::Value,
}

impl RulesAnswer {
    pub(crate) fn number(&self, rule: &str, key: &str) -> Option<f64> {
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

/// Percent-encodes a query value or path segment.
pub(crate) fn enc(s: &str) -> String {
    String::from(js_sys::encode_uri_component(s))
}

/// `GET path` and parse the JSON answer.
pub(crate) async fn get<T: DeserializeOwned>(path: &str) -> ApiResult<T> {
    let text = get_text(path).await?;
    serde_json::from_str(&text).map_err(|e| ApiError::Unreadable(e.to_string()))
}

async fn get_text(path: &str) -> ApiResult<String> {
    request_text("GET", path, None).await
}

/// `PUT path` with a JSON body and parse the JSON answer.
pub(crate) async fn put<T: DeserializeOwned>(path: &str, body: &serde_json::Value) -> ApiResult<T> {
    let text = request_text("PUT", path, Some(body.to_string())).await?;
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
    let message = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| {
            let text = v.get("error").or_else(|| v.get("message"))?;
            text.as_str().map(str::to_owned)
        })
        .unwrap_or_else(|| body.chars().take(200).collect());
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
    pub(crate) from: Option<i64>,
    pub(crate) to: Option<i64>,
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

/// A run's probe switch (`/api/v1/runs/{run}/probes`): whether an operator wants its dormant
/// agents' probes on; `on` is `None` when nobody set it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct ProbeSwitch {
    pub(crate) on: Option<bool>,
    pub(crate) revision: u64,
}

pub(crate) async fn probe_switch(run: &str) -> ApiResult<ProbeSwitch> {
    get(&format!("/api/v1/runs/{}/probes", enc(run))).await
}

pub(crate) async fn set_probe_switch(run: &str, on: bool) -> ApiResult<ProbeSwitch> {
    put(
        &format!("/api/v1/runs/{}/probes", enc(run)),
        &serde_json::json!({ "on": on }),
    )
    .await
}

pub(crate) async fn runs() -> ApiResult<RunsAnswer> {
    get("/api/v1/runs").await
}

pub(crate) async fn catalog(run: &str) -> ApiResult<Catalog> {
    get(&format!("/api/v1/runs/{}/catalog", enc(run))).await
}

/// Every series of `metric`, optionally narrowed to one layer/site/rank.
pub(crate) async fn series(
    run: &str,
    metric: &str,
    layer: Option<i64>,
    site: Option<&str>,
    rank: Option<i64>,
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

pub(crate) async fn workers(run: &str, step: Option<i64>) -> ApiResult<Workers> {
    let mut path = format!("/api/v1/runs/{}/workers", enc(run));
    if let Some(step) = step {
        path.push_str(&format!("?step={step}"));
    }
    get(&path).await
}

pub(crate) async fn alerts(run: Option<&str>) -> ApiResult<AlertsAnswer> {
    match run {
        Some(run) => get(&format!("/api/v1/alerts?run={}", enc(run))).await,
        None => get("/api/v1/alerts").await,
    }
}

pub(crate) async fn rules(run: &str) -> ApiResult<RulesAnswer> {
    get(&format!("/api/v1/rules?run={}", enc(run))).await
}
