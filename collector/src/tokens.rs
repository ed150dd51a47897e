//! `rankwatch tokens --dir DIR`: the collector's three tokens as files, made once.
//!
//! Secure by default needs tokens nobody has to invent: the compose deployment runs this at
//! first start into a volume, points the collector (`--*-token-file`) and Prometheus
//! (`credentials_file`) at the files, and the operator reads the tokens once from its log. Each
//! token is 32 bytes from the operating system's random source, hex-encoded; each file is
//! written whole (temporary file, fsync, rename) with mode 0600 (0644 with `--shared`, for a
//! volume another container's user reads), so a crash leaves either no
//! token or a complete one. Files that exist are kept and not printed again: running it twice
//! changes nothing, and a token already handed out stays valid.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The token files, by the group they open.
pub const FILES: [(&str, &str); 3] = [
    ("ingest", "ingest-token"),
    ("read", "read-token"),
    ("admin", "admin-token"),
];

/// One fresh token: 32 random bytes as 64 hex digits.
fn fresh() -> Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::bad(format!("no random source for a token: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Creates the token files missing in `dir` (mode 0600, or 0644 when `shared`); returns
/// (group, path, token) of each one made.
pub fn create(dir: &Path, shared: bool) -> Result<Vec<(&'static str, PathBuf, String)>> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::bad(format!("cannot create {}: {e}", dir.display())))?;
    let mut made = Vec::new();
    for (group, name) in FILES {
        let path = dir.join(name);
        if path.exists() {
            continue;
        }
        let token = fresh()?;
        let mode = if shared { 0o644 } else { 0o600 };
        crate::fsutil::write_atomic_mode(&path, format!("{token}\n").as_bytes(), Some(mode))?;
        made.push((group, path, token));
    }
    Ok(made)
}

/// What `rankwatch tokens` prints.
pub fn report(dir: &Path, made: &[(&'static str, PathBuf, String)]) -> String {
    if made.is_empty() {
        return format!(
            "the tokens in {} exist already and are not shown again (read them from the files)\n",
            dir.display()
        );
    }
    let mut text = format!(
        "created in {} (shown this once; keep them, the files stay):\n",
        dir.display()
    );
    for (group, path, token) in made {
        text.push_str(&format!("  {group:<6} {token}  ({})\n", path.display()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_made_once_private_and_distinct() {
        let dir = tempfile::tempdir().unwrap();
        let made = create(dir.path(), false).unwrap();
        assert_eq!(made.len(), 3);
        let tokens: std::collections::BTreeSet<&str> =
            made.iter().map(|(_, _, t)| t.as_str()).collect();
        assert_eq!(tokens.len(), 3, "distinct");
        assert!(
            tokens
                .iter()
                .all(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()))
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&made[0].1).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(report(dir.path(), &made).contains(&made[1].2));
        // Again: nothing new, nothing shown, the old tokens kept.
        assert!(create(dir.path(), false).unwrap().is_empty());
        let shared = tempfile::tempdir().unwrap();
        let made = create(shared.path(), true).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&made[1].1).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o644);
        }
        assert!(!report(dir.path(), &[]).contains(&made[0].2));
    }
}
