//! The pages, and what they share: the run's tab bar, the zoom window and selected step that
//! every chart of a page follows, error boxes, and the metric chart that fetches its own data.

pub(crate) mod alerts;
pub(crate) mod consistency;
pub(crate) mod layers;
pub(crate) mod overview;
pub(crate) mod runs;
pub(crate) mod workers;

use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::{use_params_map, use_query_map};

use crate::api::{self, Alerts as AlertsAnswer, ApiError, SeriesAnswer, Window};
use crate::chart::{Chart, ChartSpec, Level, LineStyle, mean_style, rank_style};
use crate::fetch::{Fetched, TokenWanted, error_of, fetched};
use crate::live::Live;

/// The `:run` of the current route.
pub(crate) fn run_param() -> Memo<String> {
    let params = use_params_map();
    Memo::new(move |_| params.with(|p| p.get("run").unwrap_or_default()))
}

/// A numeric query parameter of the current URL (`None` when absent or not a number).
pub(crate) fn query_int<T>(name: &'static str) -> Memo<Option<T>>
where
    T: std::str::FromStr + Clone + PartialEq + Send + Sync + 'static,
{
    let query = use_query_map();
    Memo::new(move |_| query.with(|q| q.get(name).and_then(|v| v.parse().ok())))
}

/// A run's live revision: changes when the run gets new samples.
pub(crate) fn run_revision(run: Memo<String>) -> Memo<u64> {
    let live = expect_context::<Live>();
    Memo::new(move |_| run.with(|r| live.run_revision(r)))
}

/// What every chart of a run page follows: the zoom window, the selected step, the run's
/// alerts and incidents (the charts' bands) and its live revision.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunView {
    pub(crate) run: Memo<String>,
    /// `None` bounds follow the run's first and last step (and so grow live).
    pub(crate) window: RwSignal<(Option<u64>, Option<u64>)>,
    pub(crate) selected: RwSignal<Option<u64>>,
    pub(crate) alerts: Fetched<AlertsAnswer>,
    pub(crate) incidents: Fetched<api::Incidents>,
    pub(crate) revision: Memo<u64>,
}

impl RunView {
    /// Reads `from`, `to` and `step` from the URL, so links (from an alert, say) land zoomed.
    pub(crate) fn new() -> RunView {
        let run = run_param();
        let live = expect_context::<Live>();
        let from = query_int("from");
        let to = query_int("to");
        let step = query_int("step");
        let window = RwSignal::new((from.get_untracked(), to.get_untracked()));
        let selected = RwSignal::new(step.get_untracked());
        let revision = run_revision(run);
        let alerts = fetched(move || {
            let run = run.get();
            live.alerts.track();
            Some(async move { api::alerts(Some(&run)).await })
        });
        let incidents = fetched(move || {
            let run = run.get();
            live.alerts.track();
            Some(async move { api::incidents(Some(&run)).await })
        });
        RunView {
            run,
            window,
            selected,
            alerts,
            incidents,
            revision,
        }
    }

    pub(crate) fn query_window(&self, points: u32) -> Window {
        let (from, to) = self.window.get();
        Window { from, to, points }
    }

    pub(crate) fn zoom(&self) -> Callback<(u64, u64)> {
        let window = self.window;
        Callback::new(move |(a, b): (u64, u64)| {
            if b > a {
                window.set((Some(a), Some(b)));
            }
        })
    }

    pub(crate) fn pick(&self) -> Callback<u64> {
        let selected = self.selected;
        Callback::new(move |s| selected.set(Some(s)))
    }
}

/// How many buckets to ask for: about one per horizontal pixel, at most 1,000.
pub(crate) fn points() -> u32 {
    let width = web_sys::window()
        .and_then(|w| w.inner_width().ok())
        .and_then(|w| w.as_f64())
        .unwrap_or(1000.0);
    (width as u32).clamp(200, 1000)
}

