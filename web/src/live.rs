//! Live updates: one server-sent-events connection for the whole app, turned into a few
//! signals pages can depend on.
//!
//! A training job stores a batch many times a second; re-querying every chart on each event
//! would load the collector more than the job does. Events therefore only mark what changed
//! (which runs got samples, whether an alert moved), and a one-second timer turns the marks
//! into revision bumps, so a page refreshes at most once a second however fast data arrives.
//!
//! When the connection drops (the collector restarting), the browser's `EventSource` retries
//! on its own; the page says "reconnecting" meanwhile and re-queries everything once it is
//! back, since events sent while it was away are lost. When a read token is in use, an
//! `EventSource` cannot carry it, and the app polls every five seconds instead.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use leptos::prelude::*;
use rankwatch_api::Event;
use wasm_bindgen::JsCast;
use wasm_bindgen::closure::Closure;

/// The state of the live connection, shown in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    Connecting,
    Live,
    Reconnecting,
    /// Polling because a read token is in use.
    Polling,
}

impl Link {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Link::Connecting => "connecting…",
            Link::Live => "live",
            Link::Reconnecting => "collector unreachable — reconnecting…",
            Link::Polling => "polling every 5 s",
        }
    }
}

/// Signals shared through context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Live {
    pub(crate) link: RwSignal<Link>,
    /// Per run, a counter bumped (at most once a second) when the run got samples; the key
    /// `*` is bumped when everything must be re-queried.
    pub(crate) samples: RwSignal<BTreeMap<String, u64>>,
    /// Bumped when any alert changed state.
    pub(crate) alerts: RwSignal<u64>,
    /// Bumped when runs appeared or announced metadata.
    pub(crate) runs: RwSignal<u64>,
}

impl Live {
    /// A revision that changes whenever `run` got new samples (or everything must be
    /// re-queried). Read it through a `Memo` so other runs' data does not wake the page.
    pub(crate) fn run_revision(&self, run: &str) -> u64 {
        self.samples.with(|m| {
            m.get(run)
                .copied()
                .unwrap_or(0)
                .wrapping_add(m.get("*").copied().unwrap_or(0))
        })
    }

    fn bump_runs(&self, runs: impl IntoIterator<Item = String>) {
        self.samples.update(|m| {
            for run in runs {
                *m.entry(run).or_default() += 1;
            }
        });
    }
}

#[derive(Default)]
struct Pending {
    runs: BTreeSet<String>,
    alerts: bool,
    run_meta: bool,
    everything: bool,
}

/// Opens the connection and starts the refresh timer; call once, at start-up.
pub(crate) fn start() -> Live {
    let live = Live {
        link: RwSignal::new(Link::Connecting),
        samples: RwSignal::new(BTreeMap::new()),
        alerts: RwSignal::new(0),
        runs: RwSignal::new(0),
    };
    let pending = Rc::new(RefCell::new(Pending::default()));
    let Some(window) = web_sys::window() else {
        return live;
    };
    if crate::api::read_token().is_some() {
        live.link.set(Link::Polling);
        every(&window, 5000, move || {
            live.bump_runs(["*".to_owned()]);
            live.alerts.update(|n| *n += 1);
            live.runs.update(|n| *n += 1);
        });
        return live;
    }
    connect(live, pending.clone());
    let flush = move || {
        let mut p = pending.borrow_mut();
        if p.everything {
            p.runs.insert("*".into());
        }
        if !p.runs.is_empty() {
            live.bump_runs(std::mem::take(&mut p.runs));
        }
        if p.alerts || p.everything {
            live.alerts.update(|n| *n += 1);
        }
        if p.run_meta || p.everything {
            live.runs.update(|n| *n += 1);
        }
        *p = Pending::default();
    };
    every(&window, 1000, flush);
    live
}

fn every(window: &web_sys::Window, ms: i32, f: impl FnMut() + 'static) {
    let tick = Closure::<dyn FnMut()>::new(f);
    let _ = window
        .set_interval_with_callback_and_timeout_and_arguments_0(tick.as_ref().unchecked_ref(), ms);
    // The timer lives as long as the page.
    tick.forget();
}

fn connect(live: Live, pending: Rc<RefCell<Pending>>) {
    let Ok(source) = web_sys::EventSource::new("/api/v1/events") else {
        live.link.set(Link::Reconnecting);
        retry_later(live, pending);
        return;
    };
    let was_down = Rc::new(Cell::new(false));
    {
        let pending = pending.clone();
        let was_down = was_down.clone();
        let on_open = Closure::<dyn FnMut()>::new(move || {
            live.link.set(Link::Live);
            // Whatever happened while the connection was down was not sent; re-query all.
            if was_down.replace(false) {
                pending.borrow_mut().everything = true;
            }
        });
        source.set_onopen(Some(on_open.as_ref().unchecked_ref()));
        on_open.forget();
    }
    {
        let pending = pending.clone();
        let source2 = source.clone();
        let on_error = Closure::<dyn FnMut()>::new(move || {
            live.link.set(Link::Reconnecting);
            was_down.set(true);
            // CLOSED means the browser gave up (a non-retryable answer); start over later.
            if source2.ready_state() == web_sys::EventSource::CLOSED {
                retry_later(live, pending.clone());
            }
        });
        source.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        on_error.forget();
    }
    // One listener per event the contract defines; each event only marks what changed.
    for name in Event::NAMES {
        let pending = pending.clone();
        let on_event =
            Closure::<dyn FnMut(web_sys::MessageEvent)>::new(move |e: web_sys::MessageEvent| {
                let parsed = e
                    .data()
                    .as_string()
                    .map(|d| serde_json::from_str::<Event>(&d));
                let mut p = pending.borrow_mut();
                match parsed {
                    Some(Ok(event)) => p.mark(&event),
                    // An event this dashboard cannot read: re-query everything rather than miss it.
                    _ => p.everything = true,
                }
            });
        let _ = source.add_event_listener_with_callback(name, on_event.as_ref().unchecked_ref());
        on_event.forget();
    }
}

impl Pending {
    /// Marks what `event` changed, for the next refresh.
    fn mark(&mut self, event: &Event) {
        match event {
            Event::Samples { run, .. } => {
                self.runs.insert(run.clone());
            }
            Event::Run { run, .. } => {
                self.run_meta = true;
                self.runs.insert(run.clone());
            }
            Event::Alert { .. } => {
                self.alerts = true;
                self.run_meta = true;
            }
            // The run's pages re-query (and say it is gone); lists and alerts drop it.
            Event::RunDeleted { run } => {
                self.runs.insert(run.clone());
                self.run_meta = true;
                self.alerts = true;
            }
            Event::Lagged { .. } => self.everything = true,
        }
    }
}

fn retry_later(live: Live, pending: Rc<RefCell<Pending>>) {
    let Some(window) = web_sys::window() else {
        return;
    };
    let again = Closure::once_into_js(move || {
        pending.borrow_mut().everything = true;
        connect(live, pending);
    });
    let _ =
        window.set_timeout_with_callback_and_timeout_and_arguments_0(again.unchecked_ref(), 2000);
}
