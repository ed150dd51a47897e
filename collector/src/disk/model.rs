//! A disk that knows what a power cut would leave, for power-loss tests.
//!
//! Every operation is done on the machine's file system (so the collector reads back what it
//! wrote) and mirrored into a model that keeps, per file, the contents as of its last fsync,
//! and per directory, its entries as of its last directory fsync. At a power cut only those
//! survive: a file written but not fsynced comes back with its last fsynced contents (empty
//! if never); a create, rename or delete not followed by an fsync of its directory is undone.
//! This is LazyFS's model ("lose every write not made durable"), applied at the seam instead
//! of in a FUSE layer. [`PowerCutDisk::materialise`] writes that image to another directory,
//! beside everything written outside the seam, for a fresh collector to open.
//!
//! The power fails after `cut_after` operations: every later one fails with `EIO`, as a disk
//! that lost power does, so the process sees its writes refused from that instant.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Disk, DiskFile, RealDisk};

const EIO: i32 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    File(u64),
    Dir,
}

#[derive(Debug, Default)]
struct Inode {
    current: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Debug, Default)]
struct DirEntries {
    current: BTreeMap<OsString, Entry>,
    durable: BTreeMap<OsString, Entry>,
    /// Every name the model ever put here: those are the model's, not the file system's.
    seen: BTreeSet<OsString>,
}

#[derive(Debug, Default)]
struct Model {
    inodes: HashMap<u64, Inode>,
    dirs: HashMap<PathBuf, DirEntries>,
    next_inode: u64,
    operations: u64,
    cut_after: u64,
}

impl Model {
    fn step(&mut self) -> io::Result<()> {
        self.operations += 1;
        if self.operations > self.cut_after {
            return Err(io::Error::from_raw_os_error(EIO));
        }
        Ok(())
    }

    fn dir(&mut self, dir: &Path) -> &mut DirEntries {
        self.dirs.entry(dir.to_owned()).or_default()
    }

    fn put(&mut self, path: &Path, entry: Entry) {
        let (dir, name) = split(path);
        let entries = self.dir(&dir);
        entries.seen.insert(name.clone());
        entries.current.insert(name, entry);
    }

    fn take(&mut self, path: &Path) -> Option<Entry> {
        let (dir, name) = split(path);
        self.dir(&dir).current.remove(&name)
    }

    /// Whether `dir` would be there after a power cut now (directories the model never
    /// created were there before it began).
    fn durably_exists(&self, dir: &Path, root: &Path) -> bool {
        if dir == root || !dir.starts_with(root) {
            return true;
        }
        let (parent, name) = split(dir);
        let entry_survives = match self.dirs.get(&parent) {
            Some(entries) if entries.seen.contains(&name) => {
                entries.durable.get(&name) == Some(&Entry::Dir)
            }
            _ => true,
        };
        entry_survives && self.durably_exists(&parent, root)
    }
}

fn split(path: &Path) -> (PathBuf, OsString) {
    (
        path.parent().map(Path::to_owned).unwrap_or_default(),
        path.file_name().map(OsString::from).unwrap_or_default(),
    )
}

/// The machine's file system, mirrored into a model of what a power cut would leave.
#[derive(Debug, Clone)]
pub struct PowerCutDisk {
    model: Arc<Mutex<Model>>,
}

