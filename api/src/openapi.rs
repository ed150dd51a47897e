//! The JSON Schemas of the contract, generated from the types (feature `openapi`):
//! `collector/openapi.json`'s `components.schemas` is exactly [`schemas`], written there by
//! `cargo xtask openapi` and held to it by a test, so the document cannot drift from the code.
//!
//! Two generators, because serde reads and writes differently: request bodies are described as
//! they are *read* (serde's defaults make fields optional; [`Num`] accepts the lenient
//! spellings, schema `InputNum`), answers and events as they are *written* (a field skipped
//! when empty is optional, every other one is always there; [`Num`] writes the strict ones,
//! schema `Num`). A name both produce must come out the same. Two schemas are not types:
//! [`RunId`] and [`MetricName`], the formats the collector checks run ids and metric names
//! against; the metric names come from the analytics crate's vocabulary, passed in.

use std::borrow::Cow;

use schemars::generate::{Contract, SchemaSettings};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde_json::{Map, Value};

use crate::num::{ACCEPTED, NON_FINITE};
use crate::*;

/// Where the document keeps its schemas.
const PATH: &str = "/components/schemas";

/// Every schema of the contract, by name. `metrics` is the metric vocabulary (the analytics
/// crate's, which this crate cannot see), for the `MetricName` pattern.
pub fn schemas(metrics: &[&str]) -> Map<String, Value> {
    let mut requests = generator(Contract::Deserialize);
    requests.subschema_for::<IngestBody>();
    requests.subschema_for::<SqlRequest>();
    requests.subschema_for::<RetentionRequest>();
    requests.subschema_for::<SetProbes>();
    requests.subschema_for::<AckRequest>();
    requests.subschema_for::<NewSilence>();
    let mut answers = generator(Contract::Serialize);
    answers.subschema_for::<Ack>();
    answers.subschema_for::<Runs>();
    answers.subschema_for::<Catalog>();
    answers.subschema_for::<SeriesAnswer>();
    answers.subschema_for::<Heatmap>();
    answers.subschema_for::<Workers>();
    answers.subschema_for::<ConsistencyReport>();
    answers.subschema_for::<Alerts>();
    answers.subschema_for::<AlertFeed>();
    answers.subschema_for::<Incidents>();
    answers.subschema_for::<Silences>();
    answers.subschema_for::<Event>();
    answers.subschema_for::<SqlAnswer>();
    answers.subschema_for::<RulesAnswer>();
    answers.subschema_for::<ProbeSwitch>();
    answers.subschema_for::<Deleted>();
    answers.subschema_for::<RetentionReport>();
    answers.subschema_for::<Health>();
    answers.subschema_for::<ErrorBody>();
    answers.subschema_for::<RunId>();
    let mut all = requests.take_definitions(true);
    for (name, schema) in answers.take_definitions(true) {
        if let Some(read) = all.get(&name) {
            assert_eq!(
                read, &schema,
                "schema {name} differs between requests and answers; name them apart"
            );
        }
        all.insert(name, schema);
    }
    all.insert("MetricName".to_owned(), metric_name(metrics));
    all
}

fn generator(contract: Contract) -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .with(|s| {
            s.definitions_path = PATH.into();
            s.meta_schema = None;
            s.contract = contract;
        })
        .into_generator()
}

/// A `$ref` to schema `name`, defining it with `schema` first if it is not yet.
fn reference(
    generator: &mut SchemaGenerator,
    name: &str,
    schema: impl FnOnce() -> Schema,
) -> Schema {
    if !generator.definitions().contains_key(name) {
        let schema = schema().to_value();
        generator.definitions_mut().insert(name.to_owned(), schema);
    }
    json_schema!({ "$ref": format!("#{PATH}/{name}") })
}

impl JsonSchema for Num {
    fn inline_schema() -> bool {
        // It answers with its own `$ref`: the schema depends on the direction.
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "Num".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        if generator.contract().is_deserialize() {
            let spellings: Vec<&str> = ACCEPTED.iter().map(|(spelling, _)| *spelling).collect();
            reference(generator, "InputNum", || {
                json_schema!({
                    "description": "A float on input: a JSON number, or one of the strings `NaN`, `Infinity`, `-Infinity` (also accepted: `nan`, `inf`, `+Infinity`, `-inf`).",
                    "oneOf": [{ "type": "number" }, { "type": "string", "enum": spellings }]
                })
            })
        } else {
            reference(generator, "Num", || {
                json_schema!({
                    "description": "A float: a JSON number, or a string for NaN and ±Infinity (JSON has no literal for them).",
                    "oneOf": [{ "type": "number" }, { "type": "string", "enum": NON_FINITE }]
                })
            })
        }
    }
}

impl JsonSchema for Override {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "Override".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "The run's override as it was sent (a partial rules document), or null when the run has none; absent when the base rules were asked for.",
            "type": ["object", "null"]
        })
    }
}

/// A run id, as the collector accepts it (the schema `RunId`).
#[derive(Debug)]
pub struct RunId;

impl JsonSchema for RunId {
    fn schema_name() -> Cow<'static, str> {
        "RunId".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "1-128 of `[A-Za-z0-9._-]`, not starting with `.` or `-`, not ending with `.`.",
            "type": "string",
            "minLength": 1,
            "maxLength": 128,
            "pattern": "^(?:[A-Za-z0-9_]|[A-Za-z0-9_][A-Za-z0-9._-]{0,126}[A-Za-z0-9_-])$",
            "examples": ["demo"]
        })
    }
}

/// A metric name, as the collector accepts it (the schema `MetricName`, which [`schemas`]
/// writes from the vocabulary it is given).
#[derive(Debug)]
pub struct MetricName;

impl JsonSchema for MetricName {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "MetricName".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "$ref": format!("#{PATH}/MetricName") })
    }
}

/// The `MetricName` schema: a metric of `vocabulary` or a user scalar.
fn metric_name(vocabulary: &[&str]) -> Value {
    let names: Vec<String> = vocabulary.iter().map(|m| m.replace('.', "\\.")).collect();
    let pattern = format!(
        "^(?:user/[A-Za-z][A-Za-z0-9._:/-]{{0,122}}|{})$",
        names.join("|")
    );
    serde_json::json!({
        "description": "A vocabulary metric, or a user scalar `user/<name>` (`<name>`: 1-123 of `[A-Za-z0-9._:/-]` starting with a letter).",
        "type": "string",
        "minLength": 1,
        "maxLength": 128,
        "pattern": pattern,
        "examples": ["loss"]
    })
}
