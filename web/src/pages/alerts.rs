//! Alerts, firing and resolved, with their explanations and links to the layer or worker view
//! at the alert's step. At `/alerts` it lists every run's; at `/runs/:run/alerts` one run's.

use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use super::{ErrorBox, RunHeader, RunView};
use crate::api::{self, Alert};
use crate::fetch::fetched;
use crate::format;
use crate::live::Live;
use rankwatch_api::{AlertState, Rule};

/// Where an alert is best looked at: its layer for per-layer rules, the workers otherwise.
fn view_link(a: &Alert) -> (String, &'static str) {
    let run = api::enc(&a.run);
    let step = a.first_step;
    // A window around the alert, so the link lands with the alert in view.
    let pad = a.last_step.saturating_sub(a.first_step).saturating_add(100);
    let window = format!(
        "from={}&to={}",
        step.saturating_sub(pad),
        a.last_step.saturating_add(pad)
    );
    match (a.rule, a.layer) {
        (Rule::RankCollapse | Rule::ActivationOutlier, Some(layer)) => {
            let metric = if a.rule == Rule::RankCollapse {
                "spectral.ratio"
            } else {
                "act_max"
            };
            let site = a
                .site
                .as_ref()
                .map(|s| format!("&site={}", api::enc(s)))
                .unwrap_or_default();
            (
                format!(
                    "/runs/{run}/layers?metric={metric}{site}&layer={layer}&step={step}&{window}"
                ),
                "layer view",
            )
        }
        _ => (
            format!("/runs/{run}/workers?step={step}&{window}"),
            "worker view",
        ),
    }
}

fn where_(a: &Alert) -> String {
    let mut parts = Vec::new();
    if let Some(l) = a.layer {
        parts.push(format::layer_label(Some(l), a.site.as_deref()));
    } else if let Some(s) = &a.site {
        parts.push(s.clone());
    }
    if let Some(r) = a.rank {
        parts.push(format!("rank {r}"));
    }
    if !a.outlier_ranks.is_empty() {
        parts.push(format!(
            "outlier rank {}",
            a.outlier_ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if parts.is_empty() {
        "whole run".into()
    } else {
        parts.join(" · ")
    }
}

#[component]
fn AlertCard(alert: Alert, show_run: bool) -> impl IntoView {
    let (href, what) = view_link(&alert);
    let steps = if alert.first_step == alert.last_step {
        format!("step {}", alert.first_step)
    } else {
        format!("steps {}–{}", alert.first_step, alert.last_step)
    };
    let when = match alert.state {
        AlertState::Resolved => format!(
            "fired {}, resolved {}",
            format::time(alert.fired_at_ms),
            format::time(alert.resolved_at_ms)
        ),
        _ => format!(
            "since {}",
            format::time(alert.fired_at_ms.or(Some(alert.started_at_ms)))
        ),
    };
    view! {
        <article class=format!("alert {} {}", alert.severity, alert.state) data-alert=alert.id.clone() data-rule=alert.rule.as_str() data-state=alert.state.as_str()>
            <header>
                <span class="sev">{alert.severity.as_str()}</span>
                <span class="state">{alert.state.as_str()}</span>
                <strong>{format::rule_label(alert.rule).to_owned()}</strong>
                {show_run.then(|| view! { <span class="run">{format!("run {}", alert.run)}</span> })}
                <span class="where">{where_(&alert)}</span>
                <span class="steps">{steps}</span>
            </header>
            <p class="explanation">{alert.explanation.clone()}</p>
            <footer>
                <span>{format!("value {} · threshold {} · {when}", format::num(alert.value), format::num(alert.threshold))}</span>
                <A href=href attr:class="goto">{format!("open the {what} at step {}", alert.first_step)}</A>
            </footer>
        </article>
    }
}

#[component]
fn AlertList(run: Option<Memo<String>>) -> impl IntoView {
    let live = expect_context::<Live>();
    let state = RwSignal::new("active".to_owned());
    let alerts = fetched(move || {
        let run = run.map(|r| r.get());
        live.alerts.track();
        Some(async move { api::alerts(run.as_deref()).await })
    });
    view! {
        <div class="controls">
            <label>
                "show "
                <select class="state-filter" on:change=move |ev| state.set(event_target_value(&ev))>
                    <option value="active">"firing and resolved"</option>
                    <option value="firing">"firing"</option>
                    <option value="resolved">"resolved"</option>
                    <option value="all">"all, with pending"</option>
                </select>
            </label>
        </div>
        {move || match alerts.get() {
            None => view! { <p class="loading">"Loading…"</p> }.into_any(),
            Some(Err(e)) => view! { <ErrorBox error=e /> }.into_any(),
            Some(Ok(answer)) => {
                let want = state.get();
                let mut list: Vec<Alert> = answer
                    .alerts
                    .into_iter()
                    .filter(|a| match want.as_str() {
                        "firing" => a.state == AlertState::Firing,
                        "resolved" => a.state == AlertState::Resolved && a.has_fired(),
                        "all" => true,
                        _ => a.state == AlertState::Firing || (a.state == AlertState::Resolved && a.has_fired()),
                    })
                    .collect();
                // Firing first, then the most recent.
                list.sort_by_key(|a| (a.state != AlertState::Firing, -a.updated_at_ms));
                if list.is_empty() {
                    view! { <p class="empty">"No alerts."</p> }.into_any()
                } else {
                    list.into_iter()
                        .map(|a| view! { <AlertCard alert=a show_run=run.is_none() /> })
                        .collect_view()
                        .into_any()
                }
            }
        }}
    }
}

#[component]
pub(crate) fn AlertsPage() -> impl IntoView {
    let params = use_params_map();
    let in_run = params.with_untracked(|p| p.get("run").is_some());
    if in_run {
        let view = RunView::new();
        view! {
            <RunHeader view=view current="alerts" />
            <AlertList run=Some(view.run) />
        }
        .into_any()
    } else {
        view! {
            <h1>"Alerts"</h1>
            <AlertList run=None />
        }
        .into_any()
    }
}
