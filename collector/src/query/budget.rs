//! What one batch of a SQL query may hold.
//!
//! DataFusion bounds what it accounts (sorts, aggregations, the build side of a join) by
//! `--query-memory`; the batches that flow between operators, and every function's result, it
//! allocates outside that pool. They are bounded here by construction instead:
//! - a batch holds at most [`Budget::rows`] rows (DataFusion's batch size);
//! - every value a query computes, or writes as a literal, is at most [`Budget::value`] =
//!   bytes / rows (8 KiB at the default 64 MiB), and one function call makes at most
//!   [`Budget::bytes`] over a batch (`query/guard.rs`), so no computed column of a batch passes
//!   `bytes`;
//! - a join or an unnest, which copy rows, may copy a row only as many times as keeps the
//!   batch it makes within `bytes` (`query/bounded.rs`).
//!
//! `bytes` is `--sql-max-result-bytes`, the most an answer may hold: a batch that could not be
//! answered is not worth making.

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::DataType;

/// The bytes and rows one batch of a query may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Budget {
    pub(super) bytes: usize,
    pub(super) rows: usize,
    /// What a window over a whole partition may hold (`--query-memory`): DataFusion keeps such
    /// a partition outside its pool and makes one value a row of it.
    pub(super) whole: usize,
}

impl Budget {
    /// The most one computed value may hold: a batch of such values stays within `bytes`. At
    /// least 256 bytes, so that a small answer limit never refuses a number or a short name.
    pub(super) fn value(&self) -> usize {
        (self.bytes / self.rows.max(1)).max(256)
    }
}

/// An upper bound of the bytes of the longest value in `array`, row by row: for a string its
/// length, for a list its most elements times its longest element, for a struct the sum of its
/// fields'.
pub(super) fn longest_value(array: &dyn Array) -> usize {
    fn longest_by_offsets<O: Copy + Into<i64>>(offsets: &[O]) -> usize {
        offsets
            .windows(2)
            .map(|w| (w[1].into() - w[0].into()).max(0) as usize)
            .max()
            .unwrap_or(0)
    }
    match array.data_type() {
        DataType::Utf8 => longest_by_offsets(array.as_string::<i32>().value_offsets()),
        DataType::LargeUtf8 => longest_by_offsets(array.as_string::<i64>().value_offsets()),
        DataType::Binary => longest_by_offsets(array.as_binary::<i32>().value_offsets()),
        DataType::LargeBinary => longest_by_offsets(array.as_binary::<i64>().value_offsets()),
        DataType::Utf8View => max_view(array.as_string_view().views()),
        DataType::BinaryView => max_view(array.as_binary_view().views()),
        DataType::List(_) => {
            let list = array.as_list::<i32>();
            longest_by_offsets(list.value_offsets()).saturating_mul(longest_value(list.values()))
        }
        DataType::LargeList(_) => {
            let list = array.as_list::<i64>();
            longest_by_offsets(list.value_offsets()).saturating_mul(longest_value(list.values()))
        }
        DataType::FixedSizeList(_, n) => {
            let list = array.as_fixed_size_list();
            (*n).max(0) as usize * longest_value(list.values())
        }
        DataType::Map(..) => {
            let map = array.as_map();
            longest_by_offsets(map.value_offsets()).saturating_mul(longest_value(map.entries()))
        }
        DataType::Struct(_) => row_width(array.as_struct().columns().iter().map(|c| c.as_ref())),
        DataType::Dictionary(..) => longest_value(array.as_any_dictionary().values().as_ref()),
        DataType::Null => 0,
        DataType::Boolean => 1,
        t => match t.primitive_width() {
            Some(width) => width,
            // Unions and run-end encodings: the whole array bounds any one value.
            None => array
                .to_data()
                .get_slice_memory_size()
                .unwrap_or_else(|_| array.get_array_memory_size()),
        },
    }
}

/// The bytes every value of a fixed-size type takes (`FixedSizeBinary(n)`, a fixed-size list of
/// them), whatever it holds, NULL included: `None` for variable-size types.
pub(super) fn fixed_width(t: &DataType) -> Option<usize> {
    match t {
        DataType::FixedSizeBinary(n) => Some((*n).max(0) as usize),
        DataType::FixedSizeList(f, n) => {
            fixed_width(f.data_type()).map(|w| w.saturating_mul((*n).max(0) as usize))
        }
        DataType::Struct(fields) => fields
            .iter()
            .map(|f| fixed_width(f.data_type()))
            .try_fold(0usize, |sum, w| w.map(|w| sum.saturating_add(w))),
        t => t.primitive_width(),
    }
}

/// A view's low 32 bits are its value's length.
fn max_view(views: &[u128]) -> usize {
    views.iter().map(|&v| v as u32 as usize).max().unwrap_or(0)
}

/// The bytes of the widest row `columns` can hold: the sum of each column's longest value.
pub(super) fn row_width<'a>(columns: impl IntoIterator<Item = &'a dyn Array>) -> usize {
    columns
        .into_iter()
        .map(longest_value)
        .fold(0usize, usize::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int64Array, ListArray, StringArray, StringViewArray};
    use datafusion::arrow::datatypes::Int64Type;

    #[test]
    fn the_longest_value_is_measured_on_the_slice_and_by_type() {
        let strings = StringArray::from(vec!["a", "bbbbbbbbbbbbbbbbbbbb", "cc"]);
        assert_eq!(longest_value(&strings), 20);
        assert_eq!(
            longest_value(&strings.slice(2, 1)),
            2,
            "a slice is measured alone"
        );
        let views = StringViewArray::from(vec!["a", "bbbbbbbbbbbbbbbbbbbb", "cc"]);
        assert_eq!(longest_value(&views), 20);
        assert_eq!(longest_value(&Int64Array::from(vec![1, 2])), 8);
        let lists = ListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..1000).map(|i| Some(vec![Some(i); 3])),
        );
        assert_eq!(
            longest_value(&lists),
            24,
            "a row's elements, not the whole column's"
        );
        let row = [
            &strings as &dyn Array,
            &Int64Array::from(vec![1, 2, 3]) as &dyn Array,
        ];
        assert_eq!(row_width(row), 28);
        assert_eq!(
            fixed_width(&DataType::FixedSizeBinary(1 << 30)),
            Some(1 << 30)
        );
        assert_eq!(fixed_width(&DataType::Utf8), None);
        assert_eq!(
            Budget {
                bytes: 64 << 20,
                rows: 8192,
                whole: 1 << 30,
            }
            .value(),
            8192
        );
    }
}
