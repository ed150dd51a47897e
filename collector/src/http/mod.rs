//! The HTTP server loop: the API router served over HTTP/1.1 with hyper, with the time and
//! connection bounds `axum::serve` leaves out.
//!
//! `axum::serve` sets no timer, so hyper's header-read timeout never runs: a client that
//! opens connections and sends a request head one byte at a time (slowloris) holds each of
//! them for ever, and enough of them exhaust the process's file descriptors — which the log
//! and the Parquet writer need too. Here:
//!
//! - a request head must arrive within `header_timeout`, and an idle keep-alive connection
//!   is closed after the same time (hyper starts the timer again after each response). The
//!   default, 30 s, is above the agent's HTTP client's 15 s idle age, so the agent never
//!   reuses a connection the collector is about to close;
//! - at most `max_connections` are open; at the cap the loop stops accepting (the kernel's
//!   backlog holds newcomers) until one closes, and the cap is kept below the process's
//!   open-file limit with room for the collector's own files;
//! - at most `max_connections_per_peer` of them from one address (`peers.rs`): past it a
//!   connection is answered 429 and closed, so one host cannot hold them all;
//! - every write must make progress within `write_timeout` (`write_deadline.rs`): a client
//!   that pipelines requests and never reads the answers is cut off, instead of holding its
//!   connection's permit for ever;
//! - the request body's deadline and the per-resource slots are the API's (see
//!   `api::admission`); HTTP/2 is not offered (no client of the collector speaks h2c, and it
//!   would bring its own stream limits to get right).
//!
//! Shutdown stops accepting, asks every connection to finish its request in flight and
//! close, and waits up to [`DRAIN`] for them (event streams end on their own, see `api`);
//! any still open then is ended, since each holds the router and with it parts of the
//! collector its shutdown waits to see released.

mod peers;
mod write_deadline;

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Longest wait for open connections at shutdown.
pub const DRAIN: Duration = Duration::from_secs(10);

/// File descriptors kept for the collector's own use (log segments, Parquet parts, spill
/// files, outgoing alert deliveries) when the connection cap is fitted to the open-file limit.
const RESERVED_FDS: usize = 256;

/// The server's bounds.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_connections: usize,
    /// Connections one client address may hold (0: no cap).
    pub max_connections_per_peer: usize,
    pub header_timeout: Duration,
    /// Longest a write may wait for the client to read (see `http/write_deadline.rs`).
    pub write_timeout: Duration,
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let max_connections = fit_to_open_files(limits.max_connections, open_file_limit());
    let connections = Arc::new(Semaphore::new(max_connections));
    let peers = Arc::new(peers::PeerCounts::default());
    let (closing, closed) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    // The connections' tasks, so that any still open after the drain can be ended: each holds
    // the router, and with it handles the collector's shutdown waits to see dropped.
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.try_join_next().is_some() {}
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted: both
                    // pass; a short pause keeps a tight loop off the CPU meanwhile.
                    tracing::warn!(error = %e, "accepting a connection failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Small JSON answers go out at once rather than wait for Nagle.
        let _ = stream.set_nodelay(true);
        let cap = limits.max_connections_per_peer;
        let place = match peers.admit(peer.ip(), cap) {
            Ok(place) => place,
            Err(held) => {
                tracing::debug!(%peer, held, cap, "refused: too many connections from one address");
                tasks.spawn(async move {
                    peers::refuse(stream, peer.ip(), held, cap).await;
                    drop(permit);
                });
                continue;
            }
        };
        let service = TowerToHyperService::new(router.clone());
        let mut closed = closed.clone();
        let header_timeout = limits.header_timeout;
        let stream = write_deadline::WriteDeadline::new(stream, limits.write_timeout);
        tasks.spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let mut connection = pin!(builder.serve_connection(TokioIo::new(stream), service));
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = closed.changed() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            drop((place, permit));
        });
    }
    drop(listener);
    closing.send_replace(true);
    let drained =
        tokio::time::timeout(DRAIN, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            open = tasks.len(),
            "connections still open {DRAIN:?} after shutdown began; closing them"
        );
        tasks.shutdown().await;
    }
}

/// The process's soft limit on open files, from /proc (no call into libc needed).
fn open_file_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// `wanted` connections, or fewer where the open-file limit would not leave the collector
/// its own descriptors.
fn fit_to_open_files(wanted: usize, limit: Option<usize>) -> usize {
    let Some(limit) = limit else {
        return wanted;
    };
    let room = limit.saturating_sub(RESERVED_FDS).max(16);
    if wanted > room {
        tracing::warn!(
            wanted,
            open_file_limit = limit,
            using = room,
            "--max-connections is above what the open-file limit allows (raise `ulimit -n` to \
             serve more); serving fewer connections at once"
        );
        return room;
    }
    wanted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_leaves_the_collector_its_own_descriptors() {
        assert_eq!(fit_to_open_files(4096, None), 4096);
        assert_eq!(fit_to_open_files(4096, Some(1 << 20)), 4096);
        assert_eq!(fit_to_open_files(4096, Some(1024)), 1024 - RESERVED_FDS);
        assert_eq!(
            fit_to_open_files(4096, Some(100)),
            16,
            "never below a usable few"
        );
    }

    #[test]
    fn the_open_file_limit_is_read_from_proc() {
        let limit = open_file_limit().expect("Linux has /proc/self/limits");
        assert!(limit >= 64, "{limit}");
    }
}
