//! Where the Parquet side of the store lives: the data directory, or an object store.
//!
//! By default the Parquet parts and the manifest sit in the data directory beside the
//! write-ahead log, made durable by fsync. With `--storage s3://bucket/prefix` they live in an
//! object store instead, and the data directory keeps only what belongs to this process's log:
//! the write-ahead log itself, the idempotency-key snapshots, the rule overrides, and a staging
//! area where a part is written before it is uploaded. Several collectors, sharded by run,
//! share one prefix and together write one Hive-partitioned dataset,
//! `table=<t>/run=<id>/part-<node>-<n>.parquet`, that DuckDB, Spark or Trino read directly.
//!
//! Each collector names its parts and its manifest (`_rankwatch/manifest-<node>.json`) after
//! its node id, so it never lists as its own, replaces or deletes another collector's objects.
//! Node ids must therefore be unique per prefix.
//!
//! The commit order is the local one: a part is uploaded completely (one PUT, or a multipart
//! upload that becomes visible only when completed) before the manifest listing it is
//! replaced, and a PUT replaces an object atomically, so a crash leaves the old manifest or
//! the new one. Parts that no manifest lists (uploaded just before a crash) are deleted at
//! start, as unlisted local files are.
//!
//! The store's maintenance runs on blocking threads; remote calls are driven there with the
//! runtime's handle, never from inside an async task.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow_array::RecordBatch;
use bytes::Bytes;
use futures_util::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use tokio::io::AsyncWriteExt;
use tokio::runtime::Handle;
use url::Url;

use super::files;
use super::manifest::Manifest;
use crate::disk::{RealDisk, SharedDisk};
use crate::error::{Error, Result};

/// The Parquet side's home.
#[derive(Debug, Clone)]
pub enum Backend {
    /// Files under the data directory.
    Local(Local),
    /// Objects under a prefix of an object store.
    Remote(Arc<Remote>),
}

/// The data directory as the Parquet side's home, written through a [`crate::disk::Disk`] (the real one
/// but in tests of disk faults).
#[derive(Debug, Clone)]
pub struct Local {
    pub dir: PathBuf,
    pub disk: SharedDisk,
}

/// An object-store prefix this collector writes its parts and manifest under.
#[derive(Debug)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    /// `s3://bucket`: what DataFusion resolves the store by.
    bucket_url: Url,
    /// The prefix inside the bucket, without slashes at either end (may be empty).
    prefix: String,
    node: String,
    /// This data directory's identity (`DIR/instance-id`): what the node's claim names.
    instance: String,
    /// Its first characters, as part names carry it (see [`Backend::writer`]).
    writer: String,
    /// The manifest's ETag as this collector last read or wrote it: its next write is
    /// conditional on it (`If-Match`), so a write by anyone else in between fails it. `None`
    /// before any manifest exists (the first write is `If-None-Match: *`).
    manifest_tag: Mutex<Option<String>>,
    staging: PathBuf,
    handle: Handle,
}

/// The claim object's body: which collector holds a node id.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Claim {
    node: String,
    instance: String,
    data_dir: String,
    #[serde(default)]
    host: String,
    started_ms: i64,
}

/// The identity of a data directory, made on its first start and kept in it.
fn instance_id(data_dir: &Path) -> Result<String> {
    let path = data_dir.join("instance-id");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let id = text.trim();
        if !id.is_empty() {
            return Ok(id.to_owned());
        }
    }
    let id = rankwatch_analytics::random_hex_id();
    std::fs::create_dir_all(data_dir)?;
    crate::fsutil::write_atomic(&path, id.as_bytes())?;
    Ok(id)
}

impl Backend {
    /// Parts and manifest under `dir`, on the machine's file system.
    pub fn local(dir: &Path) -> Backend {
        Backend::local_on(dir, RealDisk::shared())
    }

