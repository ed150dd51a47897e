//! Replay at start: every record after the manifest's `flushed_seq`, in order; damage set
//! aside in `damaged/`, never skipped past; a torn tail cut (durably) from the last segment.

use std::fs;
use std::path::{Path, PathBuf};

use super::format::{HEADER, MAX_SEQ_GAP, list_segments, parse_record, resync};
use crate::disk::Disk;
use crate::error::Result;

/// A record read back by [`replay`].
#[derive(Debug)]
pub struct Replayed {
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// What [`replay`] found.
#[derive(Debug, Default)]
pub struct ReplayReport {
    /// Records after `flushed_seq`, in order.
    pub records: Vec<Replayed>,
    /// The sequence number the next record gets.
    pub next_seq: u64,
    /// Bytes cut from a torn tail (kept in `damaged/` too).
    pub torn_bytes: u64,
    /// Damaged byte ranges set aside in `damaged/`, replay going on after each.
    pub damaged_ranges: usize,
    pub damaged_bytes: u64,
}

/// The folder, inside the log's, where damaged bytes and undecodable entries are set aside.
pub const DAMAGED_DIR: &str = "damaged";

/// Reads every record after `flushed_seq`. Damage is set aside, never skipped past: see the
/// module docs.
pub fn replay(disk: &dyn Disk, dir: &Path, flushed_seq: u64) -> Result<ReplayReport> {
    crate::disk::create_dir_durably(disk, dir)?;
    let segments = list_segments(dir)?;
    let mut report = ReplayReport {
        next_seq: flushed_seq + 1,
        ..Default::default()
    };
    let last = segments.len().saturating_sub(1);
    let mut last_good: Option<u64> = None;
    for (index, (first_seq, path)) in segments.iter().enumerate() {
        let data = fs::read(path)?;
        let mut offset = 0usize;
        while offset < data.len() {
            // A record's sequence number follows the last good one (a segment's first record
            // is its name's); gaps are failed groups.
            let low = last_good.map_or(*first_seq, |s| s + 1);
            let plausible = |seq: u64| seq >= low && seq - low < MAX_SEQ_GAP;
            if let Some((seq, payload)) =
                parse_record(&data[offset..], &plausible, &mut crc32fast::hash)
            {
                if seq > flushed_seq {
                    report.records.push(Replayed {
                        seq,
                        payload: payload.to_vec(),
                    });
                }
                report.next_seq = report.next_seq.max(seq + 1);
                last_good = Some(seq);
                offset += HEADER + payload.len();
                continue;
            }
            // Damage: find where records start again, and keep the bytes between.
            let resume = resync(&data, offset + 1, &plausible, &mut crc32fast::hash);
            let end = resume.unwrap_or(data.len());
            let aside = set_aside(dir, path, offset, &data[offset..end])?;
            if resume.is_none() && index == last {
                tracing::warn!(
                    segment = %path.display(),
                    offset,
                    bytes = end - offset,
                    kept = %aside.display(),
                    "write-ahead log ends in a torn record (a crash mid-write); truncating it"
                );
                // Durably: the writer appends after it, and a torn tail coming back under
                // records appended later would read as damage inside the log.
                disk.truncate(path, offset as u64)?;
                report.torn_bytes += (end - offset) as u64;
            } else {
                tracing::error!(
                    segment = %path.display(),
                    offset,
                    bytes = end - offset,
                    kept = %aside.display(),
                    "damaged bytes inside the write-ahead log, set aside; replay goes on after them"
                );
                report.damaged_ranges += 1;
                report.damaged_bytes += (end - offset) as u64;
            }
            offset = end;
        }
    }
    Ok(report)
}

/// Copies damaged bytes of `segment` at `offset` to `damaged/` (durably) and returns where.
fn set_aside(dir: &Path, segment: &Path, offset: usize, bytes: &[u8]) -> Result<PathBuf> {
    let name = segment
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("segment");
    keep_damaged(dir, &format!("{name}.at-{offset}.bin"), bytes)
}

/// Keeps a log entry that replays but does not decode (`seq`), with the reason beside it.
pub fn set_aside_entry(dir: &Path, seq: u64, payload: &[u8], reason: &str) -> Result<PathBuf> {
    keep_damaged(dir, &format!("seq-{seq:020}.reason.txt"), reason.as_bytes())?;
    keep_damaged(dir, &format!("seq-{seq:020}.entry"), payload)
}

fn keep_damaged(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let aside = dir.join(DAMAGED_DIR);
    fs::create_dir_all(&aside)?;
    let path = aside.join(name);
    crate::fsutil::write_atomic(&path, bytes)?;
    Ok(path)
}
