//! Charts: the Rust side of `js/charts.js`.
//!
//! A chart is described by a [`ChartSpec`] (aligned x and y arrays, incident spans, threshold
//! lines, the selected step) and handed to uPlot as one JSON string; later specs update the
//! same plot in place. Zoom (a drag on the plot) and pick (a click) come back as callbacks,
//! and the page turns them into new queries: the server does the downsampling, so a zoom
//! fetches finer buckets rather than stretching the coarse ones.

use leptos::prelude::*;
use rankwatch_api::Severity;
use serde::Serialize;
use wasm_bindgen::JsValue;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::prelude::wasm_bindgen;

use crate::api::{BucketRange as Buckets, Incident, NumExt, SeriesAnswer};

#[wasm_bindgen(module = "/js/charts.js")]
extern "C" {
    #[wasm_bindgen(js_name = chartCreate)]
    fn chart_create(
        el: &web_sys::HtmlElement,
        spec: &str,
        on_zoom: &Closure<dyn FnMut(f64, f64)>,
        on_pick: &Closure<dyn FnMut(f64)>,
    ) -> JsValue;
    #[wasm_bindgen(js_name = chartUpdate)]
    fn chart_update(handle: &JsValue, spec: &str);
    #[wasm_bindgen(js_name = chartDestroy)]
    fn chart_destroy(handle: &JsValue);
    #[wasm_bindgen(js_name = heatmapDraw)]
    fn heatmap_draw(
        canvas: &web_sys::HtmlCanvasElement,
        spec: &str,
        on_pick: &Closure<dyn FnMut(f64, f64)>,
    );
}

/// Line colours for ranks (and other series), distinguishable and colour-blind aware.
pub(crate) const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct LineStyle {
    pub(crate) label: String,
    pub(crate) color: String,
    pub(crate) width: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) dash: Option<Vec<f64>>,
}

/// A shaded step range on a chart: one incident's span, however many alerts it holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Mark {
    /// The incident's id (tests read which bands were drawn).
    pub(crate) id: String,
    pub(crate) from: f64,
    pub(crate) to: f64,
    pub(crate) color: String,
    /// Short, drawn on the band when there is room beside the other labels.
    pub(crate) label: String,
    /// Shown on hover: the summary and what to do.
    pub(crate) detail: String,
}

/// A horizontal threshold line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Level {
    pub(crate) y: f64,
    pub(crate) color: String,
    pub(crate) label: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub(crate) struct ChartSpec {
    pub(crate) title: String,
    pub(crate) height: u32,
    pub(crate) log: bool,
    pub(crate) series: Vec<LineStyle>,
    pub(crate) x: Vec<f64>,
    pub(crate) ys: Vec<Vec<Option<f64>>>,
    pub(crate) marks: Vec<Mark>,
    pub(crate) lines: Vec<Level>,
    pub(crate) nonfinite: Vec<f64>,
    pub(crate) selected: Option<u64>,
    /// The bucket grid `x` was laid out on (the first answer's); later answers are placed
    /// on it.
    #[serde(skip)]
    grid: Option<Buckets>,
}

impl ChartSpec {
    pub(crate) fn new(title: impl Into<String>) -> ChartSpec {
        ChartSpec {
            title: title.into(),
            height: 220,
            ..ChartSpec::default()
        }
    }

    /// Adds every series of `answer` on the common bucket grid, labelled by `label`, with
    /// each value passed through `map` (e.g. `exp` for perplexity).
    pub(crate) fn add_series(
        &mut self,
        answer: &SeriesAnswer,
        mut style: impl FnMut(usize, &crate::api::Series) -> LineStyle,
        map: impl Fn(f64) -> f64,
    ) {
        let answer_grid = answer.buckets;
        let grid = *self.grid.get_or_insert_with(|| {
            self.x = (0..answer_grid.count as usize)
                .map(|i| answer_grid.start(i) as f64)
                .collect();
            answer_grid
        });
        let slots = self.x.len() as u64;
        for (i, s) in answer.series.iter().enumerate() {
            let mut ys = vec![None; self.x.len()];
            for b in &s.buckets {
                // A bucket outside this chart's grid (a later part's wider window) is left out.
                let Some(j) = grid.index(b.start).map(|j| j as u64) else {
                    continue;
                };
                if j < slots {
                    ys[j as usize] = b.last.finite().map(&map).filter(|v| v.is_finite());
                    if b.nonfinite > 0 {
                        self.nonfinite.push(b.start as f64);
                    }
                }
            }
            self.series.push(style(i, s));
            self.ys.push(ys);
        }
    }

