//! Joins and unnests may copy a row only as many times as keeps a batch within budget.
//!
//! A join copies a row of one side once for every row of the other it meets, and an unnest
//! copies a row's other columns once for every element it unnests; DataFusion does both inside
//! the operator, into one new batch, before anything could see it. A one-row value of 256 KiB
//! joined with 8,192 rows asked for 2 GiB there (arrow panicked on the offsets; at 128 KiB it
//! would have been allocated). So each input of a join or an unnest is wrapped here: its batches
//! are cut to at most [`Budget::rows`] rows (views of the same memory, no copy), and a batch
//! whose rows could be copied past [`Budget::bytes`] fails, naming the limit, before the
//! operator sees it.
//!
//! An aggregate's or a window's result is bounded by DataFusion's pool while it is built, but
//! not after: `string_agg` over a table made a 589 KB value that a scalar subquery then copied
//! into a thousand rows. So their output is wrapped too, and a value longer than
//! [`Budget::value`] fails there, before anything copies it.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, RecordBatch};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
    SendableRecordBatchStream,
};
use futures_util::StreamExt;

use super::budget::{Budget, longest_value, row_width};

/// What the wrapped input feeds, and so how its rows are copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feeds {
    /// A join: each row up to a batch's rows times.
    Join,
    /// An unnest: each row's other columns once an element of its lists.
    Unnest,
    /// What an aggregate or a window made: no value longer than a value may be.
    Values,
    /// A window over whole partitions (`WindowAggExec`): DataFusion keeps the input outside its
    /// pool and makes a value a row of it (`max(s) OVER ()`), so the rows it has seen times the
    /// widest of them may not pass [`Budget::whole`].
    Whole,
}

#[derive(Debug)]
struct Bounded {
    input: Arc<dyn ExecutionPlan>,
    feeds: Feeds,
    budget: Budget,
}

impl Bounded {
    /// The batch cut to at most a batch's rows, each piece checked.
    fn pieces(feeds: Feeds, budget: Budget, batch: RecordBatch) -> Vec<Result<RecordBatch>> {
        let rows = budget.rows.max(1);
        (0..batch.num_rows().max(1))
            .step_by(rows)
            .map(|start| {
                let piece = batch.slice(start, rows.min(batch.num_rows() - start));
                check(feeds, budget, &piece).map(|()| piece)
            })
            .collect()
    }
}

fn is_list(t: &DataType) -> bool {
    matches!(
        t,
        DataType::List(_) | DataType::LargeList(_) | DataType::FixedSizeList(..)
    )
}

/// The longest element of a list-typed array (what an unnest puts in one row).
fn element_width(array: &dyn Array) -> usize {
    use datafusion::arrow::array::AsArray;
    match array.data_type() {
        DataType::List(_) => longest_value(array.as_list::<i32>().values().as_ref()),
        DataType::LargeList(_) => longest_value(array.as_list::<i64>().values().as_ref()),
        DataType::FixedSizeList(..) => longest_value(array.as_fixed_size_list().values().as_ref()),
        _ => longest_value(array),
    }
}

/// Elements of the lists of `array` in its slice, for a list-typed array.
fn elements(array: &dyn Array) -> usize {
    use datafusion::arrow::array::AsArray;
    match array.data_type() {
        DataType::List(_) => {
            let o = array.as_list::<i32>().value_offsets();
            (o[o.len() - 1] - o[0]).max(0) as usize
        }
        DataType::LargeList(_) => {
            let o = array.as_list::<i64>().value_offsets();
            (o[o.len() - 1] - o[0]).max(0) as usize
        }
        DataType::FixedSizeList(_, n) => array.len() * (*n).max(0) as usize,
        _ => 0,
    }
}

