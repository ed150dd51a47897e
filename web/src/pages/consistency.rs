//! The Workers page's consistency panel: the run's loss and gradient-norm dispersion beside what
//! independent shards would give, the inter-worker cosine, each rank's standing, and the
//! verdict in words (`GET /api/v1/runs/{run}/consistency`, over the zoomed steps) — for
//! assessing a configuration, as arXiv 2602.14462 uses these indicators.

use leptos::prelude::*;

use super::{ErrorBox, RunView, fetched};
use crate::api::{self, ConsistencyReport};
use crate::format;

/// One indicator row: observed, expected, ratio.
fn row(
    name: &'static str,
    key: &'static str,
    i: Option<rankwatch_api::DispersionIndicator>,
) -> impl IntoView {
    let (observed, expected, ratio) = match i {
        Some(i) => (
            format::num(Some(i.observed_cv)),
            format::num(Some(i.expected_cv)),
            format::num(Some(i.ratio.0)),
        ),
        None => ("–".into(), "–".into(), "–".into()),
    };
    view! {
        <tr data-indicator=key>
            <th>{name}</th>
            <td class="observed">{observed}</td>
            <td class="expected">{expected}</td>
            <td class="ratio">{ratio}</td>
        </tr>
    }
}

fn report(r: ConsistencyReport) -> impl IntoView {
    let steps = match (r.from_step, r.to_step) {
        (Some(a), Some(b)) => format!("steps {a}–{b}, {} with two or more ranks", r.steps),
        _ => "no per-rank steps".into(),
    };
    let verdict = serde_json::to_value(r.verdict)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let cos = format::num(r.cos_weighted_median.map(|c| c.0));
    view! {
        <div class="consistency" data-verdict=verdict.clone()>
            <p class="reading"><strong>{verdict.replace('_', " ")}</strong>": "{r.reading}</p>
            <table>
                <thead>
                    <tr>
                        <th>"dispersion across ranks (CV, median over steps)"</th>
                        <th>"observed"</th>
                        <th>"independent shards"</th>
                        <th>"ratio"</th>
                    </tr>
                </thead>
                <tbody>
                    {row("loss", "loss", r.loss)}
                    {row("gradient norm (local)", "grad_norm", r.grad_norm)}
                </tbody>
            </table>
            <p class="cosine" data-cos=cos.clone()>
                {format!("inter-worker cosine C_w (median): {cos} — 1 when the ranks compute the same gradient")}
            </p>
            <table class="standing">
                <thead>
                    <tr><th>"rank"</th><th>"loss ÷ others'"</th><th>"gradient norm ÷ others'"</th></tr>
                </thead>
                <tbody>
                    {r.ranks.into_iter().map(|s| view! {
                        <tr data-rank=s.rank.to_string()>
                            <th>{format!("rank {}", s.rank)}</th>
                            <td>{format::num(s.loss_vs_others)}</td>
                            <td>{format::num(s.grad_norm_vs_others)}</td>
                        </tr>
                    }).collect_view()}
                </tbody>
            </table>
            <p class="hint">{steps}". Ratio ≈ 1: as independent shards; ≪ 1: the ranks see the same batches; ≫ 1: they differ by more than their batches (different data, code or a faulty rank)."</p>
        </div>
    }
}

/// The panel; follows the zoom window.
#[component]
pub(crate) fn ConsistencyPanel(view: RunView) -> impl IntoView {
    let answer = fetched(move || {
        let run = view.run.get();
        let (from, to) = view.window.get();
        view.revision.track();
        Some(async move { api::consistency(&run, from, to).await })
    });
    view! {
        <section class="panel consistency-panel">
            <h2>"Worker consistency of this run"</h2>
            {move || match answer.get() {
                None => view! { <p class="loading">"Loading…"</p> }.into_any(),
                Some(Err(e)) => view! { <ErrorBox error=e /> }.into_any(),
                Some(Ok(r)) => report(r).into_any(),
            }}
        </section>
    }
}