    /// Shades each incident's step span: one band and one label per incident (its cause's
    /// rule, and how many more rules followed), its summary and action on hover.
    pub(crate) fn add_incidents<'a>(&mut self, incidents: impl IntoIterator<Item = &'a Incident>) {
        for i in incidents {
            let color = match i.severity {
                Severity::Critical => "#d0021b",
                Severity::Warning => "#f5a623",
                Severity::Info => "#4a90e2",
            };
            let cause = i
                .rules
                .first()
                .map_or("incident", |r| crate::format::rule_label(*r));
            let label = match i.rules.len() {
                0 | 1 => cause.to_owned(),
                n => format!("{cause} +{}", n - 1),
            };
            let mut detail = format!(
                "{} {} · steps {}–{} · {} alert{}\n{}",
                i.severity.as_str(),
                i.state.as_str(),
                i.first_step,
                i.last_step,
                i.alerts.len(),
                if i.alerts.len() == 1 { "" } else { "s" },
                i.summary
            );
            if !i.action.is_empty() {
                detail.push_str(&format!("\nWhat to do: {}", i.action));
            }
            self.marks.push(Mark {
                id: i.id.clone(),
                from: i.first_step as f64,
                to: i.last_step as f64,
                color: color.into(),
                label,
                detail,
            });
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.series.is_empty() || self.x.is_empty()
    }
}

pub(crate) fn rank_style(i: usize, label: String) -> LineStyle {
    LineStyle {
        label,
        color: PALETTE[i % PALETTE.len()].into(),
        width: 1.0,
        dash: None,
    }
}

pub(crate) fn mean_style(label: &str) -> LineStyle {
    LineStyle {
        label: label.into(),
        color: "#222".into(),
        width: 2.25,
        dash: None,
    }
}

