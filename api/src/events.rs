//! The server-sent events of `GET /api/v1/events`. Each event's SSE name is its `type`, and
//! its data is the JSON object below, `type` included.

use serde::{Deserialize, Serialize};

use crate::alerts::Alert;

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// New samples arrived for a run.
    Samples {
        run: String,
        rows: u64,
        first_step: u64,
        last_step: u64,
    },
    /// A run announced (or changed) its metadata.
    Run { run: String, world_size: u32 },
    /// An alert changed state.
    Alert { alert: Box<Alert> },
    /// A run was deleted (by hand or by retention): drop it from any view.
    RunDeleted { run: String },
    /// This subscriber was too slow and missed `missed` events; re-query what it shows.
    Lagged { missed: u64 },
}

impl Event {
    /// Every event name, for a client that subscribes to each.
    pub const NAMES: [&'static str; 5] = ["samples", "run", "alert", "run_deleted", "lagged"];

    /// The SSE event name: the `type` field.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Samples { .. } => "samples",
            Event::Run { .. } => "run",
            Event::Alert { .. } => "alert",
            Event::RunDeleted { .. } => "run_deleted",
            Event::Lagged { .. } => "lagged",
        }
    }

    /// The run it is about, if any.
    pub fn run(&self) -> Option<&str> {
        match self {
            Event::Samples { run, .. } | Event::Run { run, .. } | Event::RunDeleted { run } => {
                Some(run)
            }
            Event::Alert { alert } => Some(&alert.run),
            Event::Lagged { .. } => None,
        }
    }
}
