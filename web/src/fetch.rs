//! Data that follows signals: a query re-runs when what it reads changes, and the page keeps
//! showing the previous answer until a newer one arrives (no flicker on live refresh). Answers
//! are shown in the order their queries started; one that arrives after a newer answer was
//! shown is dropped. An answer is not held back because a newer query is still running: on a
//! live run whose refreshes come faster than a loaded collector answers, waiting for the
//! latest query showed nothing at all (the worker view stayed empty under CI's load).

use std::future::Future;

use leptos::prelude::*;
use leptos::task::spawn_local;

use crate::api::{ApiError, ApiResult};

/// Set to the collector's message when a query was refused for want of a read token; the
/// header then asks for one. Provided once, at the app's root.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenWanted(pub(crate) RwSignal<Option<String>>);

/// The state of a query: nothing yet, or the latest answer.
pub(crate) type Fetched<T> = ReadSignal<Option<ApiResult<T>>>;

/// Runs `query` now and whenever the signals it reads (synchronously, before its future)
/// change. `query` returns `None` while its inputs are not ready.
pub(crate) fn fetched<T, F, Fut>(query: F) -> Fetched<T>
where
    T: Send + Sync + 'static,
    F: Fn() -> Option<Fut> + 'static,
    Fut: Future<Output = ApiResult<T>> + 'static,
{
    let (value, set_value) = signal(None::<ApiResult<T>>);
    let latest = StoredValue::new(0u64);
    // The ticket of the answer shown.
    let shown = StoredValue::new(0u64);
    let wanted = use_context::<TokenWanted>();
    Effect::new(move |_| {
        let Some(future) = query() else { return };
        let ticket = latest.get_value().wrapping_add(1);
        latest.set_value(ticket);
        spawn_local(async move {
            let answer = future.await;
            if let (Err(ApiError::Unauthorized(msg)), Some(wanted)) = (&answer, wanted) {
                let _ = wanted.0.try_set(Some(msg.clone()));
            }
            let newer = shown.try_update_value(|s| {
                let newer = ticket > *s;
                if newer {
                    *s = ticket;
                }
                newer
            });
            if newer == Some(true) {
                // A failed refresh keeps what is shown when the collector is only unreachable:
                // the page stays usable while it restarts (the header says so).
                let keep = matches!(answer, Err(ApiError::Unreachable))
                    && value
                        .try_with_untracked(|v| matches!(v, Some(Ok(_))))
                        .unwrap_or(false);
                if !keep {
                    // The page may have gone meanwhile; then there is nothing to update.
                    let _ = set_value.try_set(Some(answer));
                }
            }
        });
    });
    value
}

/// The error of a query's latest answer, if it failed.
pub(crate) fn error_of<T>(answer: &Option<ApiResult<T>>) -> Option<ApiError> {
    answer.as_ref()?.as_ref().err().cloned()
}
