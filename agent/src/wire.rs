//! One batch as it goes on the wire, for code that speaks to a collector as the agent does
//! without running an agent: the request bodies, the idempotency key, the path and the headers.
//! The agent's own sender and transport use exactly these; the operator load generator
//! (`bench/loadgen`) uses them to post what thousands of agents would, byte for byte.

use std::sync::LazyLock;

use rankwatch_analytics::RunId;

use crate::encode::Table;
pub use crate::encode::{Row, runs_body, samples_body, sketches_body};

/// The body's media type: an Arrow IPC stream.
pub const CONTENT_TYPE: &str = "application/vnd.apache.arrow.stream";

/// The idempotency key of an agent session's `seq`-th batch: `run/rank/session/seq`. A
/// collector stores a key once, so a batch retried after a lost answer is not stored twice.
pub fn idempotency_key(run: &RunId, rank: u32, session: &str, seq: u64) -> String {
    format!("{run}/{rank}/{session}/{seq}")
}

/// The path and query of `table`'s ingest endpoint.
pub fn ingest_path(table: Table) -> String {
    format!("/api/v1/ingest?table={}", table.as_str())
}

/// Every batch's headers but its length and the ingest token: the media type, the idempotency
/// `key`, and the sender's release and wire protocol, so that a collector of another release
/// refuses the batch by name instead of misreading it.
pub fn headers(key: &str) -> [(&'static str, &str); 4] {
    [
        ("content-type", CONTENT_TYPE),
        ("idempotency-key", key),
        (rankwatch_api::VERSION_HEADER, rankwatch_api::VERSION),
        (rankwatch_api::PROTOCOL_HEADER, protocol()),
    ]
}

/// [`rankwatch_api::WIRE_PROTOCOL`] as the header carries it, written once.
fn protocol() -> &'static str {
    static PROTOCOL: LazyLock<String> = LazyLock::new(|| rankwatch_api::WIRE_PROTOCOL.to_string());
    &PROTOCOL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_names_its_release_and_protocol_and_the_collector_accepts_them() {
        let run = RunId::new("r").unwrap();
        let key = idempotency_key(&run, 3, "s1", 7);
        assert_eq!(key, "r/3/s1/7");
        let headers = headers(&key);
        let get = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        assert_eq!(get("idempotency-key"), Some("r/3/s1/7"));
        assert_eq!(get("content-type"), Some(CONTENT_TYPE));
        let (version, protocol) = (
            get(rankwatch_api::VERSION_HEADER),
            get(rankwatch_api::PROTOCOL_HEADER),
        );
        assert_eq!(version, Some(rankwatch_api::VERSION));
        assert!(protocol.is_some());
        rankwatch_api::check_peer(version, protocol).unwrap();
        assert_eq!(
            ingest_path(Table::Sketches),
            "/api/v1/ingest?table=sketches"
        );
    }
}
