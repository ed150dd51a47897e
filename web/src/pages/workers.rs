//! A run's workers: each rank's loss and gradient norm, the dispersion statistics and
//! `cos_weighted` over time, and at the selected step the rank × rank cosine matrix of the
//! gradient sketches, with the outlier rank highlighted.

use std::collections::BTreeSet;

use leptos::prelude::*;

use super::consistency::ConsistencyPanel;
use super::{ErrorBox, MetricChart, Part, Role, RunHeader, RunView, catalog};
use rankwatch_api::{AlertState, CosineMatrix as Matrix, Rule};

use crate::api::{self, Alert, Cosine, Num, NumExt, Window, Workers};
use crate::chart::Level;
use crate::fetch::fetched;
use crate::format;

/// The ranks to highlight at `step`: those a silent-inconsistency alert covering the step
/// names, else the rank whose mean cosine to the others is lowest when it is clearly apart
/// (below the pair mean by more than 0.2).
fn outliers(alerts: &[Alert], step: u64, ranks: &[u32], matrix: &[Vec<Num>]) -> BTreeSet<u32> {
    let mut out: BTreeSet<u32> = alerts
        .iter()
        .filter(|a| {
            a.rule == Rule::SilentInconsistency
                && a.has_fired()
                && a.first_step <= step
                && (a.state == AlertState::Firing || step <= a.last_step)
        })
        .flat_map(|a| a.outlier_ranks.iter().copied().chain(a.rank))
        .collect();
    if out.is_empty() && ranks.len() > 2 {
        let mean_to_others = |i: usize| {
            let vals: Vec<f64> = (0..ranks.len())
                .filter(|&j| j != i)
                .filter_map(|j| matrix.get(i)?.get(j)?.finite())
                .collect();
            (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
        };
        let means: Vec<(usize, f64)> = (0..ranks.len())
            .filter_map(|i| mean_to_others(i).map(|m| (i, m)))
            .collect();
        let overall = means.iter().map(|(_, m)| m).sum::<f64>() / means.len().max(1) as f64;
        if let Some((i, m)) = means.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1))
            && m < overall - 0.2
        {
            out.insert(ranks[i]);
        }
    }
    out
}

fn cell_colour(v: Option<f64>) -> String {
    match v {
        None => "#d0021b".into(),
        Some(v) => {
            // -1 red … 0 white … 1 blue
            let t = v.clamp(-1.0, 1.0);
            let (r, g, b) = if t >= 0.0 {
                (255.0 - 177.0 * t, 255.0 - 134.0 * t, 255.0 - 88.0 * t)
            } else {
                (255.0, 255.0 + 168.0 * t, 255.0 + 166.0 * t)
            };
            format!("rgb({},{},{})", r as u8, g as u8, b as u8)
        }
    }
}

