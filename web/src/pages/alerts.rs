//! Incidents — alerts grouped by cause (the collector groups them) — with the cause first,
//! the ranks, layers and sites they touch, acknowledge and silence buttons, and each alert's
//! explanation and link to the layer or worker view at its step. At `/alerts` every run's; at
//! `/runs/:run/alerts` one run's.

use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use super::{ErrorBox, RunHeader, RunView};
use crate::api::{self, Alert, Incident, Matchers, NewSilence};
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

/// What the incident touches, in a few words.
fn scope(i: &Incident) -> String {
    let mut parts = Vec::new();
    if !i.layers.is_empty() {
        parts.push(match i.layers.as_slice() {
            [one] => format!("layer {one}"),
            many => format!("{} layers", many.len()),
        });
    }
    if i.every_rank {
        parts.push("every rank".to_owned());
    } else if !i.ranks.is_empty() {
        let ranks: Vec<String> = i.ranks.iter().map(u32::to_string).collect();
        parts.push(format!("rank {}", ranks.join(", ")));
    }
    if parts.is_empty() {
        "whole run".into()
    } else {
        parts.join(" · ")
    }
}

/// One incident: its cause and scope, acknowledge and silence, and its alerts (cause first).
#[component]
fn IncidentCard(incident: Incident, show_run: bool, changed: RwSignal<u32>) -> impl IntoView {
    let failed = RwSignal::new(None::<String>);
    let id = incident.id.clone();
    let acknowledged = incident.acknowledged.clone();
    let act = move |what: &'static str| {
        let id = id.clone();
        leptos::task::spawn_local(async move {
            let outcome = match what {
                "ack" => api::acknowledge(&id, &api::user_name()).await.map(|_| ()),
                _ => api::unacknowledge(&id).await.map(|_| ()),
            };
            match outcome {
                Ok(()) => {
                    let _ = failed.try_set(None);
                    let _ = changed.try_update(|n| *n += 1);
                }
                Err(e) => {
                    let _ = failed.try_set(Some(e.to_string()));
                }
            }
        });
    };
    // A silence per rule of the incident, on its run, for an hour.
    let silence_rules: Vec<(String, Rule)> = incident
        .rules
        .iter()
        .map(|r| (incident.run.clone(), *r))
        .collect();
    let silence = move |_| {
        let rules = silence_rules.clone();
        leptos::task::spawn_local(async move {
            for (run, rule) in rules {
                let request = NewSilence {
                    matchers: Matchers {
                        run: Some(run),
                        rule: Some(rule),
                        ..Matchers::default()
                    },
                    duration_s: 3600,
                    created_by: api::user_name(),
                    comment: "silenced from the dashboard".to_owned(),
                };
                if let Err(e) = api::silence(&request).await {
                    let _ = failed.try_set(Some(e.to_string()));
                    return;
                }
            }
            let _ = failed.try_set(None);
            let _ = changed.try_update(|n| *n += 1);
        });
    };
    let steps = if incident.first_step == incident.last_step {
        format!("step {}", incident.first_step)
    } else {
        format!("steps {}–{}", incident.first_step, incident.last_step)
    };
    let open = incident.state != AlertState::Resolved;
    let count = incident.alerts.len();
    let act_ack = act.clone();
    view! {
        <section
            class=format!("incident {} {}", incident.severity, incident.state)
            data-incident=incident.id.clone()
            data-state=incident.state.as_str()
            data-alerts=count.to_string()
            data-every-rank=incident.every_rank.to_string()
            data-acknowledged=acknowledged.is_some().to_string()
            data-silenced=(!incident.silenced_by.is_empty()).to_string()
        >
            <header>
                <span class="sev">{incident.severity.as_str()}</span>
                <span class="state">{incident.state.as_str()}</span>
                {show_run.then(|| view! { <span class="run">{format!("run {}", incident.run)}</span> })}
                <span class="where">{scope(&incident)}</span>
                <span class="steps">{steps}</span>
                {acknowledged.clone().map(|a| view! { <span class="ack">{format!("acknowledged by {}", a.by)}</span> })}
                {(!incident.silenced_by.is_empty()).then(|| view! { <span class="silenced">"silenced"</span> })}
            </header>
            <p class="summary">{incident.summary.clone()}</p>
            {(open && !incident.action.is_empty()).then(|| view! {
                <p class="action"><strong>"What to do: "</strong>{incident.action.clone()}</p>
            })}
            {open.then(|| view! {
                <div class="actions">
                    {if acknowledged.is_some() {
                        view! { <button class="unack" on:click=move |_| act("unack")>"Unacknowledge"</button> }.into_any()
                    } else {
                        view! { <button class="ack" on:click=move |_| act_ack("ack")>"Acknowledge"</button> }.into_any()
                    }}
                    <button class="silence" on:click=silence>"Silence 1 h"</button>
                </div>
            })}
            {move || failed.get().map(|e| view! { <span class="error" role="alert">{e}</span> })}
            <details open={count == 1}>
                <summary>{format!("{count} alert{}", if count == 1 { "" } else { "s" })}</summary>
                {incident.alerts.into_iter().map(|a| view! { <AlertCard alert=a show_run=false /> }).collect_view()}
            </details>
        </section>
    }
}

#[component]
fn IncidentList(run: Option<Memo<String>>) -> impl IntoView {
    let live = expect_context::<Live>();
    let state = RwSignal::new("open".to_owned());
    let changed = RwSignal::new(0u32);
    let user = RwSignal::new(api::user_name());
    let incidents = fetched(move || {
        let run = run.map(|r| r.get());
        live.alerts.track();
        changed.track();
        Some(async move { api::incidents(run.as_deref()).await })
    });
    view! {
        <div class="controls">
            <label>
                "show "
                <select class="state-filter" on:change=move |ev| state.set(event_target_value(&ev))>
                    <option value="open">"open, then resolved"</option>
                    <option value="firing">"firing"</option>
                    <option value="unacknowledged">"firing, not acknowledged"</option>
                    <option value="resolved">"resolved"</option>
                </select>
            </label>
            <label>
                " acting as "
                <input class="user" prop:value=move || user.get() on:change=move |ev| {
                    let name = event_target_value(&ev);
                    api::set_user_name(&name);
                    user.set(api::user_name());
                } />
            </label>
        </div>
        {move || match incidents.get() {
            None => view! { <p class="loading">"Loading…"</p> }.into_any(),
            Some(Err(e)) => view! { <ErrorBox error=e /> }.into_any(),
            Some(Ok(answer)) => {
                let want = state.get();
                // The collector orders them: open first, then by severity and onset.
                let list: Vec<Incident> = answer
                    .incidents
                    .into_iter()
                    .filter(|i| match want.as_str() {
                        "firing" => i.state == AlertState::Firing,
                        "unacknowledged" => i.state == AlertState::Firing && i.acknowledged.is_none(),
                        "resolved" => i.state == AlertState::Resolved,
                        _ => true,
                    })
                    .collect();
                if list.is_empty() {
                    view! { <p class="empty">"No incidents."</p> }.into_any()
                } else {
                    list.into_iter()
                        .map(|i| view! { <IncidentCard incident=i show_run=run.is_none() changed=changed /> })
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
            <IncidentList run=Some(view.run) />
        }
        .into_any()
    } else {
        view! {
            <h1>"Alerts"</h1>
            <IncidentList run=None />
        }
        .into_any()
    }
}
