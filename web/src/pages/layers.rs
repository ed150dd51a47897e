//! A run's layers: a layer × step heatmap of one per-layer metric (spectral.ratio by default;
//! ratio_ov, token cosine, activation maxima by site, …) with the configured healthy band
//! outlined, and for the clicked layer its series: σ per matrix, the ratios, token cosine and
//! activation maxima.

use leptos::prelude::*;
use leptos_router::hooks::use_query_map;

use super::{ErrorBox, MetricChart, Part, Role, RunHeader, RunView, catalog, points};
use rankwatch_api::MetricScope;

use crate::api::{self, Catalog, Heatmap, NumExt, RulesAnswer, RulesExt};
use crate::chart::{Band, HeatSpec, HeatmapCanvas, Level, Scale};
use crate::fetch::{error_of, fetched};
use crate::format;

/// The band a metric should stay in, and how the legend explains it.
fn band(metric: &str, rules: Option<&RulesAnswer>) -> (Option<Band>, String) {
    let n = |rule: &str, key: &str| rules.and_then(|r| r.number(rule, key));
    match metric {
        "spectral.ratio" | "spectral.ratio_ov" => match (
            n("rank_collapse", "band_low"),
            n("rank_collapse", "band_high"),
        ) {
            (Some(low), Some(high)) => (
                Some(Band { low, high }),
                format!(
                    "healthy band {}–{} (rank_collapse band_low/band_high); cells outside it are outlined",
                    format::num(Some(low)),
                    format::num(Some(high))
                ),
            ),
            _ => (
                None,
                format!(
                    "no fixed band is configured: rank_collapse judges each layer against the median of its own ratio over the last {} steps and fires on a ×{} drift",
                    format::num(n("rank_collapse", "ratio_window_steps")),
                    format::num(n("rank_collapse", "drift_factor"))
                ),
            ),
        },
        "token_cosine" => {
            let warn = n("rank_collapse", "token_cosine_warning");
            let crit = n("rank_collapse", "token_cosine_critical");
            (
                warn.map(|w| Band { low: -1.0, high: w }),
                format!(
                    "healthy below {} (warning), critical at {}; cells above the warning level are outlined",
                    format::num(warn),
                    format::num(crit)
                ),
            )
        }
        "act_max" => {
            let limit = n("activation_outlier", "absolute_limit");
            let text = match limit {
                Some(_) => format!(
                    "healthy below {} (activation_outlier absolute_limit); cells above it are outlined",
                    format::num(limit)
                ),
                None => "no absolute limit set (activation_outlier absolute_limit); the rule judges growth over each site's own baseline".into(),
            };
            (limit.map(|l| Band { low: 0.0, high: l }), text)
        }
        _ => (None, "no band for this metric".into()),
    }
}

/// What a heatmap's colour measures, in words and units, for its colour scale.
fn unit_of(metric: &str) -> String {
    match metric {
        "spectral.ratio" => "σ_MLP / σ_attention (ratio of spectral norms)".into(),
        "spectral.ratio_ov" => "σ_MLP / σ(W_O·W_V) (ratio of spectral norms)".into(),
        "token_cosine" => "mean pairwise cosine of token states (−1 to 1)".into(),
        "act_max" => "max |activation| (absolute value)".into(),
        "effective_rank" => "effective rank (directions kept)".into(),
        m if m.starts_with("spectral.sigma") => format!("{m} (spectral norm σ)"),
        m => m.to_owned(),
    }
}

fn heat_spec(
    h: &Heatmap,
    metric: &str,
    band: Option<Band>,
    layer: Option<u32>,
    step: Option<u64>,
) -> HeatSpec {
    let finite = h.last.iter().flatten().filter_map(|v| v.finite());
    let (mut min, mut max) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    if !min.is_finite() {
        (min, max) = (0.0, 1.0);
    }
    let log = metric.starts_with("spectral.") || metric == "act_max";
    let scale = if metric == "token_cosine" {
        Scale {
            kind: "linear",
            min: 0.0,
            max: 1.0,
        }
    } else if log && min > 0.0 {
        Scale {
            kind: "log",
            min,
            max,
        }
    } else {
        Scale {
            kind: "linear",
            min,
            max,
        }
    };
    let selected_col = step.and_then(|s| h.steps.iter().rposition(|&start| start <= s));
    // Probes run every few steps, so at fine zoom most cells are empty: each empty cell after
    // a probe shows that probe's value (the tooltip says so), up to the layer's last probe.
    let mut filled = Vec::with_capacity(h.last.len());
    let mut values = Vec::with_capacity(h.last.len());
    for (r, row) in h.last.iter().enumerate() {
        let mut carried = None;
        let mut vals = Vec::with_capacity(row.len());
        let mut fill = Vec::with_capacity(row.len());
        for (c, v) in row.iter().enumerate() {
            let measured = h.count.get(r).and_then(|x| x.get(c)).copied().unwrap_or(0) > 0;
            if measured {
                carried = v.finite();
                vals.push(carried);
                fill.push(false);
            } else {
                vals.push(carried);
                fill.push(carried.is_some());
            }
        }
        values.push(vals);
        filled.push(fill);
    }
    HeatSpec {
        rows: h.layers.iter().map(|l| format!("layer {l}")).collect(),
        cols: h.steps.clone(),
        last_step: h.buckets.to,
        values,
        filled,
        nonfinite: h.nonfinite.clone(),
        scale,
        unit: unit_of(metric),
        band,
        selected_row: layer.and_then(|l| h.layers.iter().position(|&x| x == l)),
        selected_col,
    }
}

