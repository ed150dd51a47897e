//! Lossless Arrow round trips for all four tables (NaN and ±Inf included, compared bit for
//! bit), and strict rejection of batches that are not the table's schema.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, UInt32Array};
use proptest::prelude::*;
use rankwatch_analytics::alert::{Alert, AlertState, Rule, Severity};
use rankwatch_analytics::math::SketchKind;
use rankwatch_analytics::schema::{alerts, runs, samples, sketches};
use rankwatch_analytics::vocab::Metric;
use rankwatch_analytics::{
    AttentionShape, LayerLayout, MetricName, ModelLayout, RunId, RunInfo, Sample, Site,
    SketchRecord,
};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Any f64 at all, weighted towards the values that break naive code.
fn any_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => any::<f64>(),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(-0.0),
        1 => Just(f64::MIN_POSITIVE / 2.0),
    ]
}

fn run_id() -> impl Strategy<Value = RunId> {
    "[A-Za-z0-9_]([A-Za-z0-9._-]{0,40}[A-Za-z0-9_-])?".prop_map(|s| RunId::new(s).unwrap())
}

fn metric() -> impl Strategy<Value = MetricName> {
    prop_oneof![
        prop::sample::select(Metric::ALL.to_vec()).prop_map(MetricName::from),
        "user/[a-z][a-z0-9_./:-]{0,30}".prop_map(|s| MetricName::new(s).unwrap()),
    ]
}

fn sample() -> impl Strategy<Value = Sample> {
    (
        run_id(),
        any::<Option<u32>>(),
        any::<u64>(),
        any::<i64>(),
        metric(),
        any::<Option<u32>>(),
        prop::option::of(prop::sample::select(Site::ALL.to_vec())),
        any_value(),
    )
        .prop_map(
            |(run, rank, step, time_ms, metric, layer, site, value)| Sample {
                run,
                rank,
                step,
                time_ms,
                metric,
                layer,
                site,
                value,
            },
        )
}

fn sketch() -> impl Strategy<Value = SketchRecord> {
    (
        run_id(),
        any::<u32>(),
        any::<u64>(),
        any::<i64>(),
        prop::sample::select(vec![SketchKind::Rademacher, SketchKind::CountSketch]),
        any::<u32>(),
        any_value(),
        prop::collection::vec(any::<f32>(), 0..64),
    )
        .prop_map(
            |(run, rank, step, time_ms, kind, seed, norm, vector)| SketchRecord {
                run,
                rank,
                step,
                time_ms,
                kind,
                seed,
                norm,
                vector,
            },
        )
}

fn run_info() -> impl Strategy<Value = RunInfo> {
    (
        run_id(),
        1u32..1024,
        any::<i64>(),
        "[a-z_0-9]{1,12}",
        prop::collection::vec(
            (
                prop::sample::subsequence(Site::MATRICES.to_vec(), 0..=7),
                prop::option::of((1u32..8, 1u32..64).prop_map(|(kv, hd)| AttentionShape {
                    n_heads: kv * 4,
                    n_kv_heads: kv,
                    head_dim: hd,
                })),
                prop::option::of(1u32..64),
            ),
            0..12,
        ),
        prop::collection::btree_map("[a-z]{1,8}", ".{0,16}", 0..4),
    )
        .prop_map(
            |(run, world_size, started_at_ms, family, layers, tags)| RunInfo {
                run,
                world_size,
                started_at_ms,
                layout: ModelLayout {
                    family,
                    layers: layers
                        .into_iter()
                        .enumerate()
                        .map(|(i, (sites, attention, experts))| LayerLayout {
                            index: i as u32,
                            sites,
                            attention,
                            experts,
                        })
                        .collect(),
                },
                tags,
            },
        )
}

