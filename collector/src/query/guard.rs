//! Every function a SQL query calls runs under a size guard.
//!
//! DataFusion allocates a function's result outside its memory pool, so `--query-memory` cannot
//! bound it: a query could grow a string from its own text, each `WITH` level doubling the last
//! (`s || s`), thirty levels to a gigabyte a row. The guard works out, before each call, an
//! upper bound of the bytes the call can make from the bytes of its arguments, and refuses the
//! call when the bound passes what one batch may hold ([`Budget::bytes`]): most functions make at most about what they are given ([`Bound::Joins`]), and those
//! that put one argument in place of every match in another (`replace`, `regexp_replace`,
//! `translate`, ...) at most the product ([`Bound::Substitutes`]). After the call the result
//! itself is measured, whole and its longest value ([`Budget::value`]), so a function that
//! makes a constant factor more than it is given (`encode`, `to_hex`) overshoots by that factor
//! once and is then refused. A literal longer than a value may be is refused too (a projection
//! copies it into every row of a batch). Functions whose
//! result's size is an argument (`repeat`) are refused outright before planning (see
//! `AMPLIFIERS` in the parent module).
//!
//! The wrapping happens twice. On the plan as written only the functions that can make more
//! than they are given ([`GROWERS`]) and `||` are wrapped, so the optimiser's constant folding
//! (which calls them) is guarded while its rewrites that recognise a function by its type
//! (`log(power(..))`, `get_field(named_struct(..))`) still see the others. On the optimised
//! plan every call is wrapped but the few the scan recognises by type ([`PASS_THROUGH`], none of
//! which grows). `||` is planned as a guarded function with the operator's types, name and NULL
//! rule. `string_agg` and `array_agg` are refused as window functions: a running frame makes a
//! value a row, each as long as the rows before it, inside the operator.

use std::any::Any;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::budget::{Budget, fixed_width, longest_value};
use datafusion::arrow::array::Array;
use datafusion::arrow::compute::kernels::concat_elements::concat_elements_dyn;
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{ExprSchema, ScalarValue};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::expr::{Cast, ScalarFunction, TryCast};
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::preimage::PreimageResult;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::type_coercion::binary::BinaryTypeCoercer;
use datafusion::logical_expr::udf_eq::UdfEq;
use datafusion::logical_expr::{
    BinaryExpr, ColumnarValue, Documentation, Expr, ExpressionPlacement, LogicalPlan, Operator,
    ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, StructFieldMapping,
    Volatility,
};

/// Functions that can make more bytes than they are given, by a factor or by a product:
/// wrapped before the optimiser folds constants with them.
const GROWERS: [&str; 24] = [
    "concat",
    "concat_ws",
    "encode",
    "upper",
    "lower",
    "initcap",
    "replace",
    "regexp_replace",
    "regexp_match",
    "translate",
    "to_char",
    "string_to_array",
    "overlay",
    "named_struct",
    "struct",
    "map",
    "make_map",
    "make_array",
    "arrow_cast",
    "to_hex",
    "array_concat",
    "array_append",
    "array_prepend",
    "array_to_string",
];

/// Functions the Parquet scan recognises by their type (so a wrapper would hide them), none of
/// which makes more than it is given.
const PASS_THROUGH: [&str; 3] = ["input_file_name", "file_row_index", "get_field"];

/// Aggregates that build a value from every row they see: as window functions over a running
/// frame they make a value a row, each as long as the rows before it.
const ACCUMULATORS: [&str; 2] = ["string_agg", "array_agg"];

/// Which plan the guard is put on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// The plan as written: only the [`GROWERS`] and `||`.
    Written,
    /// The optimised plan: every call but the [`PASS_THROUGH`] ones.
    Optimised,
}

/// How many bytes a function can make, at most, from its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Bound {
    /// About what it is given: the sum of its arguments (`concat`, `substr`, `make_array`...).
    Joins,
    /// `subject` with each match (of a pattern, a character or an element) replaced by the
    /// arguments `with`: every byte of the subject, and the gap before it, may become one
    /// replacement, and `$1` in a replacement may copy the match once more.
    Substitutes {
        subject: usize,
        with: &'static [usize],
    },
    /// `concat_ws(sep, a, b, ...)`: the separator once between every two arguments.
    Separates,
    /// `to_char(t, format)`: every byte of the format may become up to 16 (`%c` is 2 bytes
    /// that become 24).
    Formats { format: usize },
}

