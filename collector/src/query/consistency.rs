//! `GET /runs/{run}/consistency`: the run's per-rank loss and gradient norm, and the aligner's
//! C_w, read once and handed to [`rankwatch_analytics::consistency::assess`].

use std::collections::BTreeMap;

use arrow_array::Array;
use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt32Type, UInt64Type};
use datafusion::prelude::{col, lit};
use rankwatch_analytics::consistency::{StepValues, assess};
use rankwatch_api::ConsistencyReport;
use serde::Deserialize;

use super::Queries;
use crate::entry::Table;
use crate::error::Result;

/// Parameters of `GET /runs/{run}/consistency`: the step range (default: the whole run).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsistencyQuery {
    pub from: Option<u64>,
    pub to: Option<u64>,
}

impl Queries {
    /// `GET /runs/{run}/consistency`.
    pub async fn consistency(&self, run: &str, q: ConsistencyQuery) -> Result<ConsistencyReport> {
        let run = self.known_run(run)?;
        let (from, to) = self.range(&run, q.from, q.to)?;
        let world = self.store().world_size(&run);
        let in_range = col("step").gt_eq(lit(from)).and(col("step").lt_eq(lit(to)));
        let per_rank = col("rank")
            .is_not_null()
            .and(col("layer").is_null())
            .and(col("metric").in_list(vec![lit("loss"), lit("grad_norm")], false));
        let aligner = col("rank")
            .is_null()
            .and(col("metric").eq(lit("cos_weighted")));
        let batches = self
            .scan(
                Table::Samples,
                &run,
                in_range.and(per_rank.or(aligner)),
                &["step", "metric", "rank", "value"],
            )
            .await?;
        let mut steps: BTreeMap<u64, StepValues> = BTreeMap::new();
        for b in &batches {
            let step = b.column(0).as_primitive::<UInt64Type>();
            let metric = b.column(1).as_string::<i32>();
            let rank = b.column(2).as_primitive::<UInt32Type>();
            let value = b.column(3).as_primitive::<Float64Type>();
            for i in 0..b.num_rows() {
                let s = step.value(i);
                let at = steps.entry(s).or_insert_with(|| StepValues {
                    step: s,
                    ..StepValues::default()
                });
                let v = value.value(i);
                if rank.is_null(i) {
                    at.cos_weighted = Some(v);
                    continue;
                }
                let slot = at.ranks.entry(rank.value(i)).or_default();
                match metric.value(i) {
                    "loss" => slot.0 = Some(v),
                    _ => slot.1 = Some(v),
                }
            }
        }
        Ok(assess(run.as_str(), world, steps.into_values().collect()))
    }
}