fn check(feeds: Feeds, budget: Budget, batch: &RecordBatch) -> Result<()> {
    let columns = batch.columns().iter().map(|c| c.as_ref());
    let (what, copies, width) = match feeds {
        Feeds::Values => {
            let longest = columns.map(longest_value).max().unwrap_or(0);
            if longest <= budget.value() {
                return Ok(());
            }
            return Err(DataFusionError::Execution(format!(
                "an aggregate or window made a value of {longest} bytes, past the {} bytes one \
                 value of a SQL query may hold (--sql-max-result-bytes over {} rows a batch)",
                budget.value(),
                budget.rows
            )));
        }
        // A join's output batch holds up to a batch's rows, each a copy of a row of this side.
        Feeds::Join => ("a join", budget.rows, row_width(columns)),
        Feeds::Unnest => {
            let (lists, others): (Vec<&dyn Array>, Vec<&dyn Array>) =
                columns.partition(|c| is_list(c.data_type()));
            let copies = lists.iter().map(|l| elements(*l)).sum::<usize>() + batch.num_rows();
            // Each row it makes holds the other columns and one element of each list.
            let width = row_width(others) + lists.iter().map(|l| element_width(*l)).sum::<usize>();
            ("an unnest", copies, width)
        }
        // Checked across batches, in `execute`.
        Feeds::Whole => return Ok(()),
    };
    let most = copies.saturating_mul(width);
    if most > budget.bytes {
        return Err(DataFusionError::Execution(format!(
            "{what} would copy rows of up to {width} bytes {copies} times, {most} bytes, past the {} \
             bytes one batch of a SQL query may hold (--sql-max-result-bytes); select fewer or \
             shorter columns",
            budget.bytes
        )));
    }
    Ok(())
}

impl DisplayAs for Bounded {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BoundedExec: {:?}, {} bytes",
            self.feeds, self.budget.bytes
        )
    }
}

