//! How numbers, times and names read on the page.

use rankwatch_api::Rule;

/// A value with about three significant digits; non-finite values spelled out.
pub(crate) fn num(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(v) if v.is_nan() => "NaN".into(),
        Some(v) if v.is_infinite() => if v > 0.0 { "+inf" } else { "−inf" }.into(),
        Some(v) => {
            let a = v.abs();
            if a == 0.0 {
                "0".into()
            } else if !(1e-3..1e5).contains(&a) {
                format!("{v:.2e}")
            } else if a >= 100.0 {
                format!("{v:.0}")
            } else if a >= 10.0 {
                format!("{v:.1}")
            } else if a >= 1.0 {
                format!("{v:.2}")
            } else {
                format!("{v:.3}")
            }
        }
    }
}

/// "12 s ago", "3 min ago", … from a Unix-millisecond time.
pub(crate) fn ago(ms: Option<i64>) -> String {
    let Some(ms) = ms else {
        return "never".into();
    };
    let secs = ((js_sys::Date::now() as i64 - ms) / 1000).max(0);
    match secs {
        0..=59 => format!("{secs} s ago"),
        60..=3599 => format!("{} min ago", secs / 60),
        3600..=86_399 => format!("{} h ago", secs / 3600),
        _ => format!("{} d ago", secs / 86_400),
    }
}

/// An ISO-like local time of a Unix-millisecond time.
pub(crate) fn time(ms: Option<i64>) -> String {
    match ms {
        None => "–".into(),
        Some(ms) => {
            let d = js_sys::Date::new(&wasm_bindgen::JsValue::from_f64(ms as f64));
            String::from(d.to_locale_string("sv-SE", &wasm_bindgen::JsValue::UNDEFINED))
        }
    }
}

/// The words a rule goes by on the page.
pub(crate) fn rule_label(rule: Rule) -> &'static str {
    match rule {
        Rule::RankCollapse => "rank collapse",
        Rule::SilentInconsistency => "silent inconsistency",
        Rule::Nonfinite => "non-finite",
        Rule::LossSpike => "loss spike",
        Rule::ActivationOutlier => "activation outlier",
        Rule::StaleRank => "stale rank",
        Rule::ReplicaDivergence => "replica divergence",
    }
}

/// The label of a per-layer series: "layer 3", "layer 3 · v".
pub(crate) fn layer_label(layer: Option<u32>, site: Option<&str>) -> String {
    match (layer, site) {
        (Some(l), Some(s)) => format!("layer {l} · {s}"),
        (Some(l), None) => format!("layer {l}"),
        (None, Some(s)) => s.into(),
        (None, None) => "all".into(),
    }
}
