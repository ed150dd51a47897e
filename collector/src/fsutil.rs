//! Durable file replacement: write a temporary file, fsync it, rename it over the target, and
//! fsync the directory, so a crash leaves either the old or the new file, never a torn one.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use rankwatch_analytics::RunId;

use crate::error::Result;

/// The `<run>.json` files in `dir` (none when it does not exist), each with its run; files
/// whose name is not a valid run id are not ours and are left alone.
pub fn run_files(dir: &Path) -> Result<Vec<(RunId, std::path::PathBuf)>> {
    let mut out = Vec::new();
    if !dir.exists() {
        return Ok(out);
    }
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let run = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .and_then(|n| RunId::new(n).ok());
        if let Some(run) = run {
            out.push((run, path));
        }
    }
    Ok(out)
}

/// Atomically replaces `path` with `bytes`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_mode(path, bytes, None)
}

/// [`write_atomic`] with the file's Unix permissions set to `mode` when given (before a byte
/// is written: a token file is never readable by others, not even while being written).
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: Option<u32>) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut options = fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        if let Some(mode) = mode {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(mode);
        }
        #[cfg(not(unix))]
        let _ = mode;
        let mut file = options.open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    sync_parent(path)
}

/// Fsyncs the directory holding `path`, making a create or rename in it durable.
pub fn sync_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent() {
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// This machine's host name (Linux), if it has one.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}
