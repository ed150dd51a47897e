//! The durable write of one checked entry: admit, log, apply.
//!
//! [`Committer::commit`] is the one path by which rows enter the collector, whoever made them:
//! the ingest path for request bodies ([`crate::ingest`]) and the alert engine for the
//! all-ranks statistics it derives ([`crate::alerting`]). It admits the entry against the
//! store's limits and idempotency keys, appends it to the write-ahead log (group commit, acked
//! after fsync) and applies it to the hot buffer from the log writer's callback, so "committed"
//! means durable and queryable. It never feeds the alert engine: that is the caller's business,
//! which is what lets the engine write through it without hearing its own writes.

use std::sync::Arc;

use crate::decode;
use crate::entry::{Entry, Table};
use crate::error::{Error, Result};
use crate::idempotency::Key;
use crate::store::{Admission, Prepared, Store};
use crate::wal::WalHandle;

/// The store and the log, written together.
#[derive(Debug, Clone)]
pub struct Committer {
    pub store: Arc<Store>,
    pub wal: WalHandle,
}

impl Committer {
    /// Admits, logs and applies an entry. Returns its log sequence number, or `None` when its
    /// key was already applied. `raw` is the request body when it already is the Arrow IPC
    /// encoding of the entry's one part (it is logged as it came). A full hot buffer is
    /// waited for until `room_until` ([`Store::room_until`]; ingest's request deadline), or
    /// refused at once without one (the alert engine waits in its own loop, and not at all
    /// while stopping).
    pub async fn commit(
        &self,
        key: Option<&Key>,
        entry: &Entry,
        raw: Option<(Table, &[u8])>,
        room_until: Option<tokio::time::Instant>,
    ) -> Result<Option<u64>> {
        let prepared = Prepared::of(entry)?;
        if let Some(deadline) = room_until {
            self.store.room_until(deadline).await?;
        }
        let reserved = match self.store.begin(key, entry, &prepared)? {
            Admission::Duplicate => return Ok(None),
            Admission::Write(reservation) => reservation,
        };
        let abort = |e: Error| {
            if let Some(k) = key {
                self.store.abort(k);
            }
            self.store.release(&entry.run, reserved);
            e
        };
        let key_text = key.map(|k| k.to_string());
        let payload = decode::encode_entry(key_text.as_deref(), entry, raw).map_err(abort)?;
        let store = self.store.clone();
        let applied_key = key.cloned();
        let apply_entry = entry.clone();
        let seq = self
            .wal
            .append(
                payload,
                Box::new(move |seq| {
                    if let Err(e) = store.apply(seq, applied_key.as_ref(), &apply_entry, prepared, store.now_ms()) {
                        tracing::error!(seq, error = %e, "a durable batch could not enter the hot buffer; it will be replayed on restart");
                    }
                    // Applied: its series and run are known now (or, failed, never will be).
                    store.release(&apply_entry.run, reserved);
                }),
            )
            .await
            .map_err(abort)?;
        Ok(Some(seq))
    }
}