/// One uPlot chart. `spec` updates it in place; a drag calls `on_zoom(from, to)` and a click
/// `on_pick(step)`.
#[component]
pub(crate) fn Chart(
    #[prop(into)] spec: Signal<Option<ChartSpec>>,
    on_zoom: Callback<(u64, u64)>,
    on_pick: Callback<u64>,
    #[prop(into)] name: String,
) -> impl IntoView {
    let node = NodeRef::<leptos::html::Div>::new();
    let handle = StoredValue::new_local(None::<JsValue>);
    // The callbacks must live as long as the plot that calls them.
    type Closures = (Closure<dyn FnMut(f64, f64)>, Closure<dyn FnMut(f64)>);
    let closures = StoredValue::new_local(None::<Closures>);
    Effect::new(move |_| {
        let Some(el) = node.get() else { return };
        let Some(spec) = spec.get() else { return };
        let json = serde_json::to_string(&spec).unwrap_or_default();
        if let Some(h) = handle.get_value() {
            chart_update(&h, &json);
            return;
        }
        let zoom = Closure::<dyn FnMut(f64, f64)>::new(move |a: f64, b: f64| {
            on_zoom.run((a.max(0.0) as u64, b.max(0.0) as u64));
        });
        let pick = Closure::<dyn FnMut(f64)>::new(move |s: f64| on_pick.run(s.max(0.0) as u64));
        let h = chart_create(&el, &json, &zoom, &pick);
        closures.set_value(Some((zoom, pick)));
        handle.set_value(Some(h));
    });
    on_cleanup(move || {
        if let Some(Some(h)) = handle.try_get_value() {
            chart_destroy(&h);
        }
    });
    view! {
        <div class="chart-box">
            <div class="chart" node_ref=node data-chart=name></div>
            {move || {
                spec.with(|s| match s {
                    Some(s) if s.is_empty() => {
                        Some(view! { <p class="empty">"no data in this range"</p> })
                    }
                    _ => None,
                })
            }}
        </div>
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Scale {
    pub(crate) kind: &'static str,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Band {
    pub(crate) low: f64,
    pub(crate) high: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HeatSpec {
    pub(crate) rows: Vec<String>,
    pub(crate) cols: Vec<u64>,
    pub(crate) last_step: u64,
    pub(crate) values: Vec<Vec<Option<f64>>>,
    /// Cells without a measurement of their own, showing the previous probe's value.
    pub(crate) filled: Vec<Vec<bool>>,
    pub(crate) nonfinite: Vec<Vec<u64>>,
    pub(crate) scale: Scale,
    /// What the colour measures (the colour scale's caption).
    pub(crate) unit: String,
    pub(crate) band: Option<Band>,
    pub(crate) selected_row: Option<usize>,
    pub(crate) selected_col: Option<usize>,
}

/// A layer × step heatmap on a canvas; a click calls `on_pick(row, column)`.
#[component]
pub(crate) fn HeatmapCanvas(
    #[prop(into)] spec: Signal<Option<HeatSpec>>,
    on_pick: Callback<(usize, usize)>,
) -> impl IntoView {
    let node = NodeRef::<leptos::html::Canvas>::new();
    let pick = StoredValue::new_local(None::<Closure<dyn FnMut(f64, f64)>>);
    Effect::new(move |_| {
        let Some(canvas) = node.get() else { return };
        let Some(spec) = spec.get() else { return };
        let json = serde_json::to_string(&spec).unwrap_or_default();
        if pick.with_value(Option::is_none) {
            pick.set_value(Some(Closure::new(move |r: f64, c: f64| {
                on_pick.run((r as usize, c as usize));
            })));
        }
        pick.with_value(|p| {
            if let Some(p) = p {
                heatmap_draw(&canvas, &json, p);
            }
        });
    });
    view! {
        <div class="heat-box">
            <canvas node_ref=node data-heatmap="1"></canvas>
            <div class="heat-tip"></div>
        </div>
        {move || spec.get().map(|s| view! { <ColourScale spec=s /> })}
    }
}

/// The viridis stops the heatmap draws with (`charts.js`), as a CSS gradient.
const VIRIDIS_CSS: &str = "linear-gradient(to right, rgb(68,1,84), rgb(59,82,139), rgb(33,145,140), rgb(94,201,98), rgb(253,231,37))";

/// A heatmap's colour scale: the gradient with its low, middle and high values (the middle is
/// the geometric mean on a log scale), what the colour measures, and the special colours.
#[component]
fn ColourScale(spec: HeatSpec) -> impl IntoView {
    let Scale { kind, min, max } = spec.scale;
    let mid = if kind == "log" && min > 0.0 {
        (min * max).sqrt()
    } else {
        (min + max) / 2.0
    };
    let caption = if kind == "log" {
        format!("{} — log scale", spec.unit)
    } else {
        spec.unit.clone()
    };
    view! {
        <div class="colour-scale" data-kind=kind data-min=min.to_string() data-max=max.to_string()>
            <span class="caption">{caption}</span>
            <div class="bar-row">
                <span class="lo">{crate::format::num(Some(min))}</span>
                <span class="bar" style=format!("background: {VIRIDIS_CSS}")></span>
                <span class="hi">{crate::format::num(Some(max))}</span>
            </div>
            <span class="mid">{format!("middle {}", crate::format::num(Some(mid)))}</span>
            <span class="special">
                <span class="swatch nonfinite"></span>" non-finite "
                <span class="swatch empty"></span>" no data"
                {spec.band.map(|b| view! {
                    " "<span class="swatch band"></span>
                    {format!(" outside the healthy band {}–{}", crate::format::num(Some(b.low)), crate::format::num(Some(b.high)))}
                })}
            </span>
        </div>
    }
}
