//! The log's tests: format, replay and damage, group commit, failures, power cuts.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::format::{HEADER, MAX_SEQ_GAP, encode_header, list_segments, parse_record, resync};
use super::*;
use crate::disk::RealDisk;
use crate::disk::faulty::FaultyDisk;
use crate::disk::model::PowerCutDisk;
use crate::error::Result;
use std::collections::BTreeMap;

#[derive(Default)]
struct Quiet;
impl WalObserver for Quiet {
    fn fsynced(&self, _: usize, _: usize, _: f64) {}
    fn size(&self, _: usize, _: u64) {}
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn write(dir: &Path, next_seq: u64, segment_bytes: u64, payloads: &[&[u8]]) -> Vec<u64> {
    let (wal, thread) = WalHandle::start(
        dir.into(),
        next_seq,
        segment_bytes,
        Arc::new(Quiet),
        RealDisk::shared(),
    )
    .unwrap();
    let applied = Arc::new(Mutex::new(Vec::new()));
    let seqs = runtime().block_on(async {
        let mut seqs = Vec::new();
        for p in payloads {
            let a = applied.clone();
            let seq = wal
                .append(
                    Bytes::copy_from_slice(p),
                    Box::new(move |s| a.lock().unwrap().push(s)),
                )
                .await
                .unwrap();
            seqs.push(seq);
        }
        seqs
    });
    drop(wal);
    thread.join().unwrap();
    assert_eq!(
        *applied.lock().unwrap(),
        seqs,
        "apply runs in sequence order"
    );
    seqs
}

#[test]
fn records_come_back_in_order_across_segments() {
    let dir = tempfile::tempdir().unwrap();
    let payloads: Vec<Vec<u8>> = (0..50u8).map(|i| vec![i; 100 + i as usize]).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
    let seqs = write(dir.path(), 1, 1000, &refs);
    assert_eq!(seqs, (1..=50).collect::<Vec<_>>());
    assert!(list_segments(dir.path()).unwrap().len() > 3);
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    assert_eq!(report.next_seq, 51);
    let got: Vec<Vec<u8>> = report.records.into_iter().map(|r| r.payload).collect();
    assert_eq!(got, payloads);
    // Records at or below the flushed sequence number are skipped.
    assert_eq!(replay(&RealDisk, dir.path(), 40).unwrap().records.len(), 10);
}

/// The payloads `report` replayed, in order.
fn payloads_of(report: &ReplayReport) -> Vec<&[u8]> {
    report
        .records
        .iter()
        .map(|r| r.payload.as_slice())
        .collect()
}

#[test]
fn a_torn_tail_is_truncated_and_later_records_append_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), 1, 1 << 20, &[b"alpha", b"beta", b"gamma"]);
    let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
    let len = fs::metadata(&path).unwrap().len();
    // Cut the last record in half, as a crash mid-write would.
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    assert_eq!(report.records.len(), 2);
    assert_eq!(report.torn_bytes, (HEADER + 5 - 3) as u64);
    assert_eq!(report.next_seq, 3);
    write(dir.path(), report.next_seq, 1 << 20, &[b"delta"]);
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    let got = payloads_of(&report);
    assert_eq!(got, [&b"alpha"[..], b"beta", b"delta"]);
}

#[test]
fn a_flipped_bit_fails_the_crc() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), 1, 1 << 20, &[b"alpha", b"beta"]);
    let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
    let mut data = fs::read(&path).unwrap();
    let last = data.len() - 1;
    data[last] ^= 1;
    fs::write(&path, data).unwrap();
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    assert_eq!(report.records.len(), 1);
    assert!(report.torn_bytes > 0);
}

/// Flips one bit at `offset` of `path`.
fn flip(path: &Path, offset: usize) {
    let mut data = fs::read(path).unwrap();
    data[offset] ^= 0x10;
    fs::write(path, data).unwrap();
}

