//! Connections per client address, so that one host cannot hold every connection.
//!
//! The global cap (`--max-connections`) keeps the collector inside its open-file limit, but
//! one client filling it — thousands of idle sockets, a buggy agent opening a connection per
//! batch — leaves every other agent waiting in the kernel's backlog. Each address may hold
//! `--max-connections-per-peer` at once; a connection past that is accepted (so the backlog
//! keeps moving), answered `429 Too Many Requests` with the reason, and closed. The count is
//! per IP address, ports aside; a guard taken with the connection gives its place back when
//! the connection ends, however it ends.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Open connections by client address.
#[derive(Debug, Default)]
pub(super) struct PeerCounts {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in its address's count, given back on drop.
#[derive(Debug)]
pub(super) struct PeerPlace {
    counts: Arc<PeerCounts>,
    peer: IpAddr,
}

impl PeerCounts {
    /// A place for a new connection from `peer`, or how many it holds when at `cap` (0: no cap).
    pub(super) fn admit(self: &Arc<Self>, peer: IpAddr, cap: usize) -> Result<PeerPlace, usize> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let held = open.entry(peer).or_default();
        if cap > 0 && *held >= cap {
            return Err(*held);
        }
        *held += 1;
        Ok(PeerPlace {
            counts: self.clone(),
            peer,
        })
    }

    /// Connections `peer` holds now.
    #[cfg(test)]
    fn held(&self, peer: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(&peer).copied().unwrap_or(0)
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut open = self
            .counts
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = open.get_mut(&self.peer) {
            *held -= 1;
            if *held == 0 {
                // Addresses come and go: the map holds only those with a connection open.
                open.remove(&self.peer);
            }
        }
    }
}

/// Longest the refusal may take: its write, and the wait for the client's request to drain.
const REFUSAL_TIME: Duration = Duration::from_secs(2);

/// Answers a connection past its address's cap with 429 and the reason, then closes it. The
/// client's request is read and dropped after the answer (up to [`REFUSAL_TIME`]): closing a
/// socket with unread input sends a reset, which can destroy the answer before the client
/// reads it.
pub(super) async fn refuse(mut stream: TcpStream, peer: IpAddr, held: usize, cap: usize) {
    let reason = format!(
        "too many connections from {peer}: {held} open, the cap per address is {cap} \
         (--max-connections-per-peer)\n"
    );
    let answer = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain; charset=utf-8\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{reason}",
        reason.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIME, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        std::io::Result::Ok(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_at_its_cap_is_refused_and_each_closed_connection_gives_a_place_back() {
        let counts = Arc::new(PeerCounts::default());
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut held: Vec<PeerPlace> = (0..3).map(|_| counts.admit(a, 3).unwrap()).collect();
        assert_eq!(counts.admit(a, 3).unwrap_err(), 3);
        // Another address is counted apart.
        let other = counts.admit(b, 3).unwrap();
        assert_eq!(counts.held(b), 1);
        held.pop();
        assert_eq!(counts.held(a), 2);
        let again = counts.admit(a, 3).expect("a place was given back");
        drop((held, again, other));
        assert_eq!((counts.held(a), counts.held(b)), (0, 0));
        assert!(
            counts.open.lock().unwrap().is_empty(),
            "no address left behind"
        );
        // 0: no cap.
        let many: Vec<PeerPlace> = (0..10_000).map(|_| counts.admit(a, 0).unwrap()).collect();
        assert_eq!(counts.held(a), many.len());
    }
}