/// Per-layer metrics the page offers, in this order, with whether they need a site.
const METRICS: [&str; 9] = [
    "spectral.ratio",
    "spectral.ratio_ov",
    "token_cosine",
    "effective_rank",
    "act_max",
    "stable_rank",
    "spectral.sigma",
    "spectral.mlp",
    "spectral.attn",
];

fn offered(c: &Catalog) -> Vec<(String, Vec<String>)> {
    METRICS
        .iter()
        .filter_map(|m| c.get(m))
        .chain(c.metrics.iter().filter(|m| {
            m.scope == Some(MetricScope::Layer) && !METRICS.contains(&m.metric.as_str())
        }))
        .map(|m| (m.metric.clone(), m.sites.clone()))
        .collect()
}

/// The charts of one layer.
fn layer_charts(
    view: RunView,
    c: &Catalog,
    layer: u32,
    rules: Option<&RulesAnswer>,
) -> Vec<AnyView> {
    let part = |metric: &str, label: &str| {
        let m = c.get(metric).filter(|m| m.layers.contains(&layer))?;
        Some(Part {
            layer: Some(layer),
            // One rank's view: the spectral probe runs on rank 0 only, activations on all.
            rank: m.ranks.first().copied(),
            ..Part::new(metric, Role::Named(label.to_owned()))
        })
    };
    let mut out = Vec::new();
    if let Some(p) = part("spectral.sigma", "σ") {
        out.push(view! { <MetricChart view=view title=format!("Layer {layer}: σ per matrix") parts=vec![p] log=true rules=vec!["rank_collapse"] /> }.into_any());
    }
    let ratios: Vec<Part> = [
        ("spectral.ratio", "ratio"),
        ("spectral.ratio_ov", "ratio_ov"),
    ]
    .iter()
    .filter_map(|(m, l)| part(m, l))
    .collect();
    if !ratios.is_empty() {
        let levels = match band("spectral.ratio", rules).0 {
            Some(b) => vec![
                Level {
                    y: b.low,
                    color: "#2a9d8f".into(),
                    label: "band low".into(),
                },
                Level {
                    y: b.high,
                    color: "#2a9d8f".into(),
                    label: "band high".into(),
                },
            ],
            None => Vec::new(),
        };
        out.push(view! { <MetricChart view=view title=format!("Layer {layer}: MLP / attention spectral-norm ratio") parts=ratios levels=levels log=true rules=vec!["rank_collapse"] /> }.into_any());
    }
    if let Some(p) = part("token_cosine", "token cosine") {
        let n = |k: &str| rules.and_then(|r| r.number("rank_collapse", k));
        let levels = [
            ("warning", n("token_cosine_warning"), "#f5a623"),
            ("critical", n("token_cosine_critical"), "#d0021b"),
        ]
        .into_iter()
        .filter_map(|(l, y, c)| {
            Some(Level {
                y: y?,
                color: c.into(),
                label: l.into(),
            })
        })
        .collect::<Vec<_>>();
        out.push(view! { <MetricChart view=view title=format!("Layer {layer}: token cosine") parts=vec![p] levels=levels rules=vec!["rank_collapse"] /> }.into_any());
    }
    if let Some(p) = part("effective_rank", "effective rank") {
        out.push(view! { <MetricChart view=view title=format!("Layer {layer}: effective rank of the linearised block (1 = one direction)") parts=vec![p] rules=vec!["rank_collapse"] /> }.into_any());
    }
    if let Some(p) = part("act_max", "act_max") {
        let levels = rules
            .and_then(|r| r.number("activation_outlier", "absolute_limit"))
            .map(|y| {
                vec![Level {
                    y,
                    color: "#d0021b".into(),
                    label: "absolute limit".into(),
                }]
            })
            .unwrap_or_default();
        out.push(view! { <MetricChart view=view title=format!("Layer {layer}: activation max by site") parts=vec![p] levels=levels log=true rules=vec!["activation_outlier"] /> }.into_any());
    }
    out
}