fn alert() -> impl Strategy<Value = Alert> {
    (
        (
            run_id(),
            prop::sample::select(Rule::ALL.to_vec()),
            prop::sample::select(Severity::ALL.to_vec()),
            prop::sample::select(AlertState::ALL.to_vec()),
        ),
        (
            any::<Option<u32>>(),
            prop::option::of(prop::sample::select(Site::ALL.to_vec())),
            any::<Option<u32>>(),
            prop::collection::vec(any::<u32>(), 0..5),
        ),
        (any_value(), any_value(), any::<u64>(), any::<u64>()),
        (
            any::<i64>(),
            any::<i64>(),
            any::<Option<i64>>(),
            any::<Option<i64>>(),
            ".{0,80}",
        ),
    )
        .prop_map(
            |(
                (run, rule, severity, state),
                (layer, site, rank, outlier_ranks),
                (value, threshold, first_step, last_step),
                (started_at_ms, updated_at_ms, fired_at_ms, resolved_at_ms, explanation),
            )| Alert {
                id: format!("{run}:{rule}:{first_step}"),
                run,
                rule,
                severity,
                state,
                layer,
                site,
                rank,
                outlier_ranks,
                value,
                threshold,
                first_step,
                last_step,
                started_at_ms,
                updated_at_ms,
                fired_at_ms,
                resolved_at_ms,
                explanation,
            },
        )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn samples_round_trip(rows in prop::collection::vec(sample(), 0..50)) {
        let batch = samples::to_batch(&rows)?;
        let back = samples::from_batch(&batch)?;
        prop_assert_eq!(rows.len(), back.len());
        for (a, b) in rows.iter().zip(&back) {
            prop_assert_eq!(a.value.to_bits(), b.value.to_bits());
            prop_assert_eq!((&a.run, a.rank, a.step, a.time_ms, &a.metric, a.layer, a.site), (&b.run, b.rank, b.step, b.time_ms, &b.metric, b.layer, b.site));
        }
        let nonfinite = rows.iter().filter(|s| !s.value.is_finite()).count();
        prop_assert_eq!(samples::nonfinite_values(&batch)?, nonfinite);
    }

    #[test]
    fn sketches_round_trip(rows in prop::collection::vec(sketch(), 0..20)) {
        let back = sketches::from_batch(&sketches::to_batch(&rows)?)?;
        prop_assert_eq!(rows.len(), back.len());
        for (a, b) in rows.iter().zip(&back) {
            prop_assert_eq!(a.norm.to_bits(), b.norm.to_bits());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&a.vector), bits(&b.vector));
            prop_assert_eq!((&a.run, a.rank, a.step, a.time_ms, a.kind, a.seed), (&b.run, b.rank, b.step, b.time_ms, b.kind, b.seed));
        }
    }

    #[test]
    fn runs_round_trip(rows in prop::collection::vec(run_info(), 0..10)) {
        let back = runs::from_batch(&runs::to_batch(&rows)?)?;
        prop_assert_eq!(rows, back);
    }

    #[test]
    fn alerts_round_trip(rows in prop::collection::vec(alert(), 0..20)) {
        let back = alerts::from_batch(&alerts::to_batch(&rows)?)?;
        prop_assert_eq!(rows.len(), back.len());
        for (a, b) in rows.iter().zip(&back) {
            prop_assert_eq!(a.value.to_bits(), b.value.to_bits());
            prop_assert_eq!(a.threshold.to_bits(), b.threshold.to_bits());
            // Floats compared by bits above; everything else by value.
            let strip = |x: &Alert| Alert { value: 0.0, threshold: 0.0, ..x.clone() };
            prop_assert_eq!(strip(a), strip(b));
        }
    }
}

fn replace_column(
    batch: &RecordBatch,
    name: &str,
    column: ArrayRef,
    field: arrow_schema::Field,
) -> RecordBatch {
    let schema = batch.schema();
    let i = schema.index_of(name).unwrap();
    let mut fields: Vec<arrow_schema::Field> =
        schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    let mut columns = batch.columns().to_vec();
    fields[i] = field;
    columns[i] = column;
    RecordBatch::try_new(Arc::new(arrow_schema::Schema::new(fields)), columns).unwrap()
}

fn two_samples() -> RecordBatch {
    let s = |metric: &str, value: f64| Sample {
        run: RunId::new("r").unwrap(),
        rank: Some(0),
        step: 1,
        time_ms: 5,
        metric: MetricName::new(metric).unwrap(),
        layer: None,
        site: None,
        value,
    };
    samples::to_batch(&[s("loss", 1.0), s("tokens", f64::NAN)]).unwrap()
}

