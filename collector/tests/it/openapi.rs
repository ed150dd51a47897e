//! `collector/openapi.json` is generated where it describes data: its component schemas are the
//! contract's (`rankwatch_api::openapi::schemas`, over the analytics crate's metric
//! vocabulary); the paths, parameters and responses around them are written by hand. This test
//! holds the checked-in file to the types and checks that every `$ref` in it resolves. With
//! `RANKWATCH_WRITE_OPENAPI=1` (what `cargo xtask openapi` sets) it rewrites the schemas
//! instead.

use rankwatch_analytics::Metric;
use serde_json::Value;

const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");

fn generated() -> serde_json::Map<String, Value> {
    let metrics: Vec<&str> = Metric::ALL.iter().map(|m| m.as_str()).collect();
    rankwatch_api::openapi::schemas(&metrics)
}

/// The document `text` with its `components.schemas` replaced by `schemas`, the rest kept as
/// it is, byte for byte (a JSON round trip would sort every object's keys: the document is
/// written for people in its own order). The file is pretty-printed with two-space indents,
/// so the schemas object is the lines from `    "schemas": {` to the next `    }`.
fn with_schemas(text: &str, schemas: &serde_json::Map<String, Value>) -> String {
    const OPEN: &str = "\n    \"schemas\": {\n";
    let start = text.find(OPEN).expect("components.schemas at its place") + OPEN.len() - 2;
    let end = start
        + text[start..]
            .find("\n    }")
            .expect("the end of components.schemas")
        + "\n    }".len();
    let pretty = serde_json::to_string_pretty(schemas).unwrap();
    let indented = pretty.replace('\n', "\n    ");
    format!("{}{}{}", &text[..start], indented, &text[end..])
}

/// Every `$ref` in `v`, with where it was found.
fn refs(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(map) => {
            for (key, value) in map {
                if key == "$ref" {
                    out.push((at.to_owned(), value.as_str().unwrap_or("").to_owned()));
                }
                refs(value, &format!("{at}/{key}"), out);
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                refs(item, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn the_checked_in_document_has_the_contracts_schemas_and_every_reference_resolves() {
    let text = std::fs::read_to_string(PATH).expect("collector/openapi.json is readable");
    let mut doc: Value = serde_json::from_str(&text).expect("collector/openapi.json is JSON");
    assert_eq!(
        doc["openapi"], "3.1.0",
        "the schemas are JSON Schema 2020-12, the dialect of OpenAPI 3.1"
    );
    let schemas = generated();
    if std::env::var_os("RANKWATCH_WRITE_OPENAPI").is_some() {
        std::fs::write(PATH, with_schemas(&text, &schemas))
            .expect("collector/openapi.json is writable");
        doc = serde_json::from_str(&std::fs::read_to_string(PATH).unwrap()).unwrap();
        assert_eq!(
            doc["components"]["schemas"],
            Value::Object(schemas),
            "written as generated"
        );
        return;
    }
    let checked = doc["components"]["schemas"]
        .as_object()
        .expect("components.schemas is an object");
    let mut names: Vec<&String> = checked.keys().chain(schemas.keys()).collect();
    names.sort();
    names.dedup();
    let differ: Vec<&String> = names
        .into_iter()
        .filter(|name| checked.get(*name) != schemas.get(*name))
        .collect();
    assert!(
        differ.is_empty(),
        "collector/openapi.json's schemas differ from the contract's in {differ:?}: run \
         `cargo xtask openapi` and review the diff"
    );

    let mut found = Vec::new();
    refs(&doc, "", &mut found);
    assert!(found.len() > 100, "the document refers to its schemas");
    for (at, target) in found {
        let pointer = target
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("{at}: {target} is not a reference into the document"));
        assert!(
            doc.pointer(pointer).is_some(),
            "{at}: {target} names nothing in the document"
        );
    }
}

/// A documented pattern as a proptest string strategy (it generates, rather than matches: the
/// anchors go).
fn strings_of(schema: &Value) -> proptest::string::RegexGeneratorStrategy<String> {
    let pattern = schema["pattern"].as_str().expect("a pattern");
    let bare = pattern.trim_start_matches('^').trim_end_matches('$');
    proptest::string::string_regex(bare).expect("the pattern is a regex proptest can generate from")
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]

    /// What the document allows, the collector accepts: run ids and metric names drawn from
    /// the documented patterns pass the analytics crate's checks.
    #[test]
    fn names_the_document_allows_are_accepted(
        run in strings_of(&generated()["RunId"]),
        metric in strings_of(&generated()["MetricName"]),
    ) {
        proptest::prop_assert!(rankwatch_analytics::validate::RunId::new(run.clone()).is_ok(), "run id {run:?}");
        proptest::prop_assert!(rankwatch_analytics::validate::MetricName::new(metric.clone()).is_ok(), "metric {metric:?}");
    }
}
