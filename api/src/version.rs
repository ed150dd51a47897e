//! Which rankwatch is talking: the release version every side prints, and the wire protocol
//! an agent and a collector must share.
//!
//! The version is the workspace's (one number for the collector, the agent and the Python
//! wheel). Compatibility is not decided by comparing versions: a patch release must not stop
//! an agent from reporting to a collector a day older. It is the *wire protocol* — the Arrow
//! schemas of the ingest tables and the meaning of their columns — that an agent declares on
//! every ingest request ([`PROTOCOL_HEADER`], beside its [`VERSION_HEADER`]), and a collector
//! that speaks another refuses the batch with a message naming both versions. The agent keeps
//! a refused batch on disk (`rankwatch sync` sends it once the versions agree), so a mismatch
//! loses nothing. A request that declares no protocol (curl, another language's client, the
//! JSON body) is taken as it is: its body is checked on its own terms.

/// This build's release version: what `rankwatch --version` prints on every side.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The ingest wire protocol this build speaks. Raised when a change to the ingest tables
/// would make one side misread the other's batches.
pub const WIRE_PROTOCOL: u32 = 1;

/// Request header: the sender's release version.
pub const VERSION_HEADER: &str = "rankwatch-version";

/// Request header: the wire protocol the sender speaks.
pub const PROTOCOL_HEADER: &str = "rankwatch-protocol";

/// The run tag under which an agent records its own version in the run's metadata (shown
/// per run by the collector as `agent_version`).
pub const VERSION_TAG: &str = "rankwatch.version";

/// Checks the two headers of an ingest request against this build: `Ok` when the sender
/// declares no protocol or the same one, else the reason to refuse, naming both versions.
pub fn check_peer(version: Option<&str>, protocol: Option<&str>) -> Result<(), String> {
    let Some(protocol) = protocol else {
        return Ok(());
    };
    let sender = version.unwrap_or("of unknown version");
    let theirs: u32 = protocol.trim().parse().map_err(|_| {
        format!(
            "{PROTOCOL_HEADER} must be a whole number, got {protocol:?} (sender rankwatch {sender})"
        )
    })?;
    if theirs == WIRE_PROTOCOL {
        return Ok(());
    }
    Err(format!(
        "agent rankwatch {sender} speaks wire protocol {theirs}, this collector (rankwatch {VERSION}) \
         speaks {WIRE_PROTOCOL}: install the same rankwatch release on both sides; the agent keeps \
         the refused rows for `rankwatch sync`"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_without_a_protocol_or_with_ours_is_accepted() {
        assert_eq!(check_peer(None, None), Ok(()));
        assert_eq!(check_peer(Some("9.9.9"), None), Ok(()));
        assert_eq!(
            check_peer(Some("0.0.1"), Some(&WIRE_PROTOCOL.to_string())),
            Ok(())
        );
    }

    #[test]
    fn another_protocol_is_refused_naming_both_versions() {
        let other = (WIRE_PROTOCOL + 1).to_string();
        let why = check_peer(Some("7.0.0"), Some(&other)).unwrap_err();
        assert!(why.contains("rankwatch 7.0.0"), "{why}");
        assert!(why.contains(&format!("rankwatch {VERSION}")), "{why}");
        assert!(why.contains(&format!("wire protocol {other}")), "{why}");
    }

    #[test]
    fn a_protocol_that_is_not_a_number_is_named() {
        let why = check_peer(None, Some("one")).unwrap_err();
        assert!(
            why.contains("\"one\"") && why.contains(PROTOCOL_HEADER),
            "{why}"
        );
    }
}
