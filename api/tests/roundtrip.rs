//! Every contract type survives JSON and back unchanged, for generated values (non-finite
//! floats and odd strings included), and the wire spellings other clients rely on are pinned.

use std::collections::BTreeMap;
use std::fmt::Debug;

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use rankwatch_api::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let text = serde_json::to_string(value).expect("serialises");
    let back: T = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    assert_eq!(&back, value, "{text}");
}

fn num() -> impl Strategy<Value = Num> + Clone {
    prop_oneof![
        any::<f64>().prop_map(Num),
        Just(Num(f64::NAN)),
        Just(Num(f64::INFINITY)),
        Just(Num(f64::NEG_INFINITY)),
        Just(Num(-0.0)),
    ]
}

fn finite() -> impl Strategy<Value = f64> {
    any::<f64>().prop_filter("finite", |v| v.is_finite())
}

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,12}"
}

fn alert() -> impl Strategy<Value = Alert> {
    (
        (
            text(),
            text(),
            0..Rule::ALL.len(),
            0..Severity::ALL.len(),
            0..AlertState::ALL.len(),
        ),
        (
            option::of(any::<u32>()),
            option::of(text()),
            option::of(any::<u32>()),
        ),
        (
            vec(any::<u32>(), 0..4),
            option::of(finite()),
            option::of(finite()),
        ),
        (any::<u64>(), any::<u64>(), any::<i64>(), any::<i64>()),
        (option::of(any::<i64>()), option::of(any::<i64>()), text()),
    )
        .prop_map(|(a, b, c, d, e)| Alert {
            id: a.0,
            run: a.1,
            rule: Rule::ALL[a.2],
            severity: Severity::ALL[a.3],
            state: AlertState::ALL[a.4],
            layer: b.0,
            site: b.1,
            rank: b.2,
            outlier_ranks: c.0,
            value: c.1,
            threshold: c.2,
            first_step: d.0,
            last_step: d.1,
            started_at_ms: d.2,
            updated_at_ms: d.3,
            fired_at_ms: e.0,
            resolved_at_ms: e.1,
            explanation: e.2,
        })
}

fn bucket_range() -> impl Strategy<Value = BucketRange> {
    (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(from, to, width, count)| {
        BucketRange {
            from,
            to,
            width,
            count,
        }
    })
}

fn bucket() -> impl Strategy<Value = Bucket> {
    (
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        (
            option::of(num()),
            option::of(num()),
            option::of(num()),
            any::<u64>(),
        ),
    )
        .prop_map(|(a, b)| Bucket {
            start: a.0,
            end: a.1,
            count: a.2,
            nonfinite: a.3,
            min: b.0,
            max: b.1,
            last: b.2,
            last_step: b.3,
        })
}

fn grid<T: Strategy>(cell: T) -> impl Strategy<Value = Vec<Vec<T::Value>>> {
    vec(vec(cell, 0..4), 0..4)
}

