//! The log's on-disk format: segment files `wal-<first seq>.log`, each a sequence of records
//! `| payload len: u32 LE | crc32: u32 LE | seq: u64 LE | payload |`, and the resync that finds
//! where whole records start again after damage.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::Result;

pub(super) const HEADER: usize = 16;

/// How far past the last good sequence number a record found by resynchronising may be. Groups
/// that failed leave gaps, never this wide; the bound is what keeps a random 16 bytes that
/// happen to pass the CRC (one chance in 2^32) from being taken for a record.
pub(super) const MAX_SEQ_GAP: u64 = 1 << 32;

pub(super) fn segment_name(first_seq: u64) -> String {
    format!("wal-{first_seq:020}.log")
}

pub(super) fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(seq) = name
            .strip_prefix("wal-")
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            segments.push((seq, path));
        }
    }
    segments.sort();
    Ok(segments)
}

/// The first offset from `from` at which a whole record with a plausible sequence number
/// verifies, if any.
pub(super) fn resync(
    data: &[u8],
    from: usize,
    plausible: &dyn Fn(u64) -> bool,
    crc: &mut dyn FnMut(&[u8]) -> u32,
) -> Option<usize> {
    (from..data.len()).find(|&o| parse_record(&data[o..], plausible, crc).is_some())
}

/// One verified record at the start of `data` whose sequence number is `plausible`, or `None`
/// if it is cut short, implausible or fails its CRC. The length and the sequence number are
/// checked before the CRC is computed: a resync inside a torn 64 MiB record once computed a
/// CRC over megabytes at almost every offset.
pub(super) fn parse_record<'a>(
    data: &'a [u8],
    plausible: &dyn Fn(u64) -> bool,
    crc: &mut dyn FnMut(&[u8]) -> u32,
) -> Option<(u64, &'a [u8])> {
    if data.len() < HEADER {
        return None;
    }
    let len = u32::from_le_bytes(data[0..4].try_into().ok()?) as usize;
    let expected = u32::from_le_bytes(data[4..8].try_into().ok()?);
    let seq = u64::from_le_bytes(data[8..16].try_into().ok()?);
    if !plausible(seq) {
        return None;
    }
    let body = data.get(8..HEADER.checked_add(len)?)?;
    if crc(body) != expected {
        return None;
    }
    Some((seq, &body[8..]))
}

pub(super) fn encode_header(seq: u64, payload: &[u8]) -> [u8; HEADER] {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq.to_le_bytes());
    hasher.update(payload);
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[4..8].copy_from_slice(&hasher.finalize().to_le_bytes());
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header
}
