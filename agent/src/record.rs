//! What the training thread hands to the agent: compact points that share their validated
//! metric name, a gradient sketch, or the run's metadata.
//!
//! A [`Metric`] handle is validated once (vocabulary or `user/<name>`) and then cloned for the
//! price of a reference count, so logging 200 scalars costs 200 small copies, not 200 string
//! allocations and vocabulary look-ups.

use std::sync::Arc;

use rankwatch_analytics::record::check_shape;
use rankwatch_analytics::{MetricName, RunInfo, Site, SketchRecord, vocab};

use crate::error::{Error, Result};

/// A validated metric name, cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Metric(Arc<MetricInner>);

#[derive(Debug, PartialEq, Eq, Hash)]
struct MetricInner {
    name: MetricName,
    known: Option<vocab::Metric>,
}

impl Metric {
    /// Validates `name` (a vocabulary metric or `user/<name>`).
    pub fn new(name: &str) -> Result<Metric> {
        let name = MetricName::new(name)?;
        let known = name.known();
        Ok(Metric(Arc::new(MetricInner { name, known })))
    }

    /// The wire name.
    pub fn as_str(&self) -> &str {
        self.0.name.as_str()
    }

    /// The vocabulary metric, if the name is one.
    pub fn known(&self) -> Option<vocab::Metric> {
        self.0.known
    }
}

impl From<vocab::Metric> for Metric {
    fn from(m: vocab::Metric) -> Self {
        Metric(Arc::new(MetricInner {
            name: MetricName::from(m),
            known: Some(m),
        }))
    }
}

/// One value of one series at the step of its [`Record::Points`].
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub metric: Metric,
    /// `None`: the value holds for all ranks (weights under data parallelism).
    pub rank: Option<u32>,
    pub layer: Option<u32>,
    pub site: Option<Site>,
    pub value: f64,
}

impl Point {
    /// Checks rank, layer and site against the metric's scope and the run's shape.
    pub fn validate(&self, run: Option<&RunInfo>) -> Result<()> {
        check_shape(
            self.metric_name(),
            self.metric.known(),
            self.rank,
            self.layer,
            self.site,
            run,
        )
        .map_err(|e| Error::InvalidSample(e.to_string()))
    }

    fn metric_name(&self) -> &MetricName {
        &self.metric.0.name
    }
}

/// One item of the agent's queue.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Values measured at one step.
    Points {
        step: u64,
        time_ms: i64,
        points: Vec<Point>,
    },
    /// A gradient sketch.
    Sketch(SketchRecord),
    /// The run's metadata (sent once, and again when it changes).
    Info(RunInfo),
}

impl Record {
    /// Rows this record adds to the tables (what a drop loses).
    pub fn rows(&self) -> u64 {
        match self {
            Record::Points { points, .. } => points.len() as u64,
            Record::Sketch(_) | Record::Info(_) => 1,
        }
    }
}
