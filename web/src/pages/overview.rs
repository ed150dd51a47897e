//! A run's overview: loss and perplexity (per rank and mean), gradient norm, learning rate and
//! every user scalar, with the alert timeline drawn on each chart. Charts share the zoom
//! window and the step cursor.

use leptos::prelude::*;

use super::{MetricChart, Part, Role, RunHeader, RunView, catalog};
use crate::api::{Catalog, CatalogMetric};

/// The charts of the page, from what the run has.
fn charts(catalog: &Catalog) -> Vec<(String, Vec<Part>)> {
    let has = |m: &str| catalog.get(m).is_some();
    let mut out = Vec::new();
    if has("loss") || has("loss_mean") {
        let mut parts = Vec::new();
        if has("loss") {
            parts.push(Part::new("loss", Role::PerRank));
        }
        if has("loss_mean") {
            parts.push(Part::new("loss_mean", Role::Mean("mean")));
        }
        out.push(("Loss".to_owned(), parts));
        let mut ppl = Vec::new();
        if has("loss") {
            ppl.push(Part {
                exp: true,
                ..Part::new("loss", Role::PerRank)
            });
        }
        if has("perplexity") {
            ppl.push(Part::new("perplexity", Role::Mean("mean")));
        }
        out.push(("Perplexity".to_owned(), ppl));
    }
    if has("grad_norm") {
        out.push((
            "Gradient norm (local, before averaging)".to_owned(),
            vec![Part::new("grad_norm", Role::PerRank)],
        ));
    }
    // The learning rate: the agent's own reading of the watched optimizer (`learning_rate`),
    // or the job's `lr` where the agent sent none (beside the agent's, a job's `lr` is one
    // more user scalar).
    let agent_lr = catalog.get("learning_rate");
    if let Some(m) = agent_lr {
        out.push((
            "Learning rate".to_owned(),
            vec![Part::new(
                m.metric.clone(),
                one_or_per_rank(m, "learning rate"),
            )],
        ));
    }
    let is_lr = |name: &str| agent_lr.is_none() && name == "lr";
    let mut user: Vec<_> = catalog
        .metrics
        .iter()
        .filter(|m| m.user)
        .map(|m| (m.metric.strip_prefix("user/").unwrap_or(&m.metric), m))
        .collect();
    // The learning rate first, then the other user scalars by name (the catalog's order).
    user.sort_by_key(|(name, _)| !is_lr(name));
    for (name, m) in user {
        let title = if is_lr(name) {
            "Learning rate".to_owned()
        } else {
            name.to_owned()
        };
        out.push((
            title,
            vec![Part::new(m.metric.clone(), one_or_per_rank(m, name))],
        ));
    }
    out
}

/// A line per rank where several ranks sent the metric, else one line named `name`.
fn one_or_per_rank(m: &CatalogMetric, name: &str) -> Role {
    if m.ranks.len() > 1 {
        Role::PerRank
    } else {
        Role::Named(name.to_owned())
    }
}

#[component]
pub(crate) fn OverviewPage() -> impl IntoView {
    let view = RunView::new();
    let catalog = catalog(view.run);
    // Only a change in the set of charts rebuilds them; new data updates them in place.
    let list = Memo::new(move |_| match catalog.get() {
        Some(Ok(c)) => Ok(charts(&c)),
        Some(Err(e)) => Err(Some(e)),
        None => Err(None),
    });
    view! {
        <RunHeader view=view current="overview" />
        {move || match list.get() {
            Err(None) => view! { <p class="loading">"Loading…"</p> }.into_any(),
            Err(Some(e)) => view! { <super::ErrorBox error=e /> }.into_any(),
            Ok(charts) if charts.is_empty() => {
                view! { <p class="empty">"This run has no loss or scalars yet."</p> }.into_any()
            }
            Ok(charts) => {
                view! {
                    <div class="charts">
                        {charts
                            .into_iter()
                            .map(|(title, parts)| {
                                view! { <MetricChart view=view title=title parts=parts /> }
                            })
                            .collect_view()}
                    </div>
                }
                    .into_any()
            }
        }}
    }
}