fn damaged_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir.join(DAMAGED_DIR))
        .map(|r| r.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn damage_inside_the_last_segment_is_set_aside_and_every_later_record_replays() {
    let dir = tempfile::tempdir().unwrap();
    let words: [&[u8]; 5] = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon"];
    write(dir.path(), 1, 1 << 20, &words);
    let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
    let size = fs::metadata(&path).unwrap().len();
    // A bit of "beta"'s payload: the second record starts after the first.
    let beta_at = HEADER + 5;
    flip(&path, beta_at + HEADER + 1);
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    let got = payloads_of(&report);
    assert_eq!(got, [&b"alpha"[..], b"gamma", b"delta", b"epsilon"]);
    assert_eq!((report.damaged_ranges, report.torn_bytes), (1, 0));
    assert_eq!(report.damaged_bytes, (HEADER + 4) as u64);
    assert_eq!(fs::metadata(&path).unwrap().len(), size, "nothing was cut");
    let kept = damaged_files(dir.path());
    assert_eq!(kept.len(), 1, "{kept:?}");
    let damaged = fs::read(&path).unwrap()[beta_at..beta_at + HEADER + 4].to_vec();
    assert_eq!(
        fs::read(&kept[0]).unwrap(),
        damaged,
        "the damaged bytes, as they were"
    );
    assert_eq!(report.next_seq, 6);
}

#[test]
fn damage_inside_an_older_segment_no_longer_skips_the_rest_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let payloads: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 90]).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
    write(dir.path(), 1, 500, &refs);
    let segments = list_segments(dir.path()).unwrap();
    assert!(segments.len() >= 4);
    // The first record of the first segment: everything after it in that segment stays.
    flip(&segments[0].1, 3);
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    assert_eq!(report.records.len(), 39);
    assert_eq!(
        report.records[0].seq, 2,
        "the damaged record alone is missing"
    );
    assert_eq!(report.damaged_ranges, 1);
    assert_eq!(damaged_files(dir.path()).len(), 1);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Bit flips anywhere in a log of several segments: every record no flip touched
    /// replays, nothing is invented, and every byte is accounted for — replayed, or set
    /// aside in `damaged/`.
    #[test]
    fn bit_flips_lose_only_the_records_they_touch(
        sizes in proptest::collection::vec(1usize..200, 1..40),
        flips in proptest::collection::vec((0usize..64, 0usize..10_000), 1..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let payloads: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, n)| (0..*n).map(|j| (i * 31 + j * 7) as u8).collect())
            .collect();
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
        write(dir.path(), 1, 600, &refs);
        let segments = list_segments(dir.path()).unwrap();
        // Where each record lies: (segment, start, end).
        let mut spans = Vec::new();
        for (_, path) in &segments {
            let data = fs::read(path).unwrap();
            let mut o = 0;
            while o < data.len() {
                let (_, payload) =
                    parse_record(&data[o..], &|_| true, &mut crc32fast::hash).unwrap();
                spans.push((path.clone(), o, o + HEADER + payload.len()));
                o += HEADER + payload.len();
            }
        }
        let total: u64 = segments.iter().map(|(_, p)| fs::metadata(p).unwrap().len()).sum();
        let mut touched = std::collections::BTreeSet::new();
        for (segment, at) in &flips {
            let path = &segments[segment % segments.len()].1;
            let len = fs::metadata(path).unwrap().len() as usize;
            let at = at % len;
            flip(path, at);
            for (i, (p, start, end)) in spans.iter().enumerate() {
                if p == path && (*start..*end).contains(&at) {
                    touched.insert(i);
                }
            }
        }
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        let got: std::collections::BTreeMap<u64, Vec<u8>> =
            report.records.iter().map(|r| (r.seq, r.payload.clone())).collect();
        for (i, payload) in payloads.iter().enumerate() {
            let seq = i as u64 + 1;
            if !touched.contains(&i) {
                proptest::prop_assert_eq!(got.get(&seq), Some(payload), "record {} lost", seq);
            }
        }
        for (seq, payload) in &got {
            proptest::prop_assert_eq!(&payloads[(*seq - 1) as usize], payload, "record {} invented", seq);
        }
        let replayed: u64 = report.records.iter().map(|r| (HEADER + r.payload.len()) as u64).sum();
        proptest::prop_assert_eq!(replayed + report.damaged_bytes + report.torn_bytes, total);
        let kept: u64 = damaged_files(dir.path())
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        proptest::prop_assert_eq!(kept, report.damaged_bytes + report.torn_bytes);
    }
}