fn bound_of(name: &str) -> Bound {
    match name {
        "replace" | "regexp_replace" | "translate" | "array_replace" | "array_replace_n"
        | "array_replace_all" => Bound::Substitutes {
            subject: 0,
            with: &[2],
        },
        // Each capture group copies (part of) the match: groups are fewer than the pattern's
        // bytes.
        "regexp_match" => Bound::Substitutes {
            subject: 0,
            with: &[1],
        },
        "array_to_string" => Bound::Substitutes {
            subject: 0,
            with: &[1, 2],
        },
        "concat_ws" => Bound::Separates,
        "to_char" => Bound::Formats { format: 1 },
        _ => Bound::Joins,
    }
}

/// Bytes of a literal, not of its Rust value.
fn scalar_bytes(value: &ScalarValue) -> usize {
    literal_bytes(value).unwrap_or_else(|| value.size())
}

/// Bytes of a string or bytes literal (what a projection copies into every row); `None` for
/// fixed-width ones.
fn literal_bytes(value: &ScalarValue) -> Option<usize> {
    match value {
        ScalarValue::Utf8(Some(s))
        | ScalarValue::LargeUtf8(Some(s))
        | ScalarValue::Utf8View(Some(s)) => Some(s.len()),
        ScalarValue::Binary(Some(b))
        | ScalarValue::LargeBinary(Some(b))
        | ScalarValue::BinaryView(Some(b)) => Some(b.len()),
        _ => None,
    }
}

/// Bytes an argument holds over `rows` rows: an array's own slice, a literal once a row.
fn bytes(value: &ColumnarValue, rows: usize) -> usize {
    match value {
        ColumnarValue::Array(a) => a
            .to_data()
            .get_slice_memory_size()
            .unwrap_or_else(|_| a.get_array_memory_size()),
        ColumnarValue::Scalar(s) => scalar_bytes(s).saturating_mul(rows.max(1)),
    }
}

/// An upper bound of the longest value of an argument (an array's whole size bounds its
/// longest value).
fn longest(value: &ColumnarValue) -> usize {
    match value {
        ColumnarValue::Array(_) => bytes(value, 1),
        ColumnarValue::Scalar(s) => scalar_bytes(s),
    }
}

/// The most bytes a call of a function bounded by `bound` can make from `args`.
fn most_bytes(bound: Bound, args: &[ColumnarValue], rows: usize) -> usize {
    let given = args
        .iter()
        .map(|a| bytes(a, rows))
        .fold(0usize, usize::saturating_add);
    let extra = match bound {
        Bound::Joins => 0,
        Bound::Substitutes { subject, with } => {
            let replacement = with
                .iter()
                .filter_map(|&i| args.get(i))
                .map(longest)
                .fold(0usize, usize::saturating_add);
            let subject = args.get(subject).map_or(0, |a| bytes(a, rows));
            // Per row: n bytes of subject give at most n + 1 matches, each replaced by at most
            // the replacement with every `$k` copying a match (total ≤ n): ≤ r·(2n + 1).
            subject
                .saturating_add(rows)
                .saturating_mul(replacement.saturating_mul(2).saturating_add(1))
        }
        Bound::Separates => args
            .first()
            .map_or(0, |sep| bytes(sep, rows))
            .saturating_mul(args.len()),
        Bound::Formats { format } => args
            .get(format)
            .map_or(0, longest)
            .saturating_mul(16)
            .saturating_mul(rows.max(1)),
    };
    given.saturating_add(extra)
}

fn too_big(name: &str, what: &str, n: usize, rows: usize, budget: Budget) -> DataFusionError {
    DataFusionError::Execution(format!(
        "function {name} {what} {n} bytes over {rows} rows, past the {} bytes one batch of a SQL \
         query may hold (--sql-max-result-bytes); filter on run and step first",
        budget.bytes
    ))
}

fn value_too_long(what: &str, n: usize, budget: Budget) -> DataFusionError {
    DataFusionError::Execution(format!(
        "{what} a value of {n} bytes, past the {} bytes one value of a SQL query may hold \
         (--sql-max-result-bytes over {} rows a batch)",
        budget.value(),
        budget.rows
    ))
}

/// Calls `call` if what it can make from `args` is within `budget`, then checks what it made.
fn checked(
    name: &str,
    bound: Bound,
    args: &[ColumnarValue],
    rows: usize,
    budget: Budget,
    call: impl FnOnce() -> Result<ColumnarValue>,
) -> Result<ColumnarValue> {
    let most = most_bytes(bound, args, rows);
    if most > budget.bytes {
        return Err(too_big(name, "could make", most, rows, budget));
    }
    let made = call()?;
    let n = bytes(&made, rows);
    if n > budget.bytes {
        return Err(too_big(name, "made", n, rows, budget));
    }
    let longest = match &made {
        ColumnarValue::Array(a) => longest_value(a.as_ref()),
        ColumnarValue::Scalar(s) => scalar_bytes(s),
    };
    if longest > budget.value() {
        return Err(value_too_long(
            &format!("function {name} made"),
            longest,
            budget,
        ));
    }
    Ok(made)
}