#[component]
fn CosineMatrix(workers: Workers, alerts: Vec<Alert>) -> impl IntoView {
    let step = workers.step.unwrap_or(0);
    match workers.cosine {
        None => view! {
            <p class="empty">
                "No cosine matrix at this step: fewer than two ranks sent a gradient sketch."
            </p>
        }
        .into_any(),
        Some(Cosine::Error { error: e }) => {
            view! { <p class="error">{format!("The sketches do not compare: {e}")}</p> }.into_any()
        }
        Some(Cosine::Matrix(Matrix {
            ranks,
            matrix,
            pair_mean,
        })) => {
            let flagged = outliers(&alerts, step, &ranks, &matrix);
            let header = ranks
                .iter()
                .map(|r| view! { <th class:outlier=flagged.contains(r)>{format!("rank {r}")}</th> })
                .collect_view();
            let rows = ranks
                .iter()
                .zip(&matrix)
                .map(|(r, row)| {
                    let out = flagged.contains(r);
                    view! {
                        <tr class:outlier=out data-rank=*r data-outlier=out.to_string()>
                            <th>{format!("rank {r}")}</th>
                            {row
                                .iter()
                                .map(|v| {
                                    let text = format::num(Some(v.get()));
                                    view! {
                                        <td style=format!(
                                            "background:{}",
                                            cell_colour(v.finite()),
                                        )>{text}</td>
                                    }
                                })
                                .collect_view()}
                        </tr>
                    }
                })
                .collect_view();
            let note = if flagged.is_empty() {
                "No rank stands out at this step.".to_owned()
            } else {
                format!(
                    "Outlier: rank {}",
                    flagged
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            view! {
                <p>
                    {format!("Gradient-sketch cosine at step {step}; mean over pairs {}. ", format::num(pair_mean.value()))}
                    <strong class="outlier-note">{note}</strong>
                </p>
                <table class="cosine" data-step=step>
                    <thead>
                        <tr>
                            <th></th>
                            {header}
                        </tr>
                    </thead>
                    <tbody>{rows}</tbody>
                </table>
            }
            .into_any()
        }
    }
}

#[component]
fn RankValues(workers: Workers) -> impl IntoView {
    let rows = workers
        .metrics
        .iter()
        .filter(|m| m.layer.is_none())
        .map(|m| {
            // Two rows of one metric differ by site (act_max at the embedding and the final
            // norm): the label says which.
            let label = match &m.site {
                Some(site) => format!("{} ({site})", m.metric),
                None => m.metric.clone(),
            };
            let attribute = label.clone();
            view! {
                <tr data-label=attribute>
                    <th>{label}</th>
                    {m.values.iter().map(|v| view! { <td>{format::num(v.value())}</td> }).collect_view()}
                </tr>
            }
        })
        .collect_view();
    view! {
        <table class="values">
            <thead>
                <tr>
                    <th></th>
                    {workers
                        .ranks
                        .iter()
                        .map(|r| view! { <th>{format!("rank {r}")}</th> })
                        .collect_view()}
                </tr>
            </thead>
            <tbody>{rows}</tbody>
        </table>
    }
}

/// The first (or last) step in `from..=to` with gradient sketches, read off `cos_pair_mean`,
/// which the aligner writes at exactly those steps. With `first`, the window is at most 10,000
/// steps, so buckets are one step wide and the first one is exact.
async fn sketched_step(run: &str, from: Option<u64>, to: Option<u64>, first: bool) -> Option<u64> {
    let points = if first { 10_000 } else { 1 };
    let window = Window { from, to, points };
    let answer = api::series(run, "cos_pair_mean", None, None, None, window)
        .await
        .ok()?;
    let buckets = &answer.series.first()?.buckets;
    if first {
        buckets.first().map(|b| b.start)
    } else {
        buckets.last().map(|b| b.last_step)
    }
}

#[component]
pub(crate) fn WorkersPage() -> impl IntoView {
    let view = RunView::new();
    let catalog = catalog(view.run);
    let have = Memo::new(move |_| match catalog.get() {
        Some(Ok(c)) => c
            .metrics
            .iter()
            .map(|m| m.metric.clone())
            .collect::<Vec<_>>(),
        _ => Vec::new(),
    });
    let workers = fetched(move || {
        let run = view.run.get();
        let step = view.selected.get();
        // Live: without a chosen step the latest one follows the run, and a chosen step whose
        // sketch has not arrived yet is shown once it does.
        view.revision.track();
        let sketched = have.with(|h| h.iter().any(|m| m == "cos_pair_mean"));
        Some(async move {
            // Gradient sketches come every few steps, and the cosine matrix only exists at
            // those: show the first sketched step at or after the one asked for (an alert's
            // link points at its first step), else the latest one before it.
            let at = match (sketched, step) {
                (false, _) => step,
                (true, Some(s)) => {
                    match sketched_step(&run, Some(s), Some(s.saturating_add(9_999)), true).await {
                        Some(found) => Some(found),
                        None => sketched_step(&run, None, Some(s), false).await.or(step),
                    }
                }
                (true, None) => sketched_step(&run, None, None, false).await,
            };
            api::workers(&run, at).await
        })
    });
    let has = move |m: &str| have.with(|h| h.iter().any(|x| x == m));
    // (title, metrics, one line per rank?, threshold lines); a chart shows when the run has
    // any of its metrics.
    let charts = move || {
        let zero = Level {
            y: 0.0,
            color: "#999".into(),
            label: "0".into(),
        };
        [
            ("Loss per rank", &["loss"][..], true, vec![]),
            (
                "Gradient norm per rank (local)",
                &["grad_norm"],
                true,
                vec![],
            ),
            (
                "Dispersion across ranks (coefficient of variation)",
                &["loss_cv", "grad_norm_cv"],
                false,
                vec![],
            ),
            (
                "Inter-worker gradient cosine",
                &["cos_weighted", "cos_pair_mean"],
                false,
                vec![zero],
            ),
            (
                "Monitoring cost per rank: gradient probe (ms per report)",
                &["probe_ms.grad"],
                true,
                vec![],
            ),
            (
                "Monitoring cost per rank: activation probe (ms per report)",
                &["probe_ms.activations"],
                true,
                vec![],
            ),
            (
                "Monitoring cost per rank: spectral probe (ms per call)",
                &["probe_ms.spectral"],
                true,
                vec![],
            ),
        ]
        .into_iter()
        .filter_map(|(title, metrics, per_rank, levels)| {
            let parts: Vec<Part> = metrics
                .iter()
                .filter(|m| has(m))
                .map(|&m| {
                    let role = if per_rank {
                        Role::PerRank
                    } else {
                        Role::Named(m.to_owned())
                    };
                    Part::new(m, role)
                })
                .collect();
            (!parts.is_empty()).then(|| {
                view! {
                    <MetricChart
                        view=view
                        title=title
                        parts=parts
                        levels=levels
                        rules=vec!["silent_inconsistency"]
                    />
                }
            })
        })
        .collect_view()
    };
    view! {
        <RunHeader view=view current="workers" />
        <section class="panel matrix">
            <h2>"Ranks at the selected step"</h2>
            {move || match workers.get() {
                None => view! { <p class="loading">"Loading…"</p> }.into_any(),
                Some(Err(e)) => view! { <ErrorBox error=e /> }.into_any(),
                Some(Ok(w)) if w.step.is_none() => {
                    view! { <p class="empty">"No per-rank data yet."</p> }.into_any()
                }
                Some(Ok(w)) => {
                    let alerts = match view.alerts.get() {
                        Some(Ok(a)) => a.alerts,
                        _ => Vec::new(),
                    };
                    view! {
                        <CosineMatrix workers=w.clone() alerts=alerts />
                        <RankValues workers=w />
                    }
                        .into_any()
                }
            }}
        </section>
        <ConsistencyPanel view=view />
        <div class="charts">{charts}</div>
    }
}