/// A power cut at a random instant under concurrent appends: the disk keeps each segment
/// only up to its last fsync, plus whatever garbage the unsynced tail left. Every record
/// acknowledged before the cut replays, byte for byte. (Acknowledging before the fsync
/// would fail this: the cut would take acknowledged records with it.)
#[test]
fn a_power_cut_keeps_every_acknowledged_record() {
    for case in 0u64..12 {
        let dir = tempfile::tempdir().unwrap();
        let disk = PowerCutDisk::new(u64::MAX);
        let (wal, thread) = WalHandle::start(
            dir.path().into(),
            1,
            2048,
            Arc::new(Quiet),
            Arc::new(disk.clone()),
        )
        .unwrap();
        // What a power cut leaves, imaged at the cut.
        let cut = tempfile::tempdir().unwrap();
        let acked: Arc<Mutex<BTreeMap<u64, Vec<u8>>>> = Arc::default();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let seen = runtime.block_on(async {
            let mut writers = Vec::new();
            for w in 0..4u64 {
                let (wal, acked) = (wal.clone(), acked.clone());
                writers.push(tokio::spawn(async move {
                    for i in 0..150u64 {
                        let size = 1 + ((case * 7919 + w * 104_729 + i * 31) % 300) as usize;
                        let payload: Vec<u8> =
                            (0..size).map(|j| (w * 37 + i + j as u64) as u8).collect();
                        let copy = payload.clone();
                        let seq = wal
                            .append(Bytes::from(payload), Box::new(|_| {}))
                            .await
                            .unwrap();
                        acked.lock().unwrap().insert(seq, copy);
                    }
                }));
            }
            // The cut: after some acknowledgements, wherever the writer then is.
            let at = 20 + (case as usize * 41) % 400;
            while acked.lock().unwrap().len() < at {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            let seen = acked.lock().unwrap().clone();
            disk.materialise(dir.path(), cut.path()).unwrap();
            for w in writers {
                w.await.unwrap();
            }
            seen
        });
        drop(wal);
        thread.join().unwrap();

        // Part of the unsynced tail of the newest segment reached the platter, scrambled.
        let cut_wal = cut.path();
        if let Some((_, newest)) = list_segments(cut_wal).unwrap().pop() {
            let kept = fs::read(&newest).unwrap();
            let live = fs::read(dir.path().join(newest.file_name().unwrap())).unwrap_or_default();
            let tail: Vec<u8> = live
                .iter()
                .skip(kept.len())
                .take(40)
                .map(|b| b ^ 0x5a)
                .collect();
            let mut scrambled = kept;
            scrambled.extend(tail);
            fs::write(&newest, scrambled).unwrap();
        }
        let report = replay(&RealDisk, cut.path(), 0).unwrap();
        let replayed: BTreeMap<u64, Vec<u8>> = report
            .records
            .into_iter()
            .map(|r| (r.seq, r.payload))
            .collect();
        assert!(!seen.is_empty());
        for (seq, payload) in &seen {
            assert_eq!(
                replayed.get(seq),
                Some(payload),
                "case {case}: acknowledged record {seq} lost"
            );
        }
        for (seq, payload) in &replayed {
            let all = acked.lock().unwrap();
            assert_eq!(
                all.get(seq),
                Some(payload),
                "case {case}: record {seq} invented"
            );
        }
    }
}

fn append(
    wal: &WalHandle,
    payload: &'static [u8],
    applied: &Arc<Mutex<Vec<u64>>>,
) -> impl std::future::Future<Output = Result<u64>> + use<> {
    let (wal, applied) = (wal.clone(), applied.clone());
    async move {
        wal.append(
            Bytes::from_static(payload),
            Box::new(move |s| applied.lock().unwrap().push(s)),
        )
        .await
    }
}

fn payloads(dir: &Path) -> Vec<(u64, Vec<u8>)> {
    let report = replay(&RealDisk, dir, 0).unwrap();
    report
        .records
        .into_iter()
        .map(|r| (r.seq, r.payload))
        .collect()
}

/// A log on a disk that fails on demand, with segments of `segment_bytes`.
fn on_faulty_disk(
    segment_bytes: u64,
) -> (
    tempfile::TempDir,
    Arc<FaultyDisk>,
    WalHandle,
    std::thread::JoinHandle<()>,
) {
    let dir = tempfile::tempdir().unwrap();
    let disk = Arc::new(FaultyDisk::default());
    let (wal, thread) = WalHandle::start(
        dir.path().into(),
        1,
        segment_bytes,
        Arc::new(Quiet),
        disk.clone(),
    )
    .unwrap();
    (dir, disk, wal, thread)
}

#[test]
fn a_failed_group_is_refused_rolled_back_healed_and_never_replayed() {
    let (dir, disk, wal, thread) = on_faulty_disk(1 << 20);
    let applied = Arc::new(Mutex::new(Vec::new()));
    runtime().block_on(async {
        assert_eq!(append(&wal, b"alpha", &applied).await.unwrap(), 1);
        disk.fail_syncs(u32::MAX);
        let e = append(&wal, b"refused", &applied).await.unwrap_err();
        assert!(e.to_string().contains("os error 28"), "{e}");
        assert!(wal.is_failed() && wal.failure().is_some());
        // Refused at once while failed, without a sequence number.
        let e = append(&wal, b"also refused", &applied).await.unwrap_err();
        assert!(e.to_string().contains("retrying every 1 s"), "{e}");
        disk.fail_syncs(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while wal.is_failed() {
            assert!(Instant::now() < deadline, "the log never healed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(append(&wal, b"delta", &applied).await.unwrap(), 3);
    });
    drop(wal);
    thread.join().unwrap();
    assert_eq!(
        *applied.lock().unwrap(),
        [1, 3],
        "a refused batch is never applied"
    );
    assert_eq!(
        payloads(dir.path()),
        [(1, b"alpha".to_vec()), (3, b"delta".to_vec())]
    );
}

#[test]
fn a_failed_group_is_not_written_at_shutdown() {
    let (dir, disk, wal, thread) = on_faulty_disk(1 << 20);
    let applied = Arc::new(Mutex::new(Vec::new()));
    runtime().block_on(async {
        append(&wal, b"alpha", &applied).await.unwrap();
        // Written into the segment's buffer, then the fsync fails.
        disk.fail_syncs(1);
        append(&wal, b"refused", &applied).await.unwrap_err();
    });
    // Shut down while failed: the group's buffered bytes are dropped, not flushed.
    drop(wal);
    thread.join().unwrap();
    assert_eq!(payloads(dir.path()), [(1, b"alpha".to_vec())]);
}

#[test]
fn a_failed_group_that_started_a_segment_takes_it_back() {
    // Segments of ~one record: the next append starts a new segment.
    let (dir, disk, wal, thread) = on_faulty_disk(10);
    let applied = Arc::new(Mutex::new(Vec::new()));
    runtime().block_on(async {
        append(&wal, b"alpha", &applied).await.unwrap();
        assert_eq!(list_segments(dir.path()).unwrap().len(), 1);
        // The rotation's fsync of the old segment passes, the new segment's fails.
        disk.fail_writes(1);
        append(&wal, b"refused", &applied).await.unwrap_err();
    });
    drop(wal);
    thread.join().unwrap();
    assert_eq!(
        list_segments(dir.path()).unwrap().len(),
        1,
        "the new segment is gone"
    );
    assert_eq!(payloads(dir.path()), [(1, b"alpha".to_vec())]);
}

/// Issue 45 item 10: resynchronising inside a torn record checks each offset's sequence
/// number before any CRC. A torn payload whose bytes read as small lengths at every fourth
/// offset made the first design hash ~4 KiB there, a gigabyte for one MiB of tail (and
/// megabytes per offset for a torn 64 MiB record).
#[test]
fn a_resync_inside_a_torn_record_hashes_nothing_that_cannot_be_a_record() {
    let torn: Vec<u8> = [0x00u8, 0x10, 0x00, 0x00]
        .iter()
        .copied()
        .cycle()
        .take(1 << 20)
        .collect();
    let plausible = |seq: u64| (5..5 + MAX_SEQ_GAP).contains(&seq);
    let mut hashed = 0usize;
    let found = resync(&torn, 1, &plausible, &mut |bytes: &[u8]| {
        hashed += bytes.len();
        crc32fast::hash(bytes)
    });
    assert_eq!(found, None);
    assert_eq!(hashed, 0, "{hashed} bytes hashed");
    // A real record after the damage is still found, and only it is hashed.
    let mut data = torn;
    let at = data.len();
    data.extend_from_slice(&encode_header(7, b"payload"));
    data.extend_from_slice(b"payload");
    let mut hashed = 0usize;
    let found = resync(&data, 1, &plausible, &mut |bytes: &[u8]| {
        hashed += bytes.len();
        crc32fast::hash(bytes)
    });
    assert_eq!(found, Some(at));
    assert_eq!(hashed, 8 + b"payload".len());
}

#[test]
fn truncate_deletes_only_fully_flushed_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (wal, thread) = WalHandle::start(
        dir.path().into(),
        1,
        300,
        Arc::new(Quiet),
        RealDisk::shared(),
    )
    .unwrap();
    runtime().block_on(async {
        for _ in 0..10 {
            wal.append(Bytes::from(vec![7u8; 200]), Box::new(|_| {}))
                .await
                .unwrap();
        }
        wal.truncate(5);
        wal.barrier().await;
    });
    let report = replay(&RealDisk, dir.path(), 0).unwrap();
    let seqs: Vec<u64> = report.records.iter().map(|r| r.seq).collect();
    assert!(seqs.iter().all(|&s| s >= 6 - 1), "{seqs:?}");
    assert!(seqs.contains(&6) && seqs.contains(&10), "{seqs:?}");
    runtime().block_on(async {
        wal.truncate(10);
        wal.barrier().await;
    });
    assert!(list_segments(dir.path()).unwrap().is_empty());
    drop(wal);
    thread.join().unwrap();
}