impl ExecutionPlan for Bounded {
    fn name(&self) -> &str {
        "BoundedExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        // What it passes on is its input's rows in their order and partitions.
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let (Some(input), true) = (children.pop(), children.is_empty()) else {
            return Err(DataFusionError::Internal(
                "BoundedExec has one input".into(),
            ));
        };
        Ok(Arc::new(Bounded {
            input,
            feeds: self.feeds,
            budget: self.budget,
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let (feeds, budget) = (self.feeds, self.budget);
        let input = self.input.execute(partition, context)?;
        let schema = input.schema();
        if feeds == Feeds::Whole {
            let (mut rows, mut widest) = (0usize, 0usize);
            let checked = input.map(move |batch| {
                let batch = batch?;
                rows += batch.num_rows();
                widest = widest.max(row_width(batch.columns().iter().map(|c| c.as_ref())));
                let most = rows.saturating_mul(widest);
                if most > budget.whole {
                    return Err(DataFusionError::Execution(format!(
                        "a window over a whole partition would hold {rows} rows of up to {widest} \
                         bytes and make a value for each, past the {} bytes of --query-memory; \
                         partition it more finely (PARTITION BY run, rank) or filter first",
                        budget.whole
                    )));
                }
                Ok(batch)
            });
            return Ok(Box::pin(RecordBatchStreamAdapter::new(schema, checked)));
        }
        let pieces = input.flat_map(move |batch| {
            futures_util::stream::iter(match batch {
                Ok(batch) => Bounded::pieces(feeds, budget, batch),
                Err(e) => vec![Err(e)],
            })
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, pieces)))
    }
}

fn is_partial(node: &dyn ExecutionPlan) -> bool {
    let any: &dyn std::any::Any = node;
    any.downcast_ref::<AggregateExec>().is_some_and(|a| {
        matches!(
            a.mode(),
            AggregateMode::Partial | AggregateMode::PartialReduce
        )
    })
}

/// `plan` with every input of a join or an unnest, and every aggregate's and window's output,
/// wrapped.
pub(super) fn bound_plan(
    plan: Arc<dyn ExecutionPlan>,
    budget: Budget,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let feeds = match node.name() {
            "UnnestExec" => Feeds::Unnest,
            // Wrapped below and above: its input counted whole, its values checked.
            "WindowAggExec" => {
                let input: Vec<_> = node
                    .children()
                    .into_iter()
                    .map(|input| {
                        Arc::new(Bounded {
                            input: Arc::clone(input),
                            feeds: Feeds::Whole,
                            budget,
                        }) as Arc<dyn ExecutionPlan>
                    })
                    .collect();
                let keep = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Keep);
                let node = node.replace_children(input, keep)?;
                return Ok(Transformed::yes(Arc::new(Bounded {
                    input: node,
                    feeds: Feeds::Values,
                    budget,
                })));
            }
            name if name.ends_with("JoinExec") => Feeds::Join,
            // A partial aggregate's output is its accumulators' state (`count(DISTINCT step)`
            // sends the distinct steps as a list), not a value of the query's.
            "AggregateExec" if is_partial(node.as_ref()) => return Ok(Transformed::no(node)),
            "AggregateExec" | "BoundedWindowAggExec" => {
                return Ok(Transformed::yes(Arc::new(Bounded {
                    input: node,
                    feeds: Feeds::Values,
                    budget,
                })));
            }
            _ => return Ok(Transformed::no(node)),
        };
        let children = node
            .children()
            .into_iter()
            .map(|input| {
                Arc::new(Bounded {
                    input: Arc::clone(input),
                    feeds,
                    budget,
                }) as Arc<dyn ExecutionPlan>
            })
            .collect();
        // The wrapper passes its input's properties on unchanged.
        let keep = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Keep);
        Ok(Transformed::yes(node.replace_children(children, keep)?))
    })
    .map(|t| t.data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{ArrayRef, Int64Array, ListArray, StringArray};
    use datafusion::arrow::datatypes::Int64Type;

    const BUDGET: Budget = Budget {
        bytes: 10_000,
        rows: 100,
        whole: 100_000,
    };

    fn batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
        RecordBatch::try_from_iter(columns).unwrap()
    }

    #[test]
    fn a_batch_is_cut_to_a_batchs_rows_and_a_join_side_to_rows_it_can_copy() {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..250));
        let pieces = Bounded::pieces(Feeds::Join, BUDGET, batch(vec![("id", ids)]));
        let rows: Vec<usize> = pieces
            .iter()
            .map(|p| p.as_ref().unwrap().num_rows())
            .collect();
        assert_eq!(rows, [100, 100, 50], "views of the same rows, none lost");
        // 100 copies of a 101-byte row pass 10,000 bytes; of a 99-byte row they do not.
        let wide = |n: usize| {
            batch(vec![(
                "s",
                Arc::new(StringArray::from(vec!["x".repeat(n)])) as ArrayRef,
            )])
        };
        assert!(check(Feeds::Join, BUDGET, &wide(99)).is_ok());
        let refused = check(Feeds::Join, BUDGET, &wide(101))
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("a join would copy rows of up to 101 bytes 100 times"),
            "{refused}"
        );
        assert!(refused.contains("--sql-max-result-bytes"), "{refused}");
    }

    #[test]
    fn an_unnest_may_copy_a_row_once_an_element() {
        let row = |elements: i64, other: usize| {
            let list = ListArray::from_iter_primitive::<Int64Type, _, _>(vec![Some(
                (0..elements).map(Some).collect::<Vec<_>>(),
            )]);
            batch(vec![
                ("l", Arc::new(list) as ArrayRef),
                (
                    "s",
                    Arc::new(StringArray::from(vec!["x".repeat(other)])) as ArrayRef,
                ),
            ])
        };
        assert!(check(Feeds::Unnest, BUDGET, &row(10, 500)).is_ok());
        let refused = check(Feeds::Unnest, BUDGET, &row(100, 500))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("an unnest would copy rows"), "{refused}");
    }
}