#[test]
fn malformed_batches_are_rejected_with_the_column_named() {
    use arrow_schema::{DataType, Field};
    let batch = two_samples();

    let wrong_type = replace_column(
        &batch,
        "step",
        Arc::new(Int64Array::from(vec![1, 2])),
        Field::new("step", DataType::Int64, false),
    );
    let err = samples::from_batch(&wrong_type).unwrap_err().to_string();
    assert!(
        err.contains("column \"step\" has type Int64, expected UInt64"),
        "{err}"
    );

    let null_in_required = replace_column(
        &batch,
        "value",
        Arc::new(Float64Array::from(vec![Some(1.0), None])),
        Field::new("value", DataType::Float64, true),
    );
    let err = samples::from_batch(&null_in_required)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("column \"value\" is required but row 1 is null"),
        "{err}"
    );

    let bad_run = replace_column(
        &batch,
        "run",
        Arc::new(StringArray::from(vec!["ok", "../../etc"])),
        Field::new("run", DataType::Utf8, false),
    );
    let err = samples::from_batch(&bad_run).unwrap_err().to_string();
    assert!(
        err.starts_with("table samples, row 1: invalid run id \"../../etc\""),
        "{err}"
    );

    let bad_site = replace_column(
        &batch,
        "site",
        Arc::new(StringArray::from(vec![None, Some("mlp")])),
        Field::new("site", DataType::Utf8, true),
    );
    let err = samples::from_batch(&bad_site).unwrap_err().to_string();
    assert!(err.contains("row 1: unknown site \"mlp\""), "{err}");

    let missing = batch.project(&[0, 1, 2, 3, 4, 5, 7]).unwrap();
    let err = samples::from_batch(&missing).unwrap_err().to_string();
    assert!(err.contains("missing column \"site\""), "{err}");

    let mut fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("extra", DataType::UInt32, true));
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::new(UInt32Array::from(vec![1, 2])));
    let extra = RecordBatch::try_new(Arc::new(arrow_schema::Schema::new(fields)), columns).unwrap();
    let err = samples::from_batch(&extra).unwrap_err().to_string();
    assert!(err.contains("unexpected column \"extra\""), "{err}");

    // A samples batch is not a sketches batch.
    let err = sketches::from_batch(&batch).unwrap_err().to_string();
    assert!(err.starts_with("table sketches:"), "{err}");
}

#[test]
fn alerts_table_refuses_a_null_outlier_rank() {
    use arrow_array::builder::{ListBuilder, UInt32Builder};
    let alert = Alert {
        id: "a".into(),
        run: RunId::new("r").unwrap(),
        rule: Rule::SilentInconsistency,
        severity: Severity::Warning,
        state: AlertState::Firing,
        layer: None,
        site: None,
        rank: None,
        outlier_ranks: vec![1],
        value: 7.0,
        threshold: 6.0,
        first_step: 1,
        last_step: 2,
        started_at_ms: 0,
        updated_at_ms: 0,
        fired_at_ms: Some(0),
        resolved_at_ms: None,
        explanation: "x".into(),
    };
    let batch = alerts::to_batch(&[alert]).unwrap();
    let mut list = ListBuilder::new(UInt32Builder::new());
    list.values().append_value(1);
    list.values().append_null();
    list.append(true);
    let field = batch
        .schema()
        .field_with_name("outlier_ranks")
        .unwrap()
        .clone();
    let broken = replace_column(&batch, "outlier_ranks", Arc::new(list.finish()), field);
    let err = alerts::from_batch(&broken).unwrap_err().to_string();
    assert!(err.contains("row 0") && err.contains("null rank"), "{err}");
}

#[test]
fn runs_table_checks_layout_json_and_invariants() {
    let info = RunInfo {
        run: RunId::new("r").unwrap(),
        world_size: 2,
        started_at_ms: 0,
        layout: ModelLayout {
            family: "gpt2".into(),
            layers: vec![],
        },
        tags: BTreeMap::new(),
    };
    let batch = runs::to_batch(&[info]).unwrap();
    let field = batch.schema().field_with_name("layout").unwrap().clone();
    let broken = replace_column(
        &batch,
        "layout",
        Arc::new(StringArray::from(vec!["{not json"])),
        field,
    );
    let err = runs::from_batch(&broken).unwrap_err().to_string();
    assert!(
        err.contains("row 0") && err.contains("column \"layout\""),
        "{err}"
    );
    let field = batch
        .schema()
        .field_with_name("world_size")
        .unwrap()
        .clone();
    let zero = replace_column(
        &batch,
        "world_size",
        Arc::new(UInt32Array::from(vec![0])),
        field,
    );
    let err = runs::from_batch(&zero).unwrap_err().to_string();
    assert!(err.contains("world size must be at least 1"), "{err}");
}
