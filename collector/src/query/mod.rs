//! Read queries: DataFusion over the Parquet files ∪ the hot buffer of a run.
//!
//! A query takes a [`TableView`](crate::store::TableView) of the store (files and in-memory
//! batches, consistent with each other), scans both with the same filter — pushed down into
//! Parquet, where row-group and page statistics on the sort columns skip everything else — and
//! unions them. The endpoints then shape the rows in Rust (downsampling, grids, matrices),
//! which keeps non-finite handling explicit. Runs and catalogs come from the run index. The
//! dashboard's two hottest reads, series and heatmaps, read local parts without DataFusion:
//! the planner (`plan`) picks rollup windows and raw step ranges, and the point reader
//! (`parts`) reads those rows straight from each part through a cached series index.

mod bounded;
mod budget;
pub mod consistency;
mod depth;
pub mod downsample;
mod guard;
pub mod json;
mod parts;
mod plan;
pub mod views;

use std::sync::Arc;
use std::time::Duration;

use arrow_array::RecordBatch;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{
    DataFrame, Expr, ParquetReadOptions, SQLOptions, SessionConfig, SessionContext, lit,
};
use futures_util::{FutureExt, StreamExt};
use rankwatch_analytics::RunId;
use rankwatch_analytics::schema::{alerts, runs};

use crate::entry::Table;
use crate::error::{Error, Result};
use crate::store::{Store, files};

/// The read side: DataFusion over the store's Parquet files and hot buffer, and the
/// dashboard's views. (Not to be confused with the alert engine, [`crate::alerting`].)
#[derive(Clone)]
pub struct Queries {
    store: Arc<Store>,
    ctx: SessionContext,
    timeout: Duration,
    sql: SqlLimits,
    /// DataFusion's memory pool, shared by every query (for messages).
    memory: usize,
    /// Whether downsampled reads use the rollups (see [`plan`]); off only to compare.
    rollups: bool,
    /// Whether they read local parts directly ([`parts`]); off only to compare.
    point_reads: bool,
    parts: Arc<parts::PartIndexes>,
    /// Permits for SQL queries ([`SqlLimits::max_running`]), held until each query ends.
    running: Arc<tokio::sync::Semaphore>,
    /// Where SQL queries are planned and run.
    sql_runtime: Arc<SqlRuntime>,
}

/// The runtime SQL queries are planned and run on: threads of their own with deep stacks, for
/// the recursion DataFusion does over what it builds (which no check on the text bounds), so
/// that a planning that takes seconds without yielding holds one of these, not one of the
/// ingest runtime's workers. Long-lived: connections to object storage a query opens are
/// driven by it, and a pooled connection must not lose its driver when the query ends. Two
/// threads more than queries may run, so one is free to drive I/O while every query plans.
struct SqlRuntime {
    runtime: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
}

impl SqlRuntime {
    fn new(queries: usize) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(queries.clamp(1, 64) + 2)
            .thread_name("rankwatch-sql")
            .thread_stack_size(SQL_STACK_BYTES)
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        Ok(SqlRuntime {
            runtime: Some(runtime),
            handle,
        })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for SqlRuntime {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which async code may not do: let it go in the background.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl std::fmt::Debug for Queries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queries")
            .field("timeout", &self.timeout)
            .field("sql", &self.sql)
            .finish_non_exhaustive()
    }
}

/// The stack of each of the SQL runtime's threads: reserved, not committed, so what a query
/// does not use costs address space only. The debug build overflowed 2 MiB on a 97-term chain of
/// `||`, and on twenty `WITH` levels the optimiser merged into one expression 1,200 deep.
const SQL_STACK_BYTES: usize = 256 << 20;

/// What one `/api/v1/sql` answer may hold.
#[derive(Debug, Clone, Copy)]
pub struct SqlLimits {
    pub max_rows: usize,
    pub max_result_bytes: usize,
    /// Queries running at once, their threads included (`--max-concurrent-sql`).
    pub max_running: usize,
}

/// Functions whose result's size is set by an argument (`repeat('x', 2000000000)`,
/// `range(0, 1e10)`): DataFusion allocates it inside the function, outside the memory pool, so
/// `--query-memory` cannot bound it and four such queries at once took more than 20 GB.
const AMPLIFIERS: [&str; 7] = [
    "repeat",
    "lpad",
    "rpad",
    "range",
    "generate_series",
    "array_repeat",
    "array_resize",
];