impl PowerCutDisk {
    /// A disk whose power fails after `cut_after` operations (`u64::MAX`: never).
    pub fn new(cut_after: u64) -> PowerCutDisk {
        PowerCutDisk {
            model: Arc::new(Mutex::new(Model {
                cut_after,
                ..Model::default()
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes `path` with `remove`, and its entry from its directory (undone by a power cut
    /// until that directory is fsynced).
    fn unlink(&self, path: &Path, remove: impl FnOnce(&Path) -> io::Result<()>) -> io::Result<()> {
        let mut model = self.lock();
        model.step()?;
        remove(path)?;
        model.take(path);
        Ok(())
    }

    /// Operations done so far (those refused after the cut included).
    pub fn operations(&self) -> u64 {
        self.lock().operations
    }

    /// Writes what a power cut now would leave of `live` into `image` (an empty directory):
    /// every file the model wrote with its last fsynced contents, in the directories whose
    /// entries were fsynced; everything written outside the seam as it is.
    pub fn materialise(&self, live: &Path, image: &Path) -> io::Result<()> {
        let model = self.lock();
        copy_unmodelled(&model, live, image)?;
        for (dir, entries) in &model.dirs {
            let Ok(relative) = dir.strip_prefix(live) else {
                continue;
            };
            if !model.durably_exists(dir, live) {
                continue;
            }
            let to = image.join(relative);
            std::fs::create_dir_all(&to)?;
            for (name, entry) in &entries.durable {
                match entry {
                    Entry::Dir => std::fs::create_dir_all(to.join(name))?,
                    Entry::File(inode) => {
                        let contents = model.inodes.get(inode).map_or(&[][..], |i| &i.durable);
                        std::fs::write(to.join(name), contents)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Copies `from` into `to`, leaving out the names the model put anywhere (and the data
/// directory's lock).
fn copy_unmodelled(model: &Model, from: &Path, to: &Path) -> io::Result<()> {
    std::fs::create_dir_all(to)?;
    let seen = model.dirs.get(from).map(|d| &d.seen);
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == "LOCK" || seen.is_some_and(|s| s.contains(&name)) {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            copy_unmodelled(model, &path, &to.join(&name))?;
        } else {
            std::fs::copy(&path, to.join(&name))?;
        }
    }
    Ok(())
}

struct ModelFile {
    file: Box<dyn DiskFile>,
    inode: u64,
    disk: PowerCutDisk,
}

impl Write for ModelFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut model = self.disk.lock();
        model.step()?;
        self.file.write_all(buf)?;
        if let Some(inode) = model.inodes.get_mut(&self.inode) {
            inode.current.extend_from_slice(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl DiskFile for ModelFile {
    fn sync_all(&mut self) -> io::Result<()> {
        let mut model = self.disk.lock();
        model.step()?;
        self.file.flush()?;
        if let Some(inode) = model.inodes.get_mut(&self.inode) {
            inode.durable = inode.current.clone();
        }
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        self.file.size()
    }
}

impl Disk for PowerCutDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut model = self.lock();
        model.step()?;
        let missing: Vec<PathBuf> = super::missing_ancestors(dir)
            .into_iter()
            .map(Path::to_owned)
            .collect();
        RealDisk.create_dir_all(dir)?;
        for created in missing.iter().rev() {
            model.put(created, Entry::Dir);
            model.dir(created);
        }
        Ok(())
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let mut model = self.lock();
        model.step()?;
        let file = RealDisk.create(path)?;
        model.next_inode += 1;
        let inode = model.next_inode;
        model.inodes.insert(inode, Inode::default());
        model.put(path, Entry::File(inode));
        Ok(Box::new(ModelFile {
            file,
            inode,
            disk: self.clone(),
        }))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let mut model = self.lock();
        model.step()?;
        let (dir, name) = split(path);
        let known = model.dir(&dir).current.get(&name).copied();
        let file = RealDisk.open_append(path)?;
        let inode = match known {
            Some(Entry::File(inode)) => inode,
            _ => {
                // New to the model: what is there now (if anything) counts as durable, as it
                // was written before the model began.
                let before = std::fs::read(path).unwrap_or_default();
                model.next_inode += 1;
                let inode = model.next_inode;
                model.inodes.insert(
                    inode,
                    Inode {
                        current: before.clone(),
                        durable: before.clone(),
                    },
                );
                model.put(path, Entry::File(inode));
                if !before.is_empty() {
                    // It was there before: its entry is too.
                    model.dir(&dir).durable.insert(name, Entry::File(inode));
                }
                inode
            }
        };
        Ok(Box::new(ModelFile {
            file,
            inode,
            disk: self.clone(),
        }))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut model = self.lock();
        model.step()?;
        RealDisk.truncate(path, len)?;
        let (dir, name) = split(path);
        if let Some(Entry::File(inode)) = model.dir(&dir).current.get(&name).copied()
            && let Some(inode) = model.inodes.get_mut(&inode)
        {
            inode.current.truncate(len as usize);
            inode.durable = inode.current.clone();
        }
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut model = self.lock();
        model.step()?;
        RealDisk.rename(from, to)?;
        if let Some(moved) = model.take(from) {
            model.put(to, moved);
        }
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.unlink(path, |p| RealDisk.remove_file(p))
    }

    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        self.unlink(dir, |p| RealDisk.remove_dir(p))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut model = self.lock();
        model.step()?;
        let entries = model.dir(dir);
        entries.durable = entries.current.clone();
        Ok(())
    }
}
