//! The file-system seam of what must survive: every create, write, fsync, rename, truncation
//! and delete of the write-ahead log and of the Parquet side (parts and manifest) goes through
//! a [`Disk`].
//!
//! Production uses [`RealDisk`] (`std::fs`). Tests and drills use the disks that fail:
//! [`faulty::FaultyDisk`] fails writes or fsyncs as a full disk does, and
//! [`model::PowerCutDisk`] keeps a model of what a power cut would leave (only fsynced
//! contents and fsynced directory entries, LazyFS's idea). That keeps fault injection out of
//! the production path (no counters consulted on every write), as Vector's disk buffer does
//! with its `Filesystem` trait. Reads stay on `std::fs`: what is read was written through the
//! seam.

pub mod faulty;
pub mod model;

use std::fmt::Debug;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;
use std::sync::Arc;

/// A file being written through a [`Disk`].
pub trait DiskFile: Write + Send {
    /// Makes the file's content durable (`fsync`).
    fn sync_all(&mut self) -> io::Result<()>;
    /// Makes the file's content durable without its metadata where that is cheaper
    /// (`fdatasync`): what the log's group commit calls.
    fn sync_data(&mut self) -> io::Result<()> {
        self.sync_all()
    }
    /// Its size now, in bytes.
    fn size(&self) -> io::Result<u64>;
}

/// What the store asks of the file system it writes to.
pub trait Disk: Send + Sync + Debug {
    /// Creates `dir` and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Creates (or truncates) `path` for writing.
    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>>;
    /// Opens `path` for appending, creating it when missing.
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn DiskFile>>;
    /// Cuts `path` to `len` bytes and makes that durable (the file's fsync).
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Renames `from` over `to` (atomic replacement).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Deletes a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Deletes an empty directory (fails on a non-empty one).
    fn remove_dir(&self, dir: &Path) -> io::Result<()>;
    /// Makes the creates, renames and deletes in `dir` durable (a directory fsync).
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// A shared disk.
pub type SharedDisk = Arc<dyn Disk>;

/// The machine's file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealDisk;

impl RealDisk {
    /// The real disk, shared.
    pub fn shared() -> SharedDisk {
        Arc::new(RealDisk)
    }
}

impl DiskFile for File {
    fn sync_all(&mut self) -> io::Result<()> {
        File::sync_all(self)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

impl Disk for RealDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        Ok(Box::new(File::create(path)?))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        Ok(Box::new(
            fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let file = fs::OpenOptions::new().write(true).open(path)?;
        file.set_len(len)?;
        file.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        fs::remove_dir(dir)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// Creates `dir` and whichever of its ancestors are missing, and makes each new entry durable
/// (an fsync of the directory holding it): a file fsynced in a directory whose own entry was
/// not is lost with it at a power cut.
pub fn create_dir_durably(disk: &dyn Disk, dir: &Path) -> io::Result<()> {
    let missing = missing_ancestors(dir);
    if missing.is_empty() {
        return Ok(());
    }
    disk.create_dir_all(dir)?;
    for created in missing {
        if let Some(parent) = created.parent().filter(|p| !p.as_os_str().is_empty()) {
            disk.sync_dir(parent)?;
        }
    }
    Ok(())
}

/// `dir` and those of its ancestors that do not exist yet, deepest first.
fn missing_ancestors(dir: &Path) -> Vec<&Path> {
    dir.ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .collect()
}

/// Durably replaces `path` with `bytes` on `disk`: a temporary file, fsync, rename, directory
/// fsync. A failure removes the temporary file, so a full disk leaves nothing behind.
pub fn write_atomic(disk: &dyn Disk, path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(disk, path, |file| file.write_all(bytes)).map(|_| ())
}

/// Writes `path` durably on `disk` with what `fill` writes: a temporary file beside it, filled
/// and fsynced, renamed over `path`, and the directory fsynced. Returns the file's size. On any
/// failure the temporary file is removed (best effort) and the error returned: nothing is left
/// that no manifest will ever list. The parent directory is created (and made durable) first.
pub fn write_with<E: From<io::Error> + std::fmt::Display>(
    disk: &dyn Disk,
    path: &Path,
    fill: impl FnOnce(&mut Box<dyn DiskFile>) -> Result<(), E>,
) -> Result<u64, E> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        create_dir_durably(disk, dir)?;
    }
    let tmp = path.with_extension("tmp");
    let written = (|| -> Result<u64, E> {
        let mut file = disk.create(&tmp)?;
        fill(&mut file)?;
        file.flush()?;
        file.sync_all()?;
        let size = file.size()?;
        drop(file);
        disk.rename(&tmp, path)?;
        Ok(size)
    })();
    let size = match written {
        Ok(size) => size,
        Err(e) => {
            if let Err(left) = disk.remove_file(&tmp)
                && left.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(file = %tmp.display(), error = %left, "could not remove a temporary file after a failed write");
            }
            return Err(e);
        }
    };
    if let Some(dir) = dir {
        disk.sync_dir(dir)?;
    }
    Ok(size)
}
