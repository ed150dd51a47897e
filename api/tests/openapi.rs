//! `collector/openapi.json` describes the contract for clients that do not use this crate.
//! This test holds it to the types: for every component schema named after a contract type,
//! the properties are exactly the fields the type writes, the required ones exactly those it
//! always writes, and every enum lists exactly the type's names. A field added, renamed or
//! dropped here without the document following fails it, naming the schema and the field.

use std::collections::BTreeSet;

use rankwatch_api::*;
use serde::Serialize;
use serde_json::{Value, json};

fn spec() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../collector/openapi.json");
    let text = std::fs::read_to_string(path).expect("collector/openapi.json is readable");
    serde_json::from_str(&text).expect("collector/openapi.json is JSON")
}

fn schema<'a>(spec: &'a Value, name: &str) -> &'a Value {
    spec.pointer(&format!("/components/schemas/{name}"))
        .unwrap_or_else(|| panic!("openapi.json has no component schema {name}"))
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().expect("an object").keys().cloned().collect()
}

/// `full` sets every optional field, `bare` none: what `full` writes must be the schema's
/// properties, what `bare` writes its required list.
fn same_fields(spec: &Value, name: &str, full: impl Serialize, bare: impl Serialize) {
    let s = schema(spec, name);
    let properties = keys(&s["properties"]);
    let required: BTreeSet<String> = s["required"]
        .as_array()
        .map(|r| r.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default();
    let written = keys(&serde_json::to_value(full).unwrap());
    let always = keys(&serde_json::to_value(bare).unwrap());
    assert_eq!(
        properties, written,
        "schema {name}: properties (left) differ from the fields the type writes (right)"
    );
    assert_eq!(
        required, always,
        "schema {name}: required (left) differs from the fields the type always writes (right)"
    );
}

fn same_enum(spec: &Value, pointer: &str, names: &[&str]) {
    let listed: Vec<&str> = spec
        .pointer(pointer)
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("openapi.json has no enum at {pointer}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(listed, names, "enum at {pointer}");
}

fn alert() -> Alert {
    Alert {
        id: "a".into(),
        run: "r".into(),
        rule: Rule::LossSpike,
        severity: Severity::Warning,
        state: AlertState::Firing,
        layer: Some(1),
        site: Some("mlp".into()),
        rank: Some(0),
        outlier_ranks: vec![1],
        value: Some(1.0),
        threshold: Some(2.0),
        first_step: 1,
        last_step: 2,
        started_at_ms: 0,
        updated_at_ms: 0,
        fired_at_ms: Some(0),
        resolved_at_ms: None,
        explanation: "x".into(),
    }
}

fn bucket() -> Bucket {
    Bucket {
        start: 0,
        end: 1,
        count: 1,
        nonfinite: 0,
        min: None,
        max: None,
        last: None,
        last_step: 1,
    }
}

const RANGE: BucketRange = BucketRange {
    from: 0,
    to: 9,
    width: 1,
    count: 10,
};

#[test]
fn component_schemas_match_the_contract_types() {
    let spec = spec();
    let spec = &spec;
    same_fields(
        spec,
        "Error",
        ErrorBody {
            error: "e".into(),
            reason: ErrorReason::Sql,
        },
        json!({"error": "", "reason": ""}),
    );
    let reasons: Vec<&str> = ErrorReason::ALL.iter().map(|r| r.as_str()).collect();
    same_enum(
        spec,
        "/components/schemas/Error/properties/reason/enum",
        &reasons,
    );
    same_enum(
        spec,
        "/components/schemas/NonFinite/enum",
        &["NaN", "Infinity", "-Infinity"],
    );
    let ack = |seq| Ack {
        status: AckStatus::Stored,
        run: "r".into(),
        rows: 1,
        nonfinite: 0,
        seq,
    };
    same_fields(spec, "Ack", ack(Some(1)), ack(None));
    // The JSON ingest body and the layout its info carries.
    let attention = AttentionShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
    };
    same_fields(spec, "AttentionShape", attention, attention);
    let layer = |full: bool| LayerLayout {
        index: 0,
        sites: vec![Site::Q],
        attention: full.then_some(attention),
        experts: full.then_some(8),
    };
    same_fields(spec, "LayerLayout", layer(true), layer(false));
    let layout = ModelLayout {
        family: "gpt2".into(),
        layers: vec![layer(false)],
    };
    same_fields(spec, "ModelLayout", &layout, &layout);
    same_enum(spec, "/components/schemas/Site/enum", Site::NAMES);
    let info = |full: bool| IngestInfo {
        world_size: 2,
        started_at_ms: full.then_some(1),
        layout: if full {
            layout.clone()
        } else {
            ModelLayout::default()
        },
        tags: if full {
            [("k".to_owned(), "v".to_owned())].into()
        } else {
            Default::default()
        },
    };
    same_fields(spec, "IngestInfo", info(true), info(false));
    let sample = |full: bool| IngestSample {
        rank: full.then_some(0),
        step: 1,
        time_ms: full.then_some(1),
        metric: "loss".into(),
        layer: full.then_some(0),
        site: full.then(|| "q".to_owned()),
        value: Num(1.0),
    };
    same_fields(spec, "IngestSample", sample(true), sample(false));
    let sketch = |full: bool| IngestSketch {
        rank: 0,
        step: 1,
        time_ms: full.then_some(1),
        kind: SketchKind::Rademacher,
        seed: 7,
        norm: Num(1.0),
        vector: vec![0.5],
    };
    same_fields(spec, "IngestSketch", sketch(true), sketch(false));
    same_enum(
        spec,
        "/components/schemas/IngestSketch/properties/kind/enum",
        SketchKind::NAMES,
    );
    let body = |full: bool| IngestBody {
        run: "r".into(),
        info: full.then(|| info(false)),
        samples: if full { vec![sample(false)] } else { vec![] },
        sketches: if full { vec![sketch(false)] } else { vec![] },
    };
    same_fields(spec, "IngestBody", body(true), body(false));
    same_enum(
        spec,
        "/components/schemas/Ack/properties/status/enum",
        &["stored", "duplicate"],
    );
    let run = RunSummary {
        run: "r".into(),
        world_size: None,
        family: None,
        layers: None,
        started_at_ms: None,
        tags: None,
        first_step: None,
        last_step: None,
        last_seen_ms: None,
        samples: 0,
        nonfinite: 0,
        sketches: 0,
        series: 0,
        bytes: 0,
        alerts_firing: 0,
    };
    same_fields(spec, "RunSummary", &run, &run);
    same_fields(spec, "Runs", Runs { runs: vec![] }, Runs { runs: vec![] });
    let metric = CatalogMetric {
        metric: "loss".into(),
        scope: None,
        user: true,
        layers: vec![],
        sites: vec![],
        ranks: vec![],
        series: 1,
    };
    same_fields(spec, "CatalogMetric", &metric, &metric);
    same_enum(
        spec,
        "/components/schemas/CatalogMetric/properties/scope/enum",
        &["rank", "layer", "all_ranks"],
    );
    let catalog = Catalog {
        run: "r".into(),
        metrics: vec![],
    };
    same_fields(spec, "Catalog", &catalog, &catalog);
    same_fields(spec, "BucketRange", RANGE, RANGE);
    same_fields(spec, "Bucket", bucket(), bucket());
    let series = Series {
        layer: None,
        site: None,
        rank: None,
        buckets: vec![],
    };
    same_fields(spec, "Series", &series, &series);
    let answer = SeriesAnswer {
        run: "r".into(),
        metric: "loss".into(),
        buckets: RANGE,
        series: vec![],
    };
    same_fields(spec, "SeriesAnswer", &answer, &answer);
    let heatmap = Heatmap {
        run: "r".into(),
        metric: "m".into(),
        site: None,
        buckets: RANGE,
        steps: vec![],
        layers: vec![],
        last: vec![],
        min: vec![],
        max: vec![],
        count: vec![],
        nonfinite: vec![],
    };
    same_fields(spec, "Heatmap", &heatmap, &heatmap);
    let worker = WorkerMetric {
        metric: "loss".into(),
        layer: None,
        site: None,
        values: vec![],
    };
    same_fields(spec, "WorkerMetric", &worker, &worker);
    let matrix = CosineMatrix {
        ranks: vec![],
        matrix: vec![],
        pair_mean: None,
    };
    same_fields(spec, "CosineMatrix", &matrix, &matrix);
    let error = Cosine::Error { error: "e".into() };
    same_fields(spec, "CosineError", &error, &error);
    let workers = Workers {
        run: "r".into(),
        step: None,
        world_size: None,
        ranks: vec![],
        metrics: vec![],
        cosine: None,
    };
    same_fields(spec, "Workers", &workers, &workers);
    same_fields(spec, "Alert", alert(), alert());
    let alert_schema = "/components/schemas/Alert/properties";
    same_enum(spec, &format!("{alert_schema}/rule/enum"), Rule::NAMES);
    same_enum(
        spec,
        &format!("{alert_schema}/severity/enum"),
        Severity::NAMES,
    );
    same_enum(
        spec,
        &format!("{alert_schema}/state/enum"),
        AlertState::NAMES,
    );
    same_fields(
        spec,
        "Alerts",
        Alerts { alerts: vec![] },
        Alerts { alerts: vec![] },
    );
    let feed = AlertFeed {
        epoch: 1,
        revision: 2,
        alerts: vec![],
    };
    same_fields(spec, "AlertFeed", &feed, &feed);
    let sql = SqlAnswer {
        columns: vec![],
        rows: vec![],
        truncated: false,
    };
    same_fields(spec, "SqlAnswer", &sql, &sql);
    let sql = SqlRequest {
        sql: "select 1".into(),
    };
    same_fields(spec, "SqlRequest", &sql, &sql);
    same_fields(
        spec,
        "RulesAnswer",
        RulesAnswer {
            run: Some("r".into()),
            rules: json!({}),
            overrides: Override::None,
        },
        RulesAnswer {
            run: None,
            rules: json!({}),
            overrides: Override::Absent,
        },
    );
    let deleted = Deleted::default();
    same_fields(spec, "Deleted", &deleted, &deleted);
    same_fields(
        spec,
        "RetentionRequest",
        RetentionRequest {
            max_age: Some("1d".into()),
            max_bytes: Some(ByteSize::Bytes(1)),
            dry_run: true,
        },
        json!({}),
    );
    let report = |over_cap| RetentionReport {
        dry_run: true,
        deleted: vec![],
        bytes_left: 0,
        over_cap,
    };
    same_fields(
        spec,
        "RetentionReport",
        report(Some("x".into())),
        report(None),
    );
    let doomed = Doomed {
        run: "r".into(),
        reason: RetentionReason::Age,
        bytes: 0,
        last_seen_ms: 0,
    };
    same_fields(spec, "Doomed", &doomed, &doomed);
    same_enum(
        spec,
        "/components/schemas/Doomed/properties/reason/enum",
        &["age", "size"],
    );
    let switch = ProbeSwitch {
        run: "r".into(),
        on: None,
        revision: 0,
        changed_ms: None,
    };
    same_fields(spec, "ProbeSwitch", &switch, &switch);
    same_fields(
        spec,
        "SetProbes",
        SetProbes { on: true },
        SetProbes { on: true },
    );
    same_fields(
        spec,
        "Health",
        Health {
            status: "failing".into(),
            reason: Some("write-ahead log write failed".into()),
        },
        Health {
            status: "ok".into(),
            reason: None,
        },
    );
}

#[test]
fn every_event_has_its_schema_and_the_stream_lists_every_name() {
    let spec = spec();
    let events = [
        (
            "SamplesEvent",
            Event::Samples {
                run: "r".into(),
                rows: 1,
                first_step: 0,
                last_step: 0,
            },
        ),
        (
            "RunEvent",
            Event::Run {
                run: "r".into(),
                world_size: 1,
            },
        ),
        (
            "AlertEvent",
            Event::Alert {
                alert: Box::new(alert()),
            },
        ),
        ("RunDeletedEvent", Event::RunDeleted { run: "r".into() }),
        ("LaggedEvent", Event::Lagged { missed: 1 }),
    ];
    assert_eq!(events.len(), Event::NAMES.len());
    for (name, event) in &events {
        same_fields(&spec, name, event, event);
        same_enum(
            &spec,
            &format!("/components/schemas/{name}/properties/type/enum"),
            &[event.name()],
        );
    }
    let description = spec
        .pointer("/paths/~1api~1v1~1events/get/description")
        .and_then(Value::as_str)
        .unwrap();
    for name in Event::NAMES {
        assert!(
            description.contains(&format!("`{name}`")),
            "the events description omits {name}"
        );
    }
}