proptest! {
    #[test]
    fn num_round_trips(v in num()) {
        round_trip(&v);
        round_trip(&Some(v));
    }

    #[test]
    fn alerts_round_trip(alerts in vec(alert(), 0..4), epoch in any::<i64>(), revision in any::<u64>()) {
        round_trip(&Alerts { alerts: alerts.clone() });
        round_trip(&AlertFeed { epoch, revision, alerts: alerts.clone() });
        for a in alerts {
            round_trip(&Event::Alert { alert: Box::new(a) });
        }
    }

    #[test]
    fn series_round_trip(run in text(), metric in text(), buckets in bucket_range(),
                         series in vec((option::of(any::<u32>()), option::of(text()),
                                        option::of(any::<u32>()), vec(bucket(), 0..4)), 0..4)) {
        let series = series
            .into_iter()
            .map(|(layer, site, rank, buckets)| Series { layer, site, rank, buckets })
            .collect();
        round_trip(&SeriesAnswer { run, metric, buckets, series });
    }

    #[test]
    fn heatmaps_round_trip(run in text(), site in option::of(text()), buckets in bucket_range(),
                           steps in vec(any::<u64>(), 0..4), layers in vec(any::<u32>(), 0..4),
                           last in grid(option::of(num())), min in grid(option::of(num())),
                           max in grid(option::of(num())), count in grid(any::<u64>()),
                           nonfinite in grid(any::<u64>())) {
        round_trip(&Heatmap {
            run, metric: "loss".into(), site, buckets, steps, layers, last, min, max, count,
            nonfinite,
        });
    }

    #[test]
    fn workers_round_trip(step in option::of(any::<u64>()), world in option::of(any::<u32>()),
                          ranks in vec(any::<u32>(), 0..4),
                          metrics in vec((text(), option::of(any::<u32>()), option::of(text()),
                                          vec(option::of(num()), 0..4)), 0..3),
                          matrix in grid(num()), pair_mean in option::of(num()),
                          which in 0..3u8, error in text()) {
        let cosine = match which {
            0 => None,
            1 => Some(Cosine::Matrix(CosineMatrix { ranks: ranks.clone(), matrix, pair_mean })),
            _ => Some(Cosine::Error { error }),
        };
        let metrics = metrics
            .into_iter()
            .map(|(metric, layer, site, values)| WorkerMetric { metric, layer, site, values })
            .collect();
        round_trip(&Workers { run: "r".into(), step, world_size: world, ranks, metrics, cosine });
    }

    #[test]
    fn runs_and_catalogs_round_trip(run in text(), n in any::<u64>(), opt in option::of(any::<u32>()),
                                    tags in option::of(proptest::collection::btree_map(text(), text(), 0..3)),
                                    scope in option::of(0..3usize), layers in vec(any::<u32>(), 0..4)) {
        round_trip(&Runs { runs: vec![RunSummary {
            run: run.clone(), world_size: opt, family: Some("gpt2".into()), layers: opt,
            started_at_ms: Some(-1), tags, agent_version: opt.map(|v| format!("0.{v}.0")), first_step: Some(n), last_step: None,
            last_seen_ms: None, samples: n, nonfinite: 0, sketches: n, series: 1, bytes: n,
            alerts_firing: 2,
        }]});
        let scope = scope.map(|i| [MetricScope::Rank, MetricScope::Layer, MetricScope::AllRanks][i]);
        round_trip(&Catalog { run, metrics: vec![CatalogMetric {
            metric: "loss".into(), scope, user: scope.is_none(), layers: layers.clone(),
            sites: vec!["mlp".into()], ranks: layers, series: n,
        }]});
    }

    #[test]
    fn operations_round_trip(run in text(), n in any::<u64>(), ms in any::<i64>(),
                             on in option::of(any::<bool>()), flag in any::<bool>(),
                             message in text(), reason in 0..ErrorReason::ALL.len()) {
        round_trip(&Ack { status: if flag { AckStatus::Stored } else { AckStatus::Duplicate },
                          run: run.clone(), rows: n, nonfinite: n / 2, seq: flag.then_some(n) });
        round_trip(&ProbeSwitch { run: run.clone(), on, revision: n, changed_ms: on.map(|_| ms) });
        round_trip(&SetProbes { on: flag });
        round_trip(&Deleted { run: run.clone(), files: n, bytes: n, rows: n, alerts: 1 });
        round_trip(&RetentionRequest {
            max_age: flag.then(|| "30d".into()),
            max_bytes: Some(if flag { ByteSize::Bytes(n) } else { ByteSize::Text(message.clone()) }),
            dry_run: flag,
        });
        round_trip(&RetentionReport {
            dry_run: flag,
            deleted: vec![Doomed { run: run.clone(), reason: RetentionReason::Size, bytes: n, last_seen_ms: ms }],
            bytes_left: n,
            over_cap: flag.then(|| message.clone()),
        });
        round_trip(&ErrorBody { error: message.clone(), reason: ErrorReason::ALL[reason] });
        round_trip(&SqlRequest { sql: message });
        round_trip(&Event::Samples { run: run.clone(), rows: n, first_step: n, last_step: n });
        round_trip(&Event::Run { run: run.clone(), world_size: 4 });
        round_trip(&Event::RunDeleted { run });
        round_trip(&Event::Lagged { missed: n });
    }

    #[test]
    fn ingest_bodies_round_trip(run in text(), n in any::<u64>(), ms in option::of(any::<i64>()),
                                rank in option::of(any::<u32>()), value in num(), norm in num(),
                                site in 0..Site::ALL.len(), sparse in any::<bool>(), flag in any::<bool>(),
                                vector in vec(any::<f32>().prop_filter("finite", |v| v.is_finite()), 0..4)) {
        let layout = ModelLayout {
            family: if flag { "llama".into() } else { String::new() },
            layers: vec![LayerLayout {
                index: 0,
                sites: vec![Site::ALL[site]],
                attention: flag.then_some(AttentionShape { n_heads: 8, n_kv_heads: 2, head_dim: 64 }),
                experts: rank,
            }],
        };
        round_trip(&IngestBody {
            run: run.clone(),
            info: flag.then(|| IngestInfo {
                world_size: 4,
                started_at_ms: ms,
                layout: if sparse { ModelLayout::default() } else { layout.clone() },
                tags: [(run.clone(), "v".to_owned())].into(),
            }),
            samples: vec![IngestSample {
                rank,
                step: n,
                time_ms: ms,
                metric: "loss".into(),
                layer: rank,
                site: flag.then(|| Site::ALL[site].to_string()),
                value,
            }],
            sketches: if sparse { vec![] } else { vec![IngestSketch {
                rank: 0,
                step: n,
                time_ms: ms,
                kind: if flag { SketchKind::Rademacher } else { SketchKind::CountSketch },
                seed: 3,
                norm,
                vector,
            }] },
        });
    }
}