/// Refuses a plan that calls one of the [`AMPLIFIERS`], naming it.
fn refuse_amplifiers(plan: &datafusion::logical_expr::LogicalPlan) -> Result<()> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let mut found = None;
    plan.apply_with_subqueries(|node| {
        node.apply_expressions(|expr| {
            expr.apply(|e| {
                if let datafusion::prelude::Expr::ScalarFunction(call) = e
                    && AMPLIFIERS.contains(&call.name())
                {
                    found = Some(call.name().to_owned());
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    })
    .map_err(|e| Error::Sql(e.to_string()))?;
    match found {
        Some(name) => Err(Error::Sql(format!(
            "function {name} is not available here: the size of its result is set by an \
             argument, and it is allocated outside the query memory limit (--query-memory)"
        ))),
        None => Ok(()),
    }
}

fn session(runtime: Arc<datafusion::execution::runtime_env::RuntimeEnv>) -> SessionContext {
    let mut config = SessionConfig::new()
        .with_target_partitions(2)
        .with_information_schema(true);
    let options = config.options_mut();
    options.execution.parquet.pushdown_filters = true;
    options.execution.parquet.reorder_filters = true;
    options.execution.parquet.enable_page_index = true;
    // The files carry no bloom filters; a dashboard read is small, and splitting a file into
    // byte ranges would read its footer and page index once per range.
    options.execution.parquet.bloom_filter_on_read = false;
    options.optimizer.repartition_file_scans = false;
    // File statistics would let DataFusion 55 replace a column whose min equals its max with
    // that value; Parquet leaves NaN out of a double's min and max, so a part's NaN would be
    // read as its other value (parts written before their doubles lost min/max still have them).
    options.execution.collect_statistics = false;
    SessionContext::new_with_config_rt(config, runtime)
}

impl Queries {
    /// Queries over `store`, all of them together within `memory` bytes: what can spill (sorts,
    /// aggregations) spills to `spill/` in the data directory, emptied here; what cannot fails
    /// naming the limit.
    pub fn new(
        store: Arc<Store>,
        timeout: Duration,
        sql: SqlLimits,
        memory: usize,
        read_cache: usize,
    ) -> Result<Self> {
        let spill = store.dir().join("spill");
        if spill.exists() {
            std::fs::remove_dir_all(&spill)?;
        }
        std::fs::create_dir_all(&spill)?;
        let runtime = Arc::new(
            RuntimeEnvBuilder::new()
                .with_memory_limit(memory, 1.0)
                .with_temp_file_path(spill)
                .build()?,
        );
        // Parts in object storage are read by URL (`s3://bucket/...`) through the same client
        // the store writes with.
        if let Some((url, object_store)) = store.backend().object_store() {
            runtime.register_object_store(url, object_store);
        }
        let counters = parts::Counters {
            builds: store.metrics().part_index_builds.clone(),
            rows_reused: store.metrics().read_cache_hits.clone(),
        };
        Ok(Queries {
            ctx: session(runtime),
            store,
            timeout,
            sql,
            memory,
            rollups: true,
            point_reads: true,
            running: Arc::new(tokio::sync::Semaphore::new(
                sql.max_running
                    .clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
            )),
            sql_runtime: Arc::new(SqlRuntime::new(sql.max_running)?),
            parts: Arc::new(parts::PartIndexes::new(
                parts::DEFAULT_BUDGET_BYTES,
                read_cache,
                counters,
            )),
        })
    }

    /// The same queries answering every downsampled read from raw rows alone: the reference
    /// the rollups are checked against.
    pub fn without_rollups(&self) -> Queries {
        Queries {
            rollups: false,
            ..self.clone()
        }
    }

    /// The same queries reading every part through DataFusion: the reference the point reads
    /// are checked against.
    pub fn without_point_reads(&self) -> Queries {
        Queries {
            point_reads: false,
            ..self.clone()
        }
    }

    /// A failed SQL query in words: over the memory pool is the collector's limit, not the
    /// query's mistake, and says so.
    fn sql_error(&self, e: datafusion::error::DataFusionError) -> Error {
        match e.find_root() {
            datafusion::error::DataFusionError::ResourcesExhausted(why) => Error::Sql(format!(
                "the query needs more memory than the collector's query memory ({} bytes, \
                 --query-memory) allows; filter on run and step or aggregate more: {why}",
                self.memory
            )),
            _ => Error::Sql(e.to_string()),
        }
    }

    /// The store queried.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    async fn with_timeout<T>(&self, work: impl Future<Output = Result<T>>) -> Result<T> {
        match tokio::time::timeout(self.timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(Error::Unavailable(format!(
                "query cancelled after {:?}; narrow the step range",
                self.timeout
            ))),
        }
    }

    /// A data frame over one table of one run (file schema, no `run` column).
    async fn frame(
        &self,
        ctx: &SessionContext,
        table: Table,
        run: &RunId,
    ) -> Result<Option<DataFrame>> {
        let view = self.store.view(table, run);
        let schema = files::file_schema(table);
        let mut frame: Option<DataFrame> = None;
        if !view.files.is_empty() {
            let backend = self.store.backend();
            let paths: Vec<String> = view.files.iter().map(|p| backend.location(p)).collect();
            let options = ParquetReadOptions::default().schema(&schema);
            frame = Some(ctx.read_parquet(paths, options).await?);
        }
        if !view.batches.is_empty() {
            let hot = ctx.read_batches(view.batches)?;
            frame = Some(match frame {
                Some(cold) => cold.union(hot)?,
                None => hot,
            });
        }
        Ok(frame)
    }

    /// Rows of `table` for `run` that pass `filter`, with the given columns.
    pub async fn scan(
        &self,
        table: Table,
        run: &RunId,
        filter: Expr,
        columns: &[&str],
    ) -> Result<Vec<RecordBatch>> {
        self.with_timeout(async {
            let Some(frame) = self.frame(&self.ctx, table, run).await? else {
                return Ok(Vec::new());
            };
            Ok(frame
                .filter(filter)?
                .select_columns(columns)?
                .collect()
                .await?)
        })
        .await
    }

    /// Rebuilds the run index from the Parquet files (at start, before log replay).
    pub async fn rebuild_index(&self) -> Result<()> {
        use arrow_array::Array;
        use arrow_array::cast::AsArray;
        use arrow_array::types::{Int64Type, TimestampMillisecondType, UInt32Type, UInt64Type};
        use datafusion::functions::math::expr_fn::isnan;
        use datafusion::functions_aggregate::expr_fn::{count, max, min, sum};
        use datafusion::prelude::{col, when};

        for run in self.store.runs_with_files(Table::Samples) {
            let Some(frame) = self.frame(&self.ctx, Table::Samples, &run).await? else {
                continue;
            };
            let value = || col("value");
            let nonfinite = when(
                isnan(value())
                    .or(value().eq(lit(f64::INFINITY)))
                    .or(value().eq(lit(f64::NEG_INFINITY))),
                lit(1i64),
            )
            .otherwise(lit(0i64))?;
            let batches = frame
                .aggregate(
                    vec![col("metric"), col("layer"), col("site"), col("rank")],
                    vec![
                        count(lit(1i64)).alias("n"),
                        sum(nonfinite).alias("nonfinite"),
                        min(col("step")).alias("first"),
                        max(col("step")).alias("last"),
                        max(col("time")).alias("time"),
                    ],
                )?
                .collect()
                .await?;
            self.store.with_run_mut(&run, |summary| {
                for b in &batches {
                    let metric = b.column(0).as_string::<i32>();
                    let layer = b.column(1).as_primitive::<UInt32Type>();
                    let site = b.column(2).as_string::<i32>();
                    let rank = b.column(3).as_primitive::<UInt32Type>();
                    let n = b.column(4).as_primitive::<Int64Type>();
                    let nf = b.column(5).as_primitive::<Int64Type>();
                    let first = b.column(6).as_primitive::<UInt64Type>();
                    let last = b.column(7).as_primitive::<UInt64Type>();
                    let time = b.column(8).as_primitive::<TimestampMillisecondType>();
                    for i in 0..b.num_rows() {
                        let key = crate::store::index::SeriesKey {
                            metric: Arc::from(metric.value(i)),
                            layer: layer.is_valid(i).then(|| layer.value(i)),
                            site: site
                                .is_valid(i)
                                .then(|| site.value(i).parse().ok())
                                .flatten(),
                            rank: rank.is_valid(i).then(|| rank.value(i)),
                        };
                        summary.add_rebuilt(
                            key,
                            n.value(i) as u64,
                            nf.value(i) as u64,
                            (first.value(i), last.value(i)),
                            time.value(i),
                        );
                    }
                }
            });
        }
        for f in self
            .store
            .files()
            .iter()
            .filter(|f| f.table == Table::Sketches.as_str())
        {
            self.store.with_run_mut(&f.run, |s| s.sketches += f.rows);
        }
        Ok(())
    }

    /// Runs read-only SQL over `samples`, `sketches`, `runs` and `alerts` (every run, with a
    /// `run` column). Returns the rows and whether the row limit cut the answer.
    pub async fn sql(&self, sql: &str) -> Result<(Vec<RecordBatch>, bool)> {
        // The query holds its permit to its end: a client that hangs up does not free it while
        // the query still runs.
        let permit = Arc::clone(&self.running).try_acquire_owned().map_err(|_| {
            Error::Busy(format!(
                "{} SQL queries are still running (--max-concurrent-sql), some for clients \
                 that hung up; retry",
                self.sql.max_running
            ))
        })?;
        let (queries, sql) = (self.clone(), sql.to_owned());
        let running = self.sql_runtime.handle().spawn(async move {
            let answer = queries.sql_caught(&sql).await;
            drop(permit);
            answer
        });
        // The query's own deadline is checked where it can yield; a planning that does not
        // is answered from here, and ends when it ends.
        let deadline = self.timeout + Duration::from_secs(5);
        match tokio::time::timeout(deadline, running).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => Err(Error::Sql(format!(
                "the query's task ended unanswered: {e}"
            ))),
            Err(_) => Err(Error::Unavailable(format!(
                "query cancelled after {:?}; narrow the step range",
                self.timeout
            ))),
        }
    }

    async fn sql_caught(&self, sql: &str) -> Result<(Vec<RecordBatch>, bool)> {
        // A panic inside the engine (arrow's offset overflow, say) answers this query with an
        // error instead of ending its thread unanswered.
        let answer = std::panic::AssertUnwindSafe(self.sql_answer(sql)).catch_unwind();
        answer.await.unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(Error::Sql(format!(
                "the query failed inside the query engine ({why}); filter on run and step, or \
                 select fewer columns"
            )))
        })
    }

    async fn sql_answer(&self, sql: &str) -> Result<(Vec<RecordBatch>, bool)> {
        self.with_timeout(async {
            let ctx = session(self.ctx.runtime_env());
            for table in [Table::Samples, Table::Sketches] {
                let mut all: Option<DataFrame> = None;
                for run in self
                    .store
                    .with_runs(|r| r.keys().cloned().collect::<Vec<_>>())
                {
                    let Some(frame) = self.frame(&ctx, table, &run).await? else {
                        continue;
                    };
                    let mut columns = vec![lit(run.as_str()).alias("run")];
                    columns.extend(
                        files::file_schema(table)
                            .fields()
                            .iter()
                            .map(|f| datafusion::prelude::col(f.name().as_str())),
                    );
                    let frame = frame.select(columns)?;
                    all = Some(match all {
                        Some(a) => a.union(frame)?,
                        None => frame,
                    });
                }
                let frame = match all {
                    Some(f) => f,
                    None => {
                        ctx.read_batch(RecordBatch::new_empty(crate::entry::schema_of(table)))?
                    }
                };
                ctx.register_table(table.as_str(), frame.into_view())?;
            }
            let infos: Vec<_> = self
                .store
                .with_runs(|r| r.values().filter_map(|s| s.info.clone()).collect());
            ctx.register_batch(runs::TABLE, runs::to_batch(&infos)?)?;
            ctx.register_batch(alerts::TABLE, alerts::to_batch(&self.store.alerts(None))?)?;
            let options = SQLOptions::new()
                .with_allow_ddl(false)
                .with_allow_dml(false)
                .with_allow_statements(false);
            let state = ctx.state();
            let statement = state
                .sql_to_statement(sql, &state.config_options().sql_parser.dialect)
                .map_err(|e| self.sql_error(e))?;
            depth::refuse_deep(&statement)?;
            let planned = async {
                let plan = state.statement_to_plan(statement).await?;
                options.verify_plan(&plan)?;
                ctx.execute_logical_plan(plan).await
            };
            let frame = planned.await.map_err(|e| self.sql_error(e))?;
            refuse_amplifiers(frame.logical_plan())?;
            let (state, plan) = frame
                .limit(0, Some(self.sql.max_rows + 1))
                .map_err(|e| self.sql_error(e))?
                .into_parts();
            // Guarded before the optimiser (its constant folding calls the functions) and
            // after it (a rewrite may call a function of its own); planned without optimising
            // again.
            let budget = budget::Budget {
                bytes: self.sql.max_result_bytes,
                rows: state.config().batch_size(),
                whole: self.memory,
            };
            let planned = async {
                let written = guard::guard_plan(plan, budget, guard::Pass::Written)?;
                let plan =
                    guard::guard_plan(state.optimize(&written)?, budget, guard::Pass::Optimised)?;
                let physical = state
                    .query_planner()
                    .create_physical_plan(&plan, &state)
                    .await?;
                let physical = bounded::bound_plan(physical, budget)?;
                datafusion::physical_plan::execute_stream(physical, state.task_ctx())
            };
            let mut stream = planned.await.map_err(|e| self.sql_error(e))?;
            // Taken batch by batch up to the row and byte limits: what is past them is never
            // held (a `collect` held the whole result, outside the memory pool).
            let (mut batches, mut rows, mut bytes) = (Vec::new(), 0, 0);
            while let Some(batch) = stream.next().await {
                let batch = batch.map_err(|e| self.sql_error(e))?;
                let (n, size) = (batch.num_rows(), batch.get_array_memory_size());
                // The rows of this batch within both limits (past the bytes left, at its
                // average row size).
                let within_bytes = if bytes + size <= self.sql.max_result_bytes {
                    n
                } else {
                    (self.sql.max_result_bytes - bytes) / size.div_ceil(n.max(1)).max(1)
                };
                let fit = n.min(self.sql.max_rows - rows).min(within_bytes);
                if fit < n {
                    batches.push(batch.slice(0, fit));
                    return Ok((batches, true));
                }
                (rows, bytes) = (rows + n, bytes + size);
                batches.push(batch);
            }
            Ok((batches, false))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Float64Type;
    use arrow_array::{Float64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};
    use datafusion::execution::runtime_env::RuntimeEnv;

    /// A part written before doubles lost their min/max (`store::files`), holding 0.5 and a
    /// NaN: its footer says min = max = 0.5 with no nulls, since Parquet leaves NaN out. The
    /// collector's session must read the NaN back, not take the column for the constant 0.5.
    #[tokio::test]
    async fn a_nan_beside_one_other_value_is_read_back_as_nan() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "value",
            DataType::Float64,
            false,
        )]));
        let values = Float64Array::from(vec![0.5, f64::NAN]);
        let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(values)]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.parquet");
        let file = std::fs::File::create(&path).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(file, schema, None).unwrap();
        writer.write(&batch).unwrap();
        let footer = writer.close().unwrap();
        let stats = footer.row_group(0).column(0).statistics().unwrap();
        assert_eq!(
            (stats.min_bytes_opt(), stats.max_bytes_opt()),
            (
                Some(&0.5f64.to_le_bytes()[..]),
                Some(&0.5f64.to_le_bytes()[..])
            ),
            "the footer no longer leaves the NaN out; this test lost its point"
        );

        let ctx = session(Arc::new(RuntimeEnv::default()));
        let back = ctx
            .read_parquet(path.to_str().unwrap(), ParquetReadOptions::default())
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let read: Vec<f64> = back
            .iter()
            .flat_map(|b| b.column(0).as_primitive::<Float64Type>().values().to_vec())
            .collect();
        assert_eq!(read.len(), 2);
        assert_eq!(read[0], 0.5);
        assert!(read[1].is_nan(), "the NaN was read as {}", read[1]);
    }
}
