//! rankwatch's web dashboard: a Leptos client-side app compiled to wasm and embedded in the
//! collector, which serves it at `/`.
//!
//! Pages: the runs list, a run's overview (loss, perplexity, gradient norm, learning rate and
//! user scalars, with the alert timeline drawn on every chart), its layers (a layer × step
//! heatmap and one layer's series), its workers (per-rank lines, dispersion, the rank × rank
//! cosine matrix) and the alerts. Every page reads the collector's JSON API; downsampling is
//! the server's. One server-sent-events connection keeps every page live ([`live`]).
//!
//! Failures are shown, never a blank page: each query's error is printed where its data would
//! be, and the header says when the collector cannot be reached.

// Leptos's `#[component]` expands a `pub(crate)` component into `pub` items of its own, which
// the workspace's `unreachable_pub` would refuse; nothing else here is `pub` beyond `start`.
#![allow(unreachable_pub)]

mod api;
mod chart;
mod fetch;
mod format;
mod live;
mod pages;

use leptos::prelude::*;
use leptos_router::components::{A, Route, Router, Routes};
use leptos_router::path;
use wasm_bindgen::prelude::wasm_bindgen;

use live::Link;

/// Entry point, called by the generated JS once the module is loaded.
#[wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
    leptos::mount::mount_to_body(App);
}

#[component]
fn App() -> impl IntoView {
    provide_context(fetch::TokenWanted(RwSignal::new(None)));
    let live = live::start();
    provide_context(live);
    view! {
        <Router>
            <header class="top">
                <A href="/">
                    <span class="brand">"rankwatch"</span>
                </A>
                <nav>
                    <A href="/">"Runs"</A>
                    <A href="/alerts">"Alerts"</A>
                </nav>
                <span
                    class="link"
                    class:down=move || live.link.get() == Link::Reconnecting
                    data-link=move || format!("{:?}", live.link.get()).to_lowercase()
                >
                    {move || live.link.get().label()}
                </span>
            </header>
            <pages::TokenPrompt />
            <main>
                <Routes fallback=|| {
                    view! {
                        <p class="error">"No such page. "<A href="/">"Back to the runs"</A></p>
                    }
                }>
                    <Route path=path!("/") view=pages::runs::RunsPage />
                    <Route path=path!("/alerts") view=pages::alerts::AlertsPage />
                    <Route path=path!("/runs/:run") view=pages::overview::OverviewPage />
                    <Route path=path!("/runs/:run/layers") view=pages::layers::LayersPage />
                    <Route path=path!("/runs/:run/workers") view=pages::workers::WorkersPage />
                    <Route path=path!("/runs/:run/alerts") view=pages::alerts::AlertsPage />
                </Routes>
            </main>
        </Router>
    }
}