#[test]
fn an_ingest_body_refuses_unknown_fields_and_names_what_it_reads() {
    let misspelt = r#"{"run":"r","samples":[{"step":1,"metirc":"loss","value":1}]}"#;
    let e = serde_json::from_str::<IngestBody>(misspelt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `metirc`"), "{e}");
    let body: IngestBody = serde_json::from_str(
        r#"{"run":"r","samples":[{"step":1,"metric":"loss","value":"-inf"}],"sketches":[{"rank":0,"step":1,"kind":"countsketch","seed":1,"norm":"NaN","vector":[1.5]}]}"#,
    )
    .unwrap();
    assert_eq!(body.samples[0].value.get(), f64::NEG_INFINITY);
    assert!(body.sketches[0].norm.get().is_nan());
    assert_eq!(body.sketches[0].kind, SketchKind::CountSketch);
    let e = serde_json::from_str::<IngestBody>(r#"{"run":"r","sketches":[{"rank":0,"step":1,"kind":"dense","seed":1,"norm":1,"vector":[]}]}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown variant `dense`"), "{e}");
    assert_eq!(
        "elbow".parse::<Site>().unwrap_err().to_string(),
        "unknown site \"elbow\"; expected one of q, k, v, o, up, gate, down, embed, residual, attn_out, mlp_out, final_norm"
    );
}

#[test]
fn non_finite_floats_use_the_documented_spellings() {
    let v = json!([
        Num(f64::NAN),
        Num(f64::INFINITY),
        Num(f64::NEG_INFINITY),
        Num(1.5),
        None::<Num>
    ]);
    assert_eq!(v, json!(["NaN", "Infinity", "-Infinity", 1.5, null]));
    for (text, v) in [
        ("inf", f64::INFINITY),
        ("+Infinity", f64::INFINITY),
        ("-inf", f64::NEG_INFINITY),
    ] {
        assert_eq!(
            serde_json::from_value::<Num>(json!(text)).unwrap(),
            Num(v),
            "{text}"
        );
    }
    assert!(
        serde_json::from_value::<Num>(json!("nan"))
            .unwrap()
            .get()
            .is_nan()
    );
    for bad in [r#""INF""#, r#""Inf""#, r#""1.5""#, r#""""#, "true", "{}"] {
        let err = serde_json::from_str::<Num>(bad).unwrap_err().to_string();
        assert!(
            err.contains(r#""NaN", "Infinity", "-Infinity""#),
            "{bad}: {err}"
        );
    }
    assert_eq!(serde_json::from_str::<Num>("7").unwrap(), Num(7.0));
}

#[test]
fn events_carry_their_name_as_type() {
    let events = [
        Event::Samples {
            run: "r".into(),
            rows: 1,
            first_step: 2,
            last_step: 3,
        },
        Event::Run {
            run: "r".into(),
            world_size: 2,
        },
        Event::RunDeleted { run: "r".into() },
        Event::Lagged { missed: 5 },
    ];
    for e in events {
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], e.name(), "{v}");
        assert!(
            Event::NAMES.contains(&e.name()),
            "{} is not in Event::NAMES",
            e.name()
        );
    }
    let deleted: Event = serde_json::from_str(r#"{"type":"run_deleted","run":"a"}"#).unwrap();
    assert_eq!(deleted.run(), Some("a"));
    assert!(serde_json::from_str::<Event>(r#"{"type":"exploded"}"#).is_err());
}

#[test]
fn vocabularies_parse_their_own_names_and_name_the_rest() {
    for r in Rule::ALL {
        assert_eq!(r.as_str().parse::<Rule>().unwrap(), *r);
        assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
    }
    for r in ErrorReason::ALL {
        assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
    }
    let err = "boom".parse::<Severity>().unwrap_err().to_string();
    assert_eq!(
        err,
        r#"unknown severity "boom"; expected one of info, warning, critical"#
    );
}

#[test]
fn rules_answers_tell_absent_from_null_overrides() {
    let base = RulesAnswer {
        run: None,
        rules: json!({"loss_spike": {"z": 6.0}}),
        overrides: Override::Absent,
    };
    assert_eq!(
        serde_json::to_value(&base).unwrap(),
        json!({"rules": {"loss_spike": {"z": 6.0}}})
    );
    let none = RulesAnswer {
        run: Some("r".into()),
        rules: json!({}),
        overrides: Override::None,
    };
    assert_eq!(
        serde_json::to_value(&none).unwrap(),
        json!({"run": "r", "rules": {}, "override": null})
    );
    round_trip(&none);
    let set = RulesAnswer {
        overrides: Override::Set(json!({"x": 1})),
        ..none
    };
    round_trip(&set);
    let tags: Tags = BTreeMap::from([("a".into(), "b".into())]);
    assert_eq!(serde_json::to_value(tags).unwrap(), json!({"a": "b"}));
}

#[test]
fn sizes_name_what_they_accept() {
    for bad in ["-1", "1.5", "true", "[]"] {
        let body = format!(r#"{{"max_bytes": {bad}}}"#);
        let err = serde_json::from_str::<RetentionRequest>(&body)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(r#"a non-negative number of bytes or a size like "50GB""#),
            "{bad}: {err}"
        );
    }
    let err = serde_json::from_str::<RetentionRequest>(r#"{"max_rows": 1}"#).unwrap_err();
    assert!(err.to_string().contains("max_rows"), "{err}");
}

#[test]
fn site_and_sketch_kind_names_are_their_serde_names() {
    for &site in Site::ALL {
        assert_eq!(serde_json::to_value(site).unwrap(), json!(site.as_str()));
        assert_eq!(site.as_str().parse::<Site>().unwrap(), site);
    }
    for &kind in SketchKind::ALL {
        assert_eq!(serde_json::to_value(kind).unwrap(), json!(kind.as_str()));
        assert_eq!(kind.as_str().parse::<SketchKind>().unwrap(), kind);
    }
}