    /// Parts and manifest under `dir`, written through `disk`.
    pub fn local_on(dir: &Path, disk: SharedDisk) -> Backend {
        Backend::Local(Local {
            dir: dir.to_owned(),
            disk,
        })
    }

    /// Connects to the object store named by `url` (`s3://bucket[/prefix]`), with credentials
    /// and endpoint from the usual `AWS_*` environment variables. `data_dir` holds the staging
    /// area. Must be called inside the runtime (it keeps its handle).
    pub fn s3(url: &str, node: &str, data_dir: &Path) -> Result<Backend> {
        parse_s3_url(url)?;
        let store = AmazonS3Builder::from_env()
            .with_url(url)
            .build()
            .map_err(|e| Error::bad(format!("storage {url:?}: {e}")))?;
        Backend::remote(Arc::new(store), url, node, data_dir)
    }

    /// A prefix of any object store, named by `url` (`s3://bucket[/prefix]`).
    pub fn remote(
        store: Arc<dyn ObjectStore>,
        url: &str,
        node: &str,
        data_dir: &Path,
    ) -> Result<Backend> {
        let (bucket_url, prefix) = parse_s3_url(url)?;
        check_node_id(node)?;
        let instance = instance_id(data_dir)?;
        let mut writer: String = instance
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(WRITER_CHARS)
            .collect();
        if writer.is_empty() {
            writer.push('0');
        }
        Ok(Backend::Remote(Arc::new(Remote {
            store,
            bucket_url,
            prefix,
            node: node.to_owned(),
            instance,
            writer,
            manifest_tag: Mutex::new(None),
            staging: data_dir.join("staging"),
            handle: Handle::current(),
        })))
    }

    /// Which holder of the node id writes (a prefix of this data directory's identity), part of
    /// every part name in object storage (see [`super::manifest::FileMeta::writer`]).
    pub fn writer(&self) -> Option<&str> {
        match self {
            Backend::Local(_) => None,
            Backend::Remote(r) => Some(&r.writer),
        }
    }

    /// The node id that part names carry (only with an object store).
    pub fn node(&self) -> Option<&str> {
        match self {
            Backend::Local(_) => None,
            Backend::Remote(r) => Some(&r.node),
        }
    }

    /// The object store and the URL DataFusion should resolve it by, when there is one.
    pub fn object_store(&self) -> Option<(&Url, Arc<dyn ObjectStore>)> {
        match self {
            Backend::Local(_) => None,
            Backend::Remote(r) => Some((&r.bucket_url, r.store.clone())),
        }
    }

    /// Where a reader finds the part at `relative`: an absolute path, or an `s3://` URL.
    pub fn location(&self, relative: &Path) -> String {
        match self {
            Backend::Local(l) => l.dir.join(relative).to_string_lossy().into_owned(),
            Backend::Remote(r) => format!("{}/{}", r.bucket(), r.key(relative)),
        }
    }

    /// A human-readable name of where the data lives, for logs.
    pub fn describe(&self) -> String {
        match self {
            Backend::Local(l) => l.dir.display().to_string(),
            Backend::Remote(r) => format!("{}/{} (node {})", r.bucket(), r.prefix, r.node),
        }
    }

    /// Writes one part (the rows of `batches`, in order) durably; returns its size.
    pub fn write(
        &self,
        layout: files::Layout,
        batches: &[RecordBatch],
        relative: &Path,
    ) -> Result<u64> {
        match self {
            Backend::Local(l) => files::write(&*l.disk, layout, batches, &l.dir.join(relative)),
            Backend::Remote(r) => {
                let staged = r.staging.join(relative);
                let size = files::write(&RealDisk, layout, batches, &staged)?;
                let uploaded = r.upload(&staged, relative);
                let _ = std::fs::remove_file(&staged);
                uploaded.map(|()| size)
            }
        }
    }