/// The tabs of a run's pages, and the zoom and step bar they share.
#[component]
pub(crate) fn RunHeader(view: RunView, #[prop(into)] current: String) -> impl IntoView {
    let run = view.run;
    let href = move |tail: &'static str| {
        let mut q = Vec::new();
        if let Some(s) = view.selected.get() {
            q.push(format!("step={s}"));
        }
        let (from, to) = view.window.get();
        if let Some(f) = from {
            q.push(format!("from={f}"));
        }
        if let Some(t) = to {
            q.push(format!("to={t}"));
        }
        let q = if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        };
        format!("/runs/{}{tail}{q}", api::enc(&run.get()))
    };
    let tab = move |tail: &'static str, label: &'static str, key: &'static str| {
        let active = current == key;
        view! {
            <A href=move || href(tail) attr:class=if active { "tab active" } else { "tab" }>
                {label}
            </A>
        }
    };
    view! {
        <div class="run-head">
            <h1 data-run=move || run.get()>{move || run.get()}</h1>
            <nav class="tabs">
                {tab("", "Overview", "overview")}
                {tab("/layers", "Layers", "layers")}
                {tab("/workers", "Workers", "workers")}
                {tab("/alerts", "Alerts", "alerts")}
            </nav>
            <ProbeSwitchButton run=run />
            <RunNotices run=run />
            <div class="zoombar">
                {move || {
                    let (from, to) = view.window.get();
                    match (from, to) {
                        (None, None) => "all steps".to_owned(),
                        (f, t) => {
                            format!(
                                "steps {}–{}",
                                f.map_or("start".into(), |v| v.to_string()),
                                t.map_or("end".into(), |v| v.to_string()),
                            )
                        }
                    }
                }}
                <button
                    class="reset"
                    on:click=move |_| view.window.set((None, None))
                    disabled=move || view.window.get() == (None, None)
                >
                    "Reset zoom"
                </button>
                <span class="hint">"drag on a chart to zoom · click to pick a step"</span>
                <span class="selected" data-selected=move || view.selected.get().map(|s| s.to_string())>
                    {move || view.selected.get().map(|s| format!("step {s}"))}
                </span>
            </div>
        </div>
    }
}

/// Attach / detach: turns the run's probes on or off through the collector, for agents
/// started with `rankwatch run --dormant` (or attached by pid); they follow within a few steps.
#[component]
fn ProbeSwitchButton(run: Memo<String>) -> impl IntoView {
    let changed = RwSignal::new(0u32);
    let switch = fetched(move || {
        changed.track();
        let run = run.get();
        Some(async move { api::probe_switch(&run).await })
    });
    let failed = RwSignal::new(None::<String>);
    let flip = move |on: bool| {
        let run = run.get_untracked();
        leptos::task::spawn_local(async move {
            match api::set_probe_switch(&run, on).await {
                Ok(_) => {
                    let _ = failed.try_set(None);
                    let _ = changed.try_update(|n| *n += 1);
                }
                Err(e) => {
                    let _ = failed.try_set(Some(e.to_string()));
                }
            }
        });
    };
    let on = move || switch.get().and_then(|a| a.ok()).and_then(|s| s.on);
    view! {
        <div class="probe-switch" data-probes=move || match on() {
            Some(true) => "on",
            Some(false) => "off",
            None => "unset",
        }>
            <span class="hint">
                {move || match on() {
                    Some(true) => "probes attached",
                    Some(false) => "probes detached",
                    None => "probes as started",
                }}
            </span>
            <button class="attach" on:click=move |_| flip(true) disabled=move || on() == Some(true)>
                "Attach"
            </button>
            <button class="detach" on:click=move |_| flip(false) disabled=move || on() == Some(false)>
                "Detach"
            </button>
            {move || failed.get().map(|e| view! { <span class="error" role="alert">{e}</span> })}
        </div>
    }
}

/// What the run's agent said it could not watch, from its tags: the layer probes when the
/// model's transformer blocks were not found (`layer_probes`; the loss and the gradient probe
/// still run), with the command that describes the model to the running job; the replica
/// fingerprint where the parameters have no replica in the run (`replica_fingerprint`: FSDP2,
/// tensor parallelism).
#[component]
fn RunNotices(run: Memo<String>) -> impl IntoView {
    let runs = fetched(move || {
        run.track();
        Some(async move { api::runs().await })
    });
    move || {
        let name = run.get();
        let tags = runs
            .get()
            .and_then(Result::ok)
            .and_then(|r| r.runs.into_iter().find(|s| s.run == name))
            .and_then(|s| s.tags)?;
        let layer_probes = tags.get("layer_probes").map(|off| {
            let fix = format!(
                "rankwatch attach --pid PID --run {name} --mapping '{{\"blocks\": \"path.to.blocks\", \"q\": \"attn.q\", \"k\": \"attn.k\", \"v\": \"attn.v\", \"o\": \"attn.o\", \"up\": \"mlp.up\", \"down\": \"mlp.down\"}}'"
            );
            view! {
                <p class="notice layer-probes-off" role="status">
                    {format!("layer probes {off}: spectral norms and activations need the model's blocks; the loss and gradient probes run. Describe the blocks to the job: ")}
                    <code>{fix}</code>
                </p>
            }
        });
        let fingerprint = tags.get("replica_fingerprint").map(|off| {
            view! {
                <p class="notice replica-fingerprint-off" role="status">
                    {format!("replica fingerprint {off}: replica_divergence cannot judge this run; the other rules do")}
                </p>
            }
        });
        Some(view! { {layer_probes} {fingerprint} })
    }
}

/// The error text of a failed query, shown where its data would be.
#[component]
pub(crate) fn ErrorBox(error: ApiError) -> impl IntoView {
    view! { <p class="error" role="alert">{error.to_string()}</p> }
}

