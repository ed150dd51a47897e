//! The runs list: every run with its status, world size, last step and firing alerts,
//! filtered by name.

use leptos::prelude::*;
use leptos_router::components::A;

use super::ErrorBox;
use rankwatch_api::{AlertState, Rule};

use crate::api::{self, Alerts as AlertsAnswer, RunSummary as RunInfo};
use crate::fetch::fetched;
use crate::format;
use crate::live::Live;

/// A run with no data for this long is no longer live (the stale-rank rule's default).
const LIVE_FOR_MS: i64 = 60_000;

/// What the runs page says about a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Live,
    /// Quiet, with ranks reported lost (a firing stale-rank alert).
    Stale,
    /// Quiet, with nothing lost: the job ended. (The agent sends no end marker; a run that
    /// stopped everywhere at once reads as finished.)
    Finished,
    Waiting,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Live => "live",
            Status::Stale => "stale",
            Status::Finished => "finished",
            Status::Waiting => "waiting",
        }
    }
}

fn status(run: &RunInfo, alerts: &AlertsAnswer, now: i64) -> Status {
    let stale = alerts
        .alerts
        .iter()
        .any(|a| a.run == run.run && a.rule == Rule::StaleRank && a.state == AlertState::Firing);
    match run.last_seen_ms {
        None => Status::Waiting,
        Some(_) if stale => Status::Stale,
        Some(seen) if now - seen <= LIVE_FOR_MS => Status::Live,
        Some(_) => Status::Finished,
    }
}

#[component]
pub(crate) fn RunsPage() -> impl IntoView {
    let live = expect_context::<Live>();
    let runs = fetched(move || {
        live.runs.track();
        live.samples.track();
        Some(async { api::runs().await })
    });
    let alerts = fetched(move || {
        live.alerts.track();
        Some(async { api::alerts(None).await })
    });
    let filter = RwSignal::new(String::new());
    let table = move |answer: api::Runs| {
        let needle = filter.get().to_lowercase();
        let alerts = match alerts.get() {
            Some(Ok(a)) => a,
            _ => AlertsAnswer { alerts: Vec::new() },
        };
        let now = js_sys::Date::now() as i64;
        let rows: Vec<_> = answer
            .runs
            .into_iter()
            .filter(|r| needle.is_empty() || r.run.to_lowercase().contains(&needle))
            .collect();
        if rows.is_empty() {
            let text = if needle.is_empty() {
                "No runs yet. Start a training job with rankwatch.init(…) pointing at this collector."
            } else {
                "No run matches the filter."
            };
            return view! { <p class="empty">{text}</p> }.into_any();
        }
        view! {
            <table class="runs">
                <thead>
                    <tr>
                        <th>"run"</th>
                        <th>"status"</th>
                        <th>"world size"</th>
                        <th>"layers"</th>
                        <th>"steps"</th>
                        <th>"last seen"</th>
                        <th>"firing alerts"</th>
                    </tr>
                </thead>
                <tbody>
                    {rows
                        .into_iter()
                        .map(|r| {
                            let st = status(&r, &alerts, now);
                            let href = format!("/runs/{}", api::enc(&r.run));
                            let name = r.run.clone();
                            let label = r.run.clone();
                            let steps = match (r.first_step, r.last_step) {
                                (Some(a), Some(b)) => format!("{a}–{b}"),
                                _ => "–".into(),
                            };
                            view! {
                                <tr data-run=name>
                                    <td>
                                        <A href=href>{label}</A>
                                    </td>
                                    <td>
                                        <span class=format!(
                                            "status {}",
                                            st.label(),
                                        )>{st.label()}</span>
                                    </td>
                                    <td>{r.world_size.map_or("–".into(), |w| w.to_string())}</td>
                                    <td>{r.layers.map_or("–".into(), |w| w.to_string())}</td>
                                    <td>{steps}</td>
                                    <td>{format::ago(r.last_seen_ms)}</td>
                                    <td class:firing={r.alerts_firing > 0} data-firing=r.alerts_firing>
                                        {r.alerts_firing}
                                    </td>
                                </tr>
                            }
                        })
                        .collect_view()}
                </tbody>
            </table>
        }
        .into_any()
    };
    view! {
        <h1>"Runs"</h1>
        <input
            class="filter"
            type="search"
            placeholder="filter by name"
            prop:value=move || filter.get()
            on:input=move |ev| filter.set(event_target_value(&ev))
        />
        {move || match runs.get() {
            None => view! { <p class="loading">"Loading…"</p> }.into_any(),
            Some(Err(e)) => view! { <ErrorBox error=e /> }.into_any(),
            Some(Ok(answer)) => table(answer),
        }}
    }
}