#[component]
pub(crate) fn LayersPage() -> impl IntoView {
    let view = RunView::new();
    let query = use_query_map();
    let catalog = catalog(view.run);
    let metric = RwSignal::new(
        query
            .with_untracked(|q| q.get("metric"))
            .unwrap_or_else(|| "spectral.ratio".into()),
    );
    let site = RwSignal::new(query.with_untracked(|q| q.get("site")));
    let layer =
        RwSignal::new(query.with_untracked(|q| q.get("layer").and_then(|l| l.parse::<u32>().ok())));
    let rules = fetched(move || {
        let run = view.run.get();
        Some(async move { api::rules(&run).await })
    });
    // The catalog is re-read as data arrives; only a change in it rebuilds what it shapes.
    let known = Memo::new(move |_| catalog.get().and_then(Result::ok));
    let options = Memo::new(move |_| known.get().map(|c| offered(&c)).unwrap_or_default());
    // A metric the run lacks falls back to the first one it has; a metric with sites needs one.
    Effect::new(move |_| {
        let opts = options.get();
        if opts.is_empty() {
            return;
        }
        let m = metric.get();
        let sites = match opts.iter().find(|(name, _)| *name == m) {
            Some((_, sites)) => sites.clone(),
            None => {
                metric.set(opts[0].0.clone());
                return;
            }
        };
        let s = site.get();
        if sites.is_empty() && s.is_some() {
            site.set(None);
        } else if !sites.is_empty() && s.as_ref().is_none_or(|s| !sites.contains(s)) {
            site.set(sites.first().cloned());
        }
    });
    let heat = fetched(move || {
        let run = view.run.get();
        let m = metric.get();
        let s = site.get();
        let known = options.with(|o| {
            o.iter()
                .any(|(name, sites)| *name == m && (sites.is_empty() == s.is_none()))
        });
        if !known {
            return None;
        }
        let window = view.query_window(points().min(600));
        view.revision.track();
        Some(async move { api::heatmap(&run, &m, s.as_deref(), window).await })
    });
    let rules_now = move || match rules.get() {
        Some(Ok(r)) => Some(r),
        _ => None,
    };
    let spec = Signal::derive(move || {
        heat.with(|h| match h {
            Some(Ok(h)) => {
                let m = metric.get();
                Some(heat_spec(
                    h,
                    &m,
                    band(&m, rules_now().as_ref()).0,
                    layer.get(),
                    view.selected.get(),
                ))
            }
            _ => None,
        })
    });
    let pick = Callback::new(move |(r, c): (usize, usize)| {
        heat.with_untracked(|h| {
            if let Some(Ok(h)) = h {
                if let Some(l) = h.layers.get(r) {
                    layer.set(Some(*l));
                }
                if let Some(s) = h.steps.get(c) {
                    view.selected.set(Some(*s));
                }
            }
        });
    });
    let detail = move || {
        let l = layer.get()?;
        let c = known.get()?;
        let charts = layer_charts(view, &c, l, rules_now().as_ref());
        Some(view! {
            <h2 data-layer=l>{format!("Layer {l}")}</h2>
            <div class="charts">{charts}</div>
        })
    };
    view! {
        <RunHeader view=view current="layers" />
        <section class="panel">
            <div class="controls">
                <label>
                    "metric "
                    <select
                        class="metric"
                        on:change=move |ev| metric.set(event_target_value(&ev))
                        prop:value=move || metric.get()
                    >
                        {move || {
                            options
                                .get()
                                .into_iter()
                                .map(|(m, _)| view! { <option value=m.clone()>{m.clone()}</option> })
                                .collect_view()
                        }}
                    </select>
                </label>
                {move || {
                    let m = metric.get();
                    let sites = options.with(|o| o.iter().find(|(n, _)| *n == m).map(|(_, s)| s.clone()).unwrap_or_default());
                    (!sites.is_empty()).then(|| view! {
                        <label>
                            " site "
                            <select class="site" on:change=move |ev| site.set(Some(event_target_value(&ev))) prop:value=move || site.get().unwrap_or_default()>
                                {sites.into_iter().map(|s| view! { <option value=s.clone()>{s.clone()}</option> }).collect_view()}
                            </select>
                        </label>
                    })
                }}
            </div>
            <p class="legend">{move || band(&metric.get(), rules_now().as_ref()).1}</p>
            {move || {
                if let Some(e) = catalog.with(error_of).or_else(|| heat.with(error_of)) {
                    return Some(view! { <ErrorBox error=e /> }.into_any());
                }
                if known.with(Option::is_some) && options.with(Vec::is_empty) {
                    return Some(view! {
                        <p class="empty">"This run has no per-layer metrics yet (the spectral and activation probes send them)."</p>
                    }.into_any());
                }
                heat.with(Option::is_none).then(|| view! { <p class="loading">"Loading…"</p> }.into_any())
            }}
            <HeatmapCanvas spec=spec on_pick=pick />
            <p class="hint">"click a cell for that layer's series"</p>
        </section>
        {detail}
    }
}