/// A function of the session run under the guard; everything else is the function's own.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Guarded {
    inner: UdfEq<Arc<dyn ScalarUDFImpl>>,
    budget: Budget,
    bound: Bound,
}

fn guarded(func: &Arc<ScalarUDF>, budget: Budget, pass: Pass) -> Option<Arc<ScalarUDF>> {
    let any: &dyn Any = func.inner().as_ref();
    let wanted = match pass {
        Pass::Written => GROWERS.contains(&func.name()),
        Pass::Optimised => !PASS_THROUGH.contains(&func.name()),
    };
    if !wanted || any.is::<Guarded>() || any.is::<GuardedConcat>() {
        return None;
    }
    let inner = Arc::clone(func.inner());
    let bound = bound_of(inner.name());
    Some(Arc::new(ScalarUDF::new_from_shared_impl(Arc::new(
        Guarded {
            inner: inner.into(),
            budget,
            bound,
        },
    ))))
}

/// What a literal or a cast to a fixed-size type puts in every row, and how many bytes.
fn value_width(e: &Expr) -> Option<(&'static str, usize)> {
    match e {
        Expr::Literal(value, _) => literal_bytes(value)
            .or_else(|| fixed_width(&value.data_type()))
            .map(|n| ("the query writes a literal of", n)),
        Expr::Cast(Cast { field, .. }) | Expr::TryCast(TryCast { field, .. }) => {
            fixed_width(field.data_type()).map(|n| ("a cast makes", n))
        }
        _ => None,
    }
}

/// Every call in `expr` the pass wraps guarded, `||` included; a literal longer than a value
/// may be, and an accumulating aggregate over a window, refused.
fn guard_expr(expr: Expr, budget: Budget, pass: Pass) -> Result<Transformed<Expr>> {
    expr.transform_up(|e| {
        Ok(match e {
            // A literal is copied into every row, and a cast to a fixed-size type makes that
            // many bytes a row, NULL or not (`arrow_cast(NULL, 'FixedSizeBinary(2147483647)')`
            // simplifies to one).
            ref e if value_width(e).is_some_and(|(_, n)| n > budget.value()) => {
                let (what, n) = value_width(e).unwrap_or_default();
                return Err(value_too_long(what, n, budget));
            }
            Expr::WindowFunction(w) if ACCUMULATORS.contains(&w.fun.name()) => {
                return Err(DataFusionError::Plan(format!(
                    "{} is not available as a window function here: over a running frame it \
                     makes a value a row, each as long as the rows before it, outside the query \
                     memory limit (--query-memory); aggregate with GROUP BY instead",
                    w.fun.name()
                )));
            }
            Expr::ScalarFunction(call) => match guarded(&call.func, budget, pass) {
                Some(func) => Transformed::yes(Expr::ScalarFunction(ScalarFunction::new_udf(
                    func, call.args,
                ))),
                None => Transformed::no(Expr::ScalarFunction(call)),
            },
            Expr::BinaryExpr(BinaryExpr {
                left,
                op: Operator::StringConcat,
                right,
            }) => Transformed::yes(Expr::ScalarFunction(ScalarFunction::new_udf(
                Arc::new(ScalarUDF::new_from_impl(GuardedConcat::new(budget))),
                vec![*left, *right],
            ))),
            e => Transformed::no(e),
        })
    })
}

/// `plan` with the calls the pass wraps, subqueries included, run under the guard.
pub(super) fn guard_plan(plan: LogicalPlan, budget: Budget, pass: Pass) -> Result<LogicalPlan> {
    plan.transform_up_with_subqueries(|node| node.map_expressions(|e| guard_expr(e, budget, pass)))
        .map(|t| t.data)
}

#[warn(clippy::missing_trait_methods)] // delegates: a method left out would change the function
impl ScalarUDFImpl for Guarded {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn display_name(&self, args: &[Expr]) -> Result<String> {
        #[expect(deprecated)]
        self.inner.display_name(args)
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        self.inner.schema_name(args)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs<'_>) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }

    fn is_nullable(&self, args: &[Expr], schema: &dyn ExprSchema) -> bool {
        #[expect(deprecated)]
        self.inner.is_nullable(args, schema)
    }

