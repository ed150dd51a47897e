//! Series numbering for a part's sort: each row's series (a table's sort columns but the last)
//! as a dense id, and the distinct series in the table's order.
//!
//! The flush sorts by counting (`files::sorted`): it needs each row's series as a number and
//! the order of the distinct series, not a comparison per row. A series key is a few
//! integers: a text column (metric, site) is numbered by a vocabulary of its distinct
//! strings — one look-up per row, none where the row repeats the string before, as the
//! agent's report does for a site — and integer columns are their values. Those keys hash as
//! a few machine words; only the distinct series are compared, through the vocabularies,
//! to put them in order (nulls first, strings by their bytes, integers by value: the order
//! Parquet's sort columns state). Encoding every row to comparable bytes (`arrow-row`) and
//! hashing those was about a third of the sort's time.

use std::cmp::Ordering;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::{
    Array, ArrayRef, PrimitiveArray, RecordBatch, StringArray, UInt32Array, UInt64Array,
};
use arrow_schema::DataType;
use foldhash::{HashMap, HashMapExt};

use crate::error::{Error, Result};

/// The most series columns a table has (samples: metric, layer, site, rank).
const MAX_COLUMNS: usize = 4;

/// A row's series: a code per column (a vocabulary id for text, the value for integers) and
/// which columns are null.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    codes: [u64; MAX_COLUMNS],
    nulls: u8,
}

/// The series of a part's rows.
#[derive(Debug)]
pub(super) struct Series {
    /// Each row's series id, rows in arrival order (batch after batch).
    pub(super) of_row: Vec<u32>,
    /// Each series' place in the table's order, by id.
    pub(super) rank_of: Vec<u32>,
    /// One array per series column: the distinct series in the table's order.
    pub(super) columns: Vec<ArrayRef>,
}

/// The distinct strings of one text column, numbered as first seen.
#[derive(Debug, Default)]
struct Vocabulary<'a> {
    ids: HashMap<&'a str, u32>,
    names: Vec<&'a str>,
    last: Option<(&'a str, u32)>,
}

impl<'a> Vocabulary<'a> {
    fn id(&mut self, name: &'a str) -> u32 {
        if let Some((last, id)) = self.last
            && last == name
        {
            return id;
        }
        let next = self.names.len() as u32;
        let id = *self.ids.entry(name).or_insert(next);
        if id == next {
            self.names.push(name);
        }
        self.last = Some((name, id));
        id
    }
}