/// Asks for the read token when the collector wants one.
#[component]
pub(crate) fn TokenPrompt() -> impl IntoView {
    let wanted = expect_context::<TokenWanted>();
    let input = NodeRef::<leptos::html::Input>::new();
    let save = move |_| {
        if let Some(el) = input.get() {
            api::set_read_token(el.value().trim());
            // Reload so the live connection picks the right transport.
            if let Some(w) = web_sys::window() {
                let _ = w.location().reload();
            }
        }
    };
    move || {
        wanted.0.get().map(|msg| {
            view! {
                <div class="token">
                    <p>{format!("This collector needs a read token ({msg}).")}</p>
                    <input type="password" node_ref=input placeholder="read token" />
                    <button on:click=save>"Use token"</button>
                </div>
            }
        })
    }
}

/// What one line group of a metric chart is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Role {
    /// One line per rank (or per series), coloured by rank.
    PerRank,
    /// One bold line, labelled as given (a mean over ranks).
    Mean(&'static str),
    /// One line per series, labelled as given plus the series' site/layer.
    Named(String),
}

/// One metric drawn on a chart.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Part {
    pub(crate) metric: String,
    pub(crate) role: Role,
    /// Draw `exp(value)` (perplexity from loss).
    pub(crate) exp: bool,
    pub(crate) layer: Option<u32>,
    pub(crate) site: Option<String>,
    pub(crate) rank: Option<u32>,
}

impl Part {
    pub(crate) fn new(metric: impl Into<String>, role: Role) -> Part {
        Part {
            metric: metric.into(),
            role,
            exp: false,
            layer: None,
            site: None,
            rank: None,
        }
    }
}

/// A chart of one or more metrics of the run, fetched for the page's window and drawn with the
/// run's alerts and the selected step.
#[component]
pub(crate) fn MetricChart(
    view: RunView,
    #[prop(into)] title: String,
    parts: Vec<Part>,
    #[prop(optional)] levels: Vec<Level>,
    #[prop(optional)] log: bool,
    /// Only incidents involving these rules are drawn (all when empty).
    #[prop(optional)]
    rules: Vec<&'static str>,
) -> impl IntoView {
    let name = title.clone();
    let fetch_parts = parts.clone();
    let data: Fetched<Vec<SeriesAnswer>> = fetched(move || {
        let run = view.run.get();
        let window = view.query_window(points());
        view.revision.track();
        let parts = fetch_parts.clone();
        Some(async move {
            // Every part at once: the collector answers them in parallel, and a chart is
            // drawn only when its slowest part arrives.
            let queries = parts
                .iter()
                .map(|p| api::series(&run, &p.metric, p.layer, p.site.as_deref(), p.rank, window));
            futures_util::future::try_join_all(queries).await
        })
    });
    let build = move |answers: &[SeriesAnswer]| {
        let mut spec = ChartSpec::new(title.clone());
        spec.log = log;
        // Named lines take colours in turn across parts, so two metrics never share one.
        let mut next_colour = 0usize;
        for (p, answer) in parts.iter().zip(answers) {
            let style = |i: usize, s: &api::Series| -> LineStyle {
                match &p.role {
                    Role::PerRank => {
                        let r = s.rank.unwrap_or(i as u32);
                        rank_style(r as usize, format!("rank {r}"))
                    }
                    Role::Mean(label) => mean_style(label),
                    Role::Named(label) => {
                        next_colour += 1;
                        let mut style = rank_style(
                            next_colour - 1,
                            match (&s.site, s.layer) {
                                (Some(site), _) => format!("{label} {site}"),
                                _ => label.clone(),
                            },
                        );
                        style.width = 1.5;
                        style
                    }
                }
            };
            if p.exp {
                spec.add_series(answer, style, f64::exp);
            } else {
                spec.add_series(answer, style, |v| v);
            }
        }
        spec.lines = levels.clone();
        if let Some(Ok(incidents)) = view.incidents.get() {
            spec.add_incidents(incidents.incidents.iter().filter(|i| {
                i.fired_at_ms.is_some()
                    && (rules.is_empty() || i.rules.iter().any(|r| rules.contains(&r.as_str())))
            }));
        }
        spec.selected = view.selected.get();
        spec
    };
    let spec = Signal::derive(move || {
        data.with(|d| {
            let answers = d.as_ref()?.as_ref().ok()?;
            Some(build(answers))
        })
    });
    let error = move || data.with(error_of);
    view! {
        <section class="panel">
            {move || error().map(|e| view! { <ErrorBox error=e /> })}
            <Chart spec=spec on_zoom=view.zoom() on_pick=view.pick() name=name.clone() />
        </section>
    }
}

/// A run's catalog, refreshed when runs change.
pub(crate) fn catalog(run: Memo<String>) -> Fetched<api::Catalog> {
    let live = expect_context::<Live>();
    let revision = run_revision(run);
    fetched(move || {
        let run = run.get();
        live.runs.track();
        // New metrics appear with new samples; the catalog is cheap (the run index).
        revision.track();
        Some(async move { api::catalog(&run).await })
    })
}