    fn is_strict(&self) -> bool {
        self.inner.is_strict()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let (rows, values) = (args.number_rows, args.args.clone());
        checked(self.name(), self.bound, &values, rows, self.budget, || {
            self.inner.invoke_with_args(args)
        })
    }

    fn with_updated_config(&self, config: &ConfigOptions) -> Option<ScalarUDF> {
        let updated = self.inner.with_updated_config(config)?;
        guarded(&Arc::new(updated), self.budget, Pass::Optimised).map(Arc::unwrap_or_clone)
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        // What the function simplifies to may call other functions, built unguarded.
        Ok(match self.inner.simplify(args, info)? {
            ExprSimplifyResult::Simplified(e) => {
                ExprSimplifyResult::Simplified(guard_expr(e, self.budget, Pass::Written)?.data)
            }
            original => original,
        })
    }

    fn preimage(
        &self,
        args: &[Expr],
        lit_expr: &Expr,
        info: &SimplifyContext,
    ) -> Result<PreimageResult> {
        self.inner.preimage(args, lit_expr, info)
    }

    fn conditional_arguments<'a>(
        &self,
        args: &'a [Expr],
    ) -> Option<(Vec<&'a Expr>, Vec<&'a Expr>)> {
        self.inner.conditional_arguments(args)
    }

    fn short_circuits(&self) -> bool {
        self.inner.short_circuits()
    }

    fn evaluate_bounds(&self, input: &[&Interval]) -> Result<Interval> {
        self.inner.evaluate_bounds(input)
    }

    fn propagate_constraints(
        &self,
        interval: &Interval,
        inputs: &[&Interval],
    ) -> Result<Option<Vec<Interval>>> {
        self.inner.propagate_constraints(interval, inputs)
    }

    fn struct_field_mapping(
        &self,
        literal_args: &[Option<ScalarValue>],
    ) -> Option<StructFieldMapping> {
        self.inner.struct_field_mapping(literal_args)
    }

    fn output_ordering(&self, inputs: &[ExprProperties]) -> Result<SortProperties> {
        self.inner.output_ordering(inputs)
    }

    fn preserves_lex_ordering(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.preserves_lex_ordering(inputs)
    }

    fn strictly_order_preserving(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.strictly_order_preserving(inputs)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }

    fn placement(&self, args: &[ExpressionPlacement]) -> ExpressionPlacement {
        self.inner.placement(args)
    }
}

/// `a || b` for strings and bytes, as the operator is (its types, its name, NULL when either
/// side is), under the guard.
#[derive(Debug)]
struct GuardedConcat {
    signature: Signature,
    budget: Budget,
}

impl GuardedConcat {
    fn new(budget: Budget) -> Self {
        GuardedConcat {
            signature: Signature::user_defined(Volatility::Immutable),
            budget,
        }
    }
}

impl PartialEq for GuardedConcat {
    fn eq(&self, other: &Self) -> bool {
        self.budget == other.budget
    }
}

impl Eq for GuardedConcat {}

impl Hash for GuardedConcat {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.budget.hash(state);
    }
}

impl ScalarUDFImpl for GuardedConcat {
    fn name(&self) -> &str {
        "||"
    }