/// One series column of one batch.
enum Column<'a> {
    Text(&'a StringArray),
    U32(&'a UInt32Array),
    U64(&'a UInt64Array),
}

impl<'a> Column<'a> {
    fn of(array: &'a ArrayRef, table: &str, name: &str) -> Result<Self> {
        match array.data_type() {
            DataType::Utf8 => Ok(Column::Text(array.as_string::<i32>())),
            DataType::UInt32 => Ok(Column::U32(array.as_primitive::<UInt32Type>())),
            DataType::UInt64 => Ok(Column::U64(array.as_primitive::<UInt64Type>())),
            other => Err(Error::Corrupt {
                what: format!("a {table} batch"),
                reason: format!("its `{name}` column is {other}, not a string or an integer"),
            }),
        }
    }
}

/// Numbers the series of `batches` by the columns `names` (at most four, each a string or an
/// unsigned integer column, the same type in every batch).
pub(super) fn number(batches: &[RecordBatch], names: &[&str], table: &str) -> Result<Series> {
    if names.is_empty() || names.len() > MAX_COLUMNS {
        return Err(Error::Corrupt {
            what: format!("a {table} sort"),
            reason: format!(
                "{} series columns (1 to {MAX_COLUMNS} supported)",
                names.len()
            ),
        });
    }
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    let arrays = batches
        .iter()
        .map(|batch| {
            names
                .iter()
                .map(|name| {
                    batch.column_by_name(name).ok_or_else(|| Error::Corrupt {
                        what: format!("a {table} batch"),
                        reason: format!("it has no `{name}` column"),
                    })
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let types: Vec<&DataType> = match arrays.first() {
        Some(first) => first.iter().map(|a| a.data_type()).collect(),
        None => Vec::new(),
    };
    let mut vocabularies: Vec<Vocabulary<'_>> =
        names.iter().map(|_| Vocabulary::default()).collect();
    let mut ids: HashMap<Key, u32> = HashMap::with_capacity(1024);
    let mut keys: Vec<Key> = Vec::new();
    let mut of_row = Vec::with_capacity(rows);
    for batch_arrays in &arrays {
        let columns = batch_arrays
            .iter()
            .zip(names)
            .zip(&types)
            .map(|((array, name), expected)| {
                if array.data_type() != *expected {
                    return Err(Error::Corrupt {
                        what: format!("a {table} batch"),
                        reason: format!(
                            "its `{name}` column is {}, another batch's is {expected}",
                            array.data_type()
                        ),
                    });
                }
                Column::of(array, table, name)
            })
            .collect::<Result<Vec<_>>>()?;
        let len = batch_arrays.first().map_or(0, |a| a.len());
        for row in 0..len {
            let mut key = Key {
                codes: [0; MAX_COLUMNS],
                nulls: 0,
            };
            for (k, column) in columns.iter().enumerate() {
                let code = match column {
                    Column::Text(a) => a
                        .is_valid(row)
                        .then(|| u64::from(vocabularies[k].id(a.value(row)))),
                    Column::U32(a) => a.is_valid(row).then(|| u64::from(a.value(row))),
                    Column::U64(a) => a.is_valid(row).then(|| a.value(row)),
                };
                match code {
                    Some(code) => key.codes[k] = code,
                    None => key.nulls |= 1 << k,
                }
            }
            let next = keys.len() as u32;
            let id = *ids.entry(key).or_insert(next);
            if id == next {
                keys.push(key);
            }
            of_row.push(id);
        }
    }
    // The distinct series in the table's order: nulls first, then by value (a string's id
    // stands for its bytes).
    let compare = |a: &Key, b: &Key| -> Ordering {
        for (k, ty) in types.iter().enumerate() {
            let bit = 1 << k;
            let order = match (a.nulls & bit != 0, b.nulls & bit != 0) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Less,
                (false, true) => Ordering::Greater,
                (false, false) if **ty == DataType::Utf8 => {
                    let names = &vocabularies[k].names;
                    names[a.codes[k] as usize].cmp(names[b.codes[k] as usize])
                }
                (false, false) => a.codes[k].cmp(&b.codes[k]),
            };
            if order != Ordering::Equal {
                return order;
            }
        }
        Ordering::Equal
    };
    let mut sorted: Vec<u32> = (0..keys.len() as u32).collect();
    sorted.sort_unstable_by(|&a, &b| compare(&keys[a as usize], &keys[b as usize]));
    let mut rank_of = vec![0u32; keys.len()];
    for (rank, &id) in sorted.iter().enumerate() {
        rank_of[id as usize] = rank as u32;
    }
    let columns = types
        .iter()
        .enumerate()
        .map(|(k, ty)| {
            let value = |id: &u32| {
                let key = &keys[*id as usize];
                (key.nulls & (1 << k) == 0).then_some(key.codes[k])
            };
            let array: ArrayRef = match ty {
                DataType::Utf8 => {
                    let names = &vocabularies[k].names;
                    std::sync::Arc::new(
                        sorted
                            .iter()
                            .map(|id| value(id).map(|code| names[code as usize]))
                            .collect::<StringArray>(),
                    )
                }
                DataType::UInt32 => std::sync::Arc::new(
                    sorted
                        .iter()
                        .map(|id| value(id).map(|code| code as u32))
                        .collect::<PrimitiveArray<UInt32Type>>(),
                ),
                _ => std::sync::Arc::new(
                    sorted
                        .iter()
                        .map(value)
                        .collect::<PrimitiveArray<UInt64Type>>(),
                ),
            };
            array
        })
        .collect();
    Ok(Series {
        of_row,
        rank_of,
        columns,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Float64Array, Int64Array};
    use arrow_schema::{Field, Schema};

    use super::*;

    fn batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
        let fields: Vec<Field> = columns
            .iter()
            .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
            .collect();
        RecordBatch::try_new(
            Arc::new(Schema::new(fields)),
            columns.into_iter().map(|(_, a)| a).collect(),
        )
        .unwrap()
    }

    /// Rows of the same series share an id, whichever batch they are in; the distinct series
    /// come out nulls first, strings by their bytes (not by when they were first seen).
    #[test]
    fn series_are_numbered_across_batches_and_ordered_by_value() {
        let a = batch(vec![
            (
                "metric",
                Arc::new(StringArray::from(vec!["b", "a", "b"])) as ArrayRef,
            ),
            (
                "rank",
                Arc::new(UInt32Array::from(vec![Some(1), None, Some(1)])),
            ),
        ]);
        let b = batch(vec![
            (
                "metric",
                Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
            ("rank", Arc::new(UInt32Array::from(vec![None, Some(0)]))),
        ]);
        let series = number(&[a, b], &["metric", "rank"], "samples").unwrap();
        assert_eq!(series.of_row[0], series.of_row[2]);
        assert_eq!(series.of_row[1], series.of_row[3]);
        assert_eq!(series.rank_of.len(), 3);
        let metric = series.columns[0].as_string::<i32>();
        let rank = series.columns[1].as_primitive::<UInt32Type>();
        let distinct: Vec<(&str, Option<u32>)> = (0..3)
            .map(|i| (metric.value(i), rank.is_valid(i).then(|| rank.value(i))))
            .collect();
        assert_eq!(distinct, [("a", None), ("b", Some(0)), ("b", Some(1))]);
        let rank_of_row = |row: usize| series.rank_of[series.of_row[row] as usize];
        assert_eq!([rank_of_row(0), rank_of_row(1), rank_of_row(4)], [2, 0, 1]);
    }

    #[test]
    fn a_column_of_another_type_is_named() {
        let a = batch(vec![(
            "step",
            Arc::new(UInt64Array::from(vec![1u64])) as ArrayRef,
        )]);
        let b = batch(vec![(
            "step",
            Arc::new(Int64Array::from(vec![1i64])) as ArrayRef,
        )]);
        let err = number(&[a.clone(), b], &["step"], "sketches")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`step` column is Int64, another batch's is UInt64"),
            "{err}"
        );
        let c = batch(vec![(
            "value",
            Arc::new(Float64Array::from(vec![1.0])) as ArrayRef,
        )]);
        let err = number(&[c], &["value"], "samples").unwrap_err().to_string();
        assert!(
            err.contains("`value` column is Float64, not a string or an integer"),
            "{err}"
        );
        let err = number(std::slice::from_ref(&a), &["rank"], "sketches")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no `rank` column"), "{err}");
        let err = number(&[a], &["step"; 5], "sketches")
            .unwrap_err()
            .to_string();
        assert!(err.contains("5 series columns"), "{err}");
    }
}