    /// Reads a whole part.
    pub fn read(&self, relative: &Path) -> Result<Vec<RecordBatch>> {
        match self {
            Backend::Local(l) => files::read(&l.dir.join(relative)),
            Backend::Remote(r) => files::read_bytes(r.fetch(relative)?),
        }
    }

    /// Deletes a part (a missing one is not an error). Locally, an emptied `run=` directory
    /// goes too.
    pub fn remove(&self, relative: &Path) -> Result<()> {
        match self {
            Backend::Local(l) => {
                let path = l.dir.join(relative);
                match l.disk.remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e.into()),
                }
                // Removing a non-empty directory fails, which is the test.
                if let Some(parent) = path.parent() {
                    let _ = l.disk.remove_dir(parent);
                }
                Ok(())
            }
            Backend::Remote(r) => {
                let key = r.object_path(relative)?;
                match r.handle.block_on(r.store.delete(&key)) {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// Claims this node id in the object store, proving at start that it takes writes (a
    /// missing bucket or read-only credentials fail here, not at the first flush). The claim,
    /// `_rankwatch/node-<node>.json`, names this data directory's identity: a second collector
    /// with the same node id and another data directory (the default node id is the host
    /// name) is refused, since the two would overwrite each other's manifest and delete each
    /// other's parts. `take_over` hands the node id to this data directory (the old one's disk
    /// is gone); the old collector, if it still runs, stops at its next manifest write.
    pub fn claim(&self, data_dir: &Path, now_ms: i64, take_over: bool) -> Result<()> {
        let Backend::Remote(r) = self else {
            return Ok(());
        };
        let unreachable = |e: Error| {
            Error::Unavailable(format!(
                "cannot write to {}: {e}; check that the bucket exists and the credentials may write to it",
                self.describe()
            ))
        };
        if let Some(held) = r.current_claim().map_err(unreachable)?
            && held.instance != r.instance
            && !take_over
        {
            return Err(Error::Unavailable(format!(
                "node id {:?} in {} is held by another collector (data directory {} on {}, \
                 since {} ms after the epoch): two collectors with one node id overwrite each \
                 other's manifest and delete each other's parts. Give this one its own \
                 --node-id, or, if that collector is gone for good, start this one once with \
                 --take-over-node",
                r.node,
                self.describe(),
                held.data_dir,
                if held.host.is_empty() {
                    "?"
                } else {
                    &held.host
                },
                held.started_ms
            )));
        }
        let claim = Claim {
            node: r.node.clone(),
            instance: r.instance.clone(),
            data_dir: data_dir.display().to_string(),
            host: crate::fsutil::host_name().unwrap_or_default(),
            started_ms: now_ms,
        };
        let body = serde_json::to_vec_pretty(&claim)?;
        r.handle
            .block_on(r.store.put(&r.claim_key()?, PutPayload::from(body)))
            .map_err(|e| unreachable(e.into()))?;
        Ok(())
    }

    /// The committed manifest, or an empty one where none was written yet.
    pub fn load_manifest(&self) -> Result<Manifest> {
        Ok(self.find_manifest()?.unwrap_or_default())
    }

    /// The committed manifest; `None` where none was ever written.
    pub fn find_manifest(&self) -> Result<Option<Manifest>> {
        match self {
            Backend::Local(l) => Manifest::load(&l.dir),
            Backend::Remote(r) => {
                let key = r.manifest_key()?;
                let read = r.handle.block_on(async {
                    let got = r.store.get(&key).await?;
                    let tag = got.meta.e_tag.clone();
                    Ok::<_, object_store::Error>((tag, got.bytes().await?))
                });
                match read {
                    Ok((tag, bytes)) => {
                        *r.tag() = tag;
                        Manifest::from_json(&bytes, &format!("{}/{key}", r.bucket())).map(Some)
                    }
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// Replaces the manifest atomically: the commit point of flushes and compactions.
    pub fn save_manifest(&self, manifest: &Manifest) -> Result<()> {
        match self {
            Backend::Local(l) => manifest.save(&*l.disk, &l.dir),
            Backend::Remote(r) => {
                // Fencing, twice. The claim first: a collector that took this node id over
                // owns the manifest from then on, even if this one could still write the
                // version it last saw. Then the write is conditional on that version, so no
                // race past the claim overwrites another writer's manifest.
                r.check_still_held()?;
                let key = r.manifest_key()?;
                let body = PutPayload::from(manifest.to_json()?);
                let put = |mode: PutMode| {
                    r.handle
                        .block_on(r.store.put_opts(&key, body.clone(), PutOptions::from(mode)))
                };
                let result = match put(conditional_on(r.tag().clone())) {
                    Ok(result) => result,
                    Err(e) if is_conflict(&e) => {
                        // Written since this collector last saw it. Either by the collector
                        // that lost this node id, racing past its claim check (a take-over), or
                        // by this one's own earlier write whose answer was lost. The claim says
                        // which: while this data directory holds it, its manifest is the truth,
                        // and the write is made over the version now there (else every later
                        // flush would fail on the same stale version).
                        r.check_still_held()?;
                        let now = r.handle.block_on(r.store.head(&key)).ok();
                        match put(conditional_on(now.and_then(|meta| meta.e_tag))) {
                            Ok(result) => {
                                tracing::warn!(
                                    node = %r.node,
                                    "the manifest was written by another writer since this \
                                     collector last saw it; this collector holds the node id, so \
                                     its manifest replaced that version"
                                );
                                result
                            }
                            Err(e) if is_conflict(&e) => {
                                return Err(Error::Unavailable(format!(
                                    "the manifest of node id {:?} keeps being written by another \
                                     collector: this one no longer writes it; its batches stay in \
                                     its write-ahead log",
                                    r.node
                                )));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    // A store without conditional writes: the claim check is the fence.
                    Err(object_store::Error::NotImplemented { .. }) => {
                        r.handle.block_on(r.store.put(&key, body))?
                    }
                    Err(e) => return Err(e.into()),
                };
                *r.tag() = result.e_tag;
                Ok(())
            }
        }
    }

    /// Deletes this collector's parts that `manifest` does not list (written before a crash,
    /// never committed), and anything left in the staging area. Returns how many parts went
    /// (`dry`: would go, deleting nothing).
    pub fn remove_unlisted(&self, manifest: &Manifest, dry: bool) -> Result<usize> {
        match self {
            Backend::Local(l) => manifest.remove_unlisted(&*l.disk, &l.dir, dry),
            Backend::Remote(r) => {
                if !dry {
                    match std::fs::remove_dir_all(&r.staging) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                let listed: std::collections::HashSet<String> = manifest
                    .files
                    .iter()
                    .map(|f| r.key(&f.relative()))
                    .collect();
                let under = (!r.prefix.is_empty())
                    .then(|| ObjectPath::parse(&r.prefix))
                    .transpose()
                    .map_err(|e| Error::bad(format!("storage prefix: {e}")))?;
                let objects: Vec<ObjectPath> = r.handle.block_on(async {
                    r.store
                        .list(under.as_ref())
                        .map_ok(|meta| meta.location)
                        .try_collect()
                        .await
                })?;
                let mut removed = 0;
                for key in objects {
                    let own = key
                        .filename()
                        .is_some_and(|name| is_own_part(name, &r.node));
                    if own && !listed.contains(key.as_ref()) {
                        if !dry {
                            tracing::info!(object = %key, "removing a part no manifest lists");
                            r.handle.block_on(r.store.delete(&key))?;
                        }
                        removed += 1;
                    }
                }
                Ok(removed)
            }
        }
    }
}

impl Remote {
    /// `s3://bucket`, without the slash `Url` may end it with.
    fn bucket(&self) -> &str {
        self.bucket_url.as_str().trim_end_matches('/')
    }

    /// The object key of a path relative to the dataset root.
    fn key(&self, relative: &Path) -> String {
        let rel = relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        if self.prefix.is_empty() {
            rel
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }

    fn object_path(&self, relative: &Path) -> Result<ObjectPath> {
        let key = self.key(relative);
        ObjectPath::parse(&key).map_err(|e| Error::bad(format!("object key {key:?}: {e}")))
    }

    fn tag(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.manifest_tag.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Ok` while this data directory still holds the node id; else the error that says who
    /// took it over.
    fn check_still_held(&self) -> Result<()> {
        match self.current_claim()? {
            Some(held) if held.instance != self.instance => Err(Error::Unavailable(format!(
                "node id {:?} was taken over by another collector (data directory {}): this \
                 one no longer writes its manifest; its batches stay in its write-ahead log",
                self.node, held.data_dir
            ))),
            _ => Ok(()),
        }
    }

    fn claim_key(&self) -> Result<ObjectPath> {
        self.object_path(&Path::new("_rankwatch").join(format!("node-{}.json", self.node)))
    }

    /// Who holds this node id now; `None` before any claim (an unreadable claim is nobody's).
    fn current_claim(&self) -> Result<Option<Claim>> {
        let key = self.claim_key()?;
        match self
            .handle
            .block_on(async { self.store.get(&key).await?.bytes().await })
        {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn manifest_key(&self) -> Result<ObjectPath> {
        self.object_path(&Path::new("_rankwatch").join(format!("manifest-{}.json", self.node)))
    }

    /// Uploads a staged file: one PUT when small, a multipart upload (visible only once
    /// completed) when large.
    fn upload(&self, staged: &Path, relative: &Path) -> Result<()> {
        let key = self.object_path(relative)?;
        self.handle.block_on(async {
            let mut writer = BufWriter::new(self.store.clone(), key);
            let copied = async {
                let mut file = tokio::fs::File::open(staged).await?;
                tokio::io::copy(&mut file, &mut writer).await?;
                writer.shutdown().await
            }
            .await;
            if let Err(e) = copied {
                let _ = writer.abort().await;
                return Err(Error::Unavailable(format!(
                    "uploading {} to object storage: {e}",
                    relative.display()
                )));
            }
            Ok(())
        })
    }

    fn fetch(&self, relative: &Path) -> Result<Bytes> {
        let key = self.object_path(relative)?;
        Ok(self
            .handle
            .block_on(async { self.store.get(&key).await?.bytes().await })?)
    }
}

/// A write conditional on the manifest's version `tag` (`If-Match`), or on there being none
/// yet (`If-None-Match: *`).
fn conditional_on(tag: Option<String>) -> PutMode {
    match tag {
        Some(tag) => PutMode::Update(UpdateVersion {
            e_tag: Some(tag),
            version: None,
        }),
        None => PutMode::Create,
    }
}

/// Whether a conditional write failed because the object changed (or appeared) meanwhile.
fn is_conflict(error: &object_store::Error) -> bool {
    matches!(
        error,
        object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. }
    )
}

/// How many characters of the data directory's identity name a writer in part names.
const WRITER_CHARS: usize = 8;

/// `part-<node>-<n>[.<writer>].parquet` for exactly this node, whichever of its holders wrote
/// it (another node's id may extend this one's).
fn is_own_part(name: &str, node: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("part-")
        .and_then(|rest| rest.strip_prefix(node))
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|rest| rest.strip_suffix(".parquet"))
    else {
        return false;
    };
    let (number, writer) = rest.split_once('.').unwrap_or((rest, "0"));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(number) && !writer.is_empty() && writer.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Splits `s3://bucket/some/prefix/` into (`s3://bucket`, `some/prefix`); the configuration
/// check uses it too, so a bad `--storage` is refused before anything opens.
pub fn parse_s3_url(text: &str) -> Result<(Url, String)> {
    let url =
        Url::parse(text).map_err(|e| Error::bad(format!("storage {text:?} is not a URL: {e}")))?;
    if url.scheme() != "s3" {
        return Err(Error::bad(format!(
            "storage {text:?}: only s3://bucket/prefix URLs (or local) are supported"
        )));
    }
    let bucket = url.host_str().unwrap_or_default();
    if bucket.is_empty() {
        return Err(Error::bad(format!("storage {text:?} names no bucket")));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(Error::bad(format!(
            "storage {text:?}: a query or fragment is not allowed"
        )));
    }
    let prefix = url.path().trim_matches('/').to_owned();
    if !prefix.is_empty() {
        ObjectPath::parse(&prefix)
            .map_err(|e| Error::bad(format!("storage {text:?}: bad prefix: {e}")))?;
    }
    let bucket_url = Url::parse(&format!("s3://{bucket}"))
        .map_err(|e| Error::bad(format!("storage {text:?}: {e}")))?;
    Ok((bucket_url, prefix))
}

/// Node ids go into object names: letters, digits, `.`, `_` and `-`, at most 64.
pub fn check_node_id(node: &str) -> Result<()> {
    let ok = !node.is_empty()
        && node.len() <= 64
        && node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !node.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::bad(format!(
            "node id {node:?} must be 1-64 letters, digits, '.', '_' or '-', not starting with '.'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_belongs_to_exactly_its_node() {
        assert!(is_own_part("part-a-12.parquet", "a"));
        assert!(!is_own_part("part-a-1-12.parquet", "a"), "node a-1's part");
        assert!(is_own_part("part-a-1-12.parquet", "a-1"));
        assert!(!is_own_part("part-a-.parquet", "a"));
        assert!(!is_own_part("part-a-12.parquet.tmp", "a"));
        assert!(!is_own_part("part-12.parquet", "a"), "a local part name");
        // With the writer named (any holder of the node id).
        assert!(is_own_part("part-a-12.3f9c01aa.parquet", "a"));
        assert!(is_own_part("part-a-1-12.3f9c01aa.parquet", "a-1"));
        assert!(!is_own_part("part-a-1-12.3f9c01aa.parquet", "a"));
        assert!(
            !is_own_part("part-a-1.eu-12.3f9c01aa.parquet", "a"),
            "node a-1.eu's"
        );
        assert!(is_own_part("part-a-1.eu-12.3f9c01aa.parquet", "a-1.eu"));
        assert!(!is_own_part("part-a-12..parquet", "a"));
        assert!(!is_own_part("part-a-12.3f9c01aa.parquet.tmp", "a"));
    }

    #[test]
    fn storage_urls_are_checked() {
        let (bucket, prefix) = parse_s3_url("s3://metrics/rankwatch/prod/").unwrap();
        assert_eq!(bucket.as_str(), "s3://metrics");
        assert_eq!(prefix, "rankwatch/prod");
        assert_eq!(parse_s3_url("s3://metrics").unwrap().1, "");
        for (bad, says) in [
            ("gs://b/p", "only s3://"),
            ("s3:///p", "no bucket"),
            ("not a url", "not a URL"),
            ("s3://b/p?x=1", "query"),
        ] {
            let e = parse_s3_url(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    fn batch(steps: std::ops::Range<u64>) -> RecordBatch {
        use arrow_array::{ArrayRef, Float64Array, UInt64Array};
        let n = steps.end - steps.start;
        RecordBatch::try_from_iter([
            (
                "step",
                Arc::new(UInt64Array::from_iter_values(steps)) as ArrayRef,
            ),
            (
                "value",
                Arc::new(Float64Array::from_iter_values((0..n).map(|i| i as f64))) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    /// Everything the store asks of a backend, against an in-memory object store: parts and
    /// manifest round-trip under the prefix with the node's names, locations are URLs
    /// DataFusion can resolve, and start-up clean-up removes exactly this node's unlisted parts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_id_is_held_by_one_data_directory_and_a_take_over_fences_the_old_holder() {
        let memory: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let (first_dir, second_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (m, d1, d2) = (
            memory.clone(),
            first_dir.path().to_owned(),
            second_dir.path().to_owned(),
        );
        tokio::task::spawn_blocking(move || {
            let first = Backend::remote(m.clone(), "s3://bkt/ds", "host-1", &d1).unwrap();
            first.claim(&d1, 1, false).unwrap();
            first
                .save_manifest(&Manifest {
                    flushed_seq: 1,
                    ..Manifest::default()
                })
                .unwrap();
            // The same data directory again (a restart) keeps its claim.
            let restarted = Backend::remote(m.clone(), "s3://bkt/ds", "host-1", &d1).unwrap();
            restarted.claim(&d1, 2, false).unwrap();

            // Another data directory with the same node id (the host-name default) is refused.
            let second = Backend::remote(m.clone(), "s3://bkt/ds", "host-1", &d2).unwrap();
            let err = second.claim(&d2, 3, false).unwrap_err().to_string();
            assert!(
                err.contains("held by another collector") && err.contains("--node-id"),
                "{err}"
            );
            assert!(
                err.contains(&d1.display().to_string()),
                "names the holder: {err}"
            );
            assert_eq!(
                first.load_manifest().unwrap().flushed_seq,
                1,
                "nothing changed"
            );

            // Taken over: the new holder writes, the old one is fenced off.
            second.claim(&d2, 4, true).unwrap();
            // As at start: the manifest is read (and its version noted) before any write.
            assert_eq!(second.load_manifest().unwrap().flushed_seq, 1);
            second
                .save_manifest(&Manifest {
                    flushed_seq: 7,
                    ..Manifest::default()
                })
                .unwrap();
            let err = first
                .save_manifest(&Manifest {
                    flushed_seq: 2,
                    ..Manifest::default()
                })
                .unwrap_err()
                .to_string();
            assert!(err.contains("taken over"), "{err}");
            assert_eq!(
                second.load_manifest().unwrap().flushed_seq,
                7,
                "not overwritten"
            );

            // The race the claim check cannot see: the old holder passed it just before the
            // take-over, and its manifest PUT lands after the new holder read the manifest.
            let manifest_key = ObjectPath::parse("ds/_rankwatch/manifest-host-1.json").unwrap();
            let late = Manifest {
                flushed_seq: 3,
                ..Manifest::default()
            };
            Handle::current()
                .block_on(m.put(&manifest_key, PutPayload::from(late.to_json().unwrap())))
                .unwrap();
            // The new holder is not stuck on the version it last saw: it holds the claim, so its
            // manifest replaces the late one (before, every later flush failed).
            second
                .save_manifest(&Manifest {
                    flushed_seq: 8,
                    ..Manifest::default()
                })
                .unwrap();
            assert_eq!(second.load_manifest().unwrap().flushed_seq, 8);
            second
                .save_manifest(&Manifest {
                    flushed_seq: 9,
                    ..Manifest::default()
                })
                .unwrap();
            assert_eq!(second.load_manifest().unwrap().flushed_seq, 9);

            // A late flush of the old holder writes parts under its own writer name: it can
            // never replace the part the new holder lists under the same number.
            let run = rankwatch_analytics::RunId::new("r").unwrap();
            let path = |b: &Backend| {
                super::super::manifest::file_path("samples", &run, b.node(), b.writer(), 5)
            };
            assert_ne!(path(&first), path(&second));
            second
                .write(files::Layout::UNSORTED, &[batch(0..10)], &path(&second))
                .unwrap();
            first
                .write(files::Layout::UNSORTED, &[batch(100..107)], &path(&first))
                .unwrap();
            let kept = second.read(&path(&second)).unwrap();
            assert_eq!(kept.iter().map(RecordBatch::num_rows).sum::<usize>(), 10);
        })
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_remote_prefix_round_trips_parts_and_manifests() {
        let memory: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let dir = tempfile::tempdir().unwrap();
        let backend =
            Backend::remote(memory.clone(), "s3://bkt/ds/prod", "n-1", dir.path()).unwrap();
        let keys = |store: Arc<dyn ObjectStore>| async move {
            let mut keys: Vec<String> = store
                .list(None)
                .map_ok(|m| m.location.to_string())
                .try_collect()
                .await
                .unwrap();
            keys.sort();
            keys
        };
        let writer = backend.writer().unwrap().to_owned();
        assert_eq!(writer.len(), WRITER_CHARS);
        let b = backend.clone();
        let (size, read, manifest) = tokio::task::spawn_blocking(move || {
            let run = rankwatch_analytics::RunId::new("r1").unwrap();
            let part = super::super::manifest::file_path("samples", &run, b.node(), b.writer(), 7);
            let size = b
                .write(files::Layout::UNSORTED, &[batch(0..100)], &part)
                .unwrap();
            let read = b.read(&part).unwrap();
            let manifest = Manifest {
                flushed_seq: 42,
                files: vec![super::super::manifest::FileMeta {
                    table: "samples".into(),
                    run,
                    part: 7,
                    rows: 100,
                    bytes: size,
                    min_step: Some(0),
                    max_step: Some(99),
                    node: Some("n-1".into()),
                    writer: b.writer().map(str::to_owned),
                    sparse: Default::default(),
                }],
                ..Manifest::default()
            };
            b.save_manifest(&manifest).unwrap();
            (size, read, b.load_manifest().unwrap())
        })
        .await
        .unwrap();
        assert!(size > 0);
        assert_eq!(read.iter().map(RecordBatch::num_rows).sum::<usize>(), 100);
        assert_eq!(manifest.flushed_seq, 42);
        assert_eq!(
            keys(memory.clone()).await,
            [
                "ds/prod/_rankwatch/manifest-n-1.json".to_owned(),
                format!("ds/prod/table=samples/run=r1/part-n-1-7.{writer}.parquet")
            ]
        );
        assert_eq!(
            backend.location(&manifest.files[0].relative()),
            format!("s3://bkt/ds/prod/table=samples/run=r1/part-n-1-7.{writer}.parquet")
        );
        // Staging is empty once uploaded.
        assert_eq!(
            std::fs::read_dir(dir.path().join("staging/table=samples/run=r1"))
                .unwrap()
                .count(),
            0
        );

        // An unlisted part of this node, another node's, a look-alike's, and one outside the prefix.
        for key in [
            "ds/prod/table=samples/run=r1/part-n-1-8.parquet",
            "ds/prod/table=samples/run=r1/part-n-2-8.parquet",
            "ds/prod/table=samples/run=r1/part-n-1-1-8.parquet",
            "elsewhere/table=samples/run=r1/part-n-1-9.parquet",
        ] {
            memory
                .put(
                    &ObjectPath::parse(key).unwrap(),
                    PutPayload::from_static(b"PAR1"),
                )
                .await
                .unwrap();
        }
        let b = backend.clone();
        let removed =
            tokio::task::spawn_blocking(move || b.remove_unlisted(&manifest, false).unwrap())
                .await
                .unwrap();
        assert_eq!(removed, 1);
        let left = keys(memory.clone()).await;
        assert!(!left.contains(&"ds/prod/table=samples/run=r1/part-n-1-8.parquet".to_owned()));
        assert_eq!(left.len(), 5, "{left:?}");
    }

    #[test]
    fn node_ids_fit_object_names() {
        for ok in ["collector-0", "a", "node_1.eu"] {
            check_node_id(ok).unwrap();
        }
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_node_id(bad).is_err(), "{bad:?}");
        }
    }
}