    fn display_name(&self, args: &[Expr]) -> Result<String> {
        Ok(format!("{} || {}", args[0], args[1]))
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        Ok(format!(
            "{} || {}",
            args[0].schema_name(),
            args[1].schema_name()
        ))
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        let [left, right] = arg_types else {
            return Err(DataFusionError::Plan("|| takes two operands".into()));
        };
        let (left, right) =
            BinaryTypeCoercer::new(left, &Operator::StringConcat, right).get_input_types()?;
        Ok(vec![left, right])
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        let [left, right] = arg_types else {
            return Err(DataFusionError::Plan("|| takes two operands".into()));
        };
        BinaryTypeCoercer::new(left, &Operator::StringConcat, right).get_result_type()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let rows = args.number_rows;
        checked("||", Bound::Joins, &args.args, rows, self.budget, || {
            let scalars = args
                .args
                .iter()
                .all(|a| matches!(a, ColumnarValue::Scalar(_)));
            let arrays = ColumnarValue::values_to_arrays(&args.args)?;
            let joined = concat_elements_dyn(&arrays[0], &arrays[1])?;
            Ok(if scalars {
                ColumnarValue::Scalar(ScalarValue::try_from_array(&joined, 0)?)
            } else {
                ColumnarValue::Array(joined)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{ArrayRef, StringArray};
    use datafusion::arrow::datatypes::Field;
    use proptest::prelude::*;

    /// Calls `func` under a guard with room for anything, returning (made, bound).
    fn made_and_bound(
        func: Arc<ScalarUDF>,
        args: Vec<ColumnarValue>,
        rows: usize,
    ) -> (usize, usize) {
        let guard = guarded(&func, ROOMY, Pass::Optimised).unwrap();
        let arg_fields: Vec<FieldRef> = args
            .iter()
            .map(|a| Arc::new(Field::new("a", a.data_type(), true)))
            .collect();
        let types: Vec<_> = args.iter().map(ColumnarValue::data_type).collect();
        let return_field = Arc::new(Field::new("r", guard.return_type(&types).unwrap(), true));
        let bound = most_bytes(bound_of(guard.name()), &args, rows);
        let made = guard
            .invoke_with_args(ScalarFunctionArgs {
                args,
                arg_fields,
                number_rows: rows,
                return_field,
                config_options: Arc::new(ConfigOptions::default()),
            })
            .unwrap();
        (bytes(&made, 1), bound)
    }

    const ROOMY: Budget = Budget {
        bytes: usize::MAX,
        rows: 1,
        whole: usize::MAX,
    };

    fn strings(values: &[String]) -> ColumnarValue {
        ColumnarValue::Array(Arc::new(StringArray::from_iter_values(values)) as ArrayRef)
    }

    fn literal(s: &str) -> ColumnarValue {
        ColumnarValue::Scalar(ScalarValue::Utf8(Some(s.to_owned())))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The bound of the substituting functions holds for what DataFusion's own functions
        /// make, empty patterns, one-character patterns and `$0` copies included.
        #[test]
        fn what_a_substituting_function_makes_stays_within_its_bound(
            subjects in proptest::collection::vec("[ab€]{0,40}", 1..20),
            pattern in "[ab€]{0,2}",
            replacement in "(\\$0|x|€){0,6}",
        ) {
            let rows = subjects.len();
            for (func, args) in [
                (datafusion::functions::string::replace(),
                 vec![strings(&subjects), literal(&pattern), literal(&replacement)]),
                (datafusion::functions::regex::regexp_replace(),
                 vec![strings(&subjects), literal(&pattern), literal(&replacement), literal("g")]),
                (datafusion::functions::regex::regexp_replace(),
                 vec![strings(&subjects), literal(".*"), literal(&replacement), literal("g")]),
                (datafusion::functions::unicode::translate(),
                 vec![strings(&subjects), literal(&pattern), literal(&replacement)]),
                (datafusion::functions::string::concat_ws(),
                 vec![literal(&replacement), strings(&subjects), strings(&subjects)]),
                (datafusion::functions::string::concat(),
                 vec![strings(&subjects), literal(&replacement), strings(&subjects)]),
            ] {
                let name = func.name().to_owned();
                let (made, bound) = made_and_bound(func, args, rows);
                prop_assert!(made <= bound, "{name}: made {made} bytes, bound {bound}");
            }
        }
    }

    #[test]
    fn a_call_past_the_limit_is_refused_before_it_is_made_and_names_the_limit() {
        let budget = Budget {
            bytes: 1000,
            rows: 1,
            whole: 1000,
        };
        let guard = guarded(
            &datafusion::functions::string::replace(),
            budget,
            Pass::Written,
        )
        .unwrap();
        let subject = strings(&["a".repeat(100)]);
        let args = vec![subject, literal("a"), literal(&"x".repeat(100))];
        let return_field = Arc::new(Field::new("r", DataType::Utf8, true));
        let refused = guard
            .invoke_with_args(ScalarFunctionArgs {
                arg_fields: args
                    .iter()
                    .map(|a| Arc::new(Field::new("a", a.data_type(), true)))
                    .collect(),
                args,
                number_rows: 1,
                return_field,
                config_options: Arc::new(ConfigOptions::default()),
            })
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("function replace could make")
                && refused.contains("--sql-max-result-bytes"),
            "{refused}"
        );
    }

    #[test]
    fn a_guard_is_not_wrapped_twice_and_equals_its_twin() {
        let budget = Budget {
            bytes: 10,
            rows: 1,
            whole: 10,
        };
        let once = guarded(
            &datafusion::functions::string::concat(),
            budget,
            Pass::Written,
        )
        .unwrap();
        assert!(guarded(&once, budget, Pass::Optimised).is_none());
        let twin = guarded(
            &datafusion::functions::string::concat(),
            budget,
            Pass::Optimised,
        )
        .unwrap();
        assert_eq!(
            once, twin,
            "plans compare calls: the same function guarded alike is equal"
        );
        assert_ne!(
            once,
            guarded(
                &datafusion::functions::string::upper(),
                budget,
                Pass::Optimised
            )
            .unwrap()
        );
    }
}
