//! One collector per data directory.
//!
//! Two collectors on one directory would each treat the other's Parquet parts as leftovers of
//! a crash (not in *its* manifest) and delete them, and both would append to one write-ahead
//! log. So the directory is claimed before anything in it is read: an exclusive `flock` on
//! `<data-dir>/LOCK`, held by an open file for the collector's lifetime and released by the
//! kernel when the process ends, however it ends (a `kill -9` leaves no stale lock to clean
//! up). The file also says who holds it, for the refusal message. `flock` is advisory and
//! local: it does not fence a second collector on another machine sharing a network file
//! system, nor two collectors writing one S3 prefix (see `store::backend`).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The claim on a data directory; dropping it releases the directory.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

impl DirLock {
    /// Claims `dir` (creating it), or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("LOCK");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => "another process".to_owned(),
                    h => h.to_owned(),
                };
                return Err(Error::Unavailable(format!(
                    "data directory {} is in use by another collector ({holder}); stop it, or \
                     give this one its own --data-dir",
                    dir.display()
                )));
            }
            Err(TryLockError::Error(e)) => return Err(e.into()),
        }
        // Who holds it, for the message a second collector prints; the lock is what counts.
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        file.set_len(0)?;
        file.rewind()?;
        write!(file, "pid {}, since unix time {since}", std::process::id())?;
        Ok(DirLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
