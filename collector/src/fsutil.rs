//! Durable file replacement: write a temporary file, fsync it, rename it over the target, and
//! fsync the directory, so a crash leaves either the old or the new file, never a torn one.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use crate::error::Result;

/// Atomically replaces `path` with `bytes`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut file = File::create(&tmp)?;
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
