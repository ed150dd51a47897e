//! A disk that fails on demand as a full one does (`ENOSPC`): the next `n` writes, or the next
//! `n` fsyncs and truncations. For tests and failure drills; production never consults it.

use std::io::{self, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{Disk, DiskFile, RealDisk};

const ENOSPC: i32 = 28;

/// The machine's file system, with failures on demand.
#[derive(Debug, Default)]
pub struct FaultyDisk {
    counters: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    writes: AtomicU32,
    syncs: AtomicU32,
}

impl Counters {
    fn take(counter: &AtomicU32) -> io::Result<()> {
        let took = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        match took {
            Ok(_) => Err(io::Error::from_raw_os_error(ENOSPC)),
            Err(_) => Ok(()),
        }
    }
}

impl FaultyDisk {
    /// The next `n` writes fail (0 stops failing them).
    pub fn fail_writes(&self, n: u32) {
        self.counters.writes.store(n, Ordering::Release);
    }

    /// The next `n` fsyncs and truncations fail (0 stops failing them).
    pub fn fail_syncs(&self, n: u32) {
        self.counters.syncs.store(n, Ordering::Release);
    }
}

struct FaultyFile {
    file: Box<dyn DiskFile>,
    counters: Arc<Counters>,
}

impl Write for FaultyFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Counters::take(&self.counters.writes)?;
        self.file.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl DiskFile for FaultyFile {
    fn sync_all(&mut self) -> io::Result<()> {
        Counters::take(&self.counters.syncs)?;
        self.file.sync_all()
    }

    fn sync_data(&mut self) -> io::Result<()> {
        Counters::take(&self.counters.syncs)?;
        self.file.sync_data()
    }

    fn size(&self) -> io::Result<u64> {
        self.file.size()
    }
}

impl FaultyDisk {
    fn wrap(&self, file: Box<dyn DiskFile>) -> Box<dyn DiskFile> {
        Box::new(FaultyFile {
            file,
            counters: self.counters.clone(),
        })
    }
}

impl Disk for FaultyDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        RealDisk.create_dir_all(dir)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        Ok(self.wrap(RealDisk.create(path)?))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        Ok(self.wrap(RealDisk.open_append(path)?))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        Counters::take(&self.counters.syncs)?;
        RealDisk.truncate(path, len)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealDisk.rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        RealDisk.remove_file(path)
    }

    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        RealDisk.remove_dir(dir)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        RealDisk.sync_dir(dir)
    }
}
