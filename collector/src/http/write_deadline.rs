//! A write-progress deadline on a connection: a client that stops reading its answers is
//! cut off.
//!
//! hyper has no write timeout, and its header timer runs only while a request head is being
//! read. A client that pipelines requests and never reads the answers (a tiny receive
//! window) leaves its connection blocked in a write for ever, holding one of the
//! `--max-connections` permits; a few thousand such sockets stop the accept loop, and
//! `/healthz` and ingest hang with them. Here every write (and flush and shutdown) must make
//! progress within `--write-timeout`: the timer starts when a write would block and is
//! cleared by any byte written, so a slow reader that keeps reading is never cut, only one
//! that stopped.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `inner` with a write-progress deadline of `timeout`.
#[derive(Debug)]
pub(crate) struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    /// Armed while a write waits for the client to read; `None` after any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub(crate) fn new(inner: S, timeout: Duration) -> Self {
        WriteDeadline {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// Passes a ready result through (clearing the timer); on `Pending`, arms the timer or
    /// fails once it has run out.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match polled {
            Poll::Ready(result) => {
                self.stalled = None;
                Poll::Ready(result)
            }
            Poll::Pending => {
                let timeout = self.timeout;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                ready!(timer.as_mut().poll(cx));
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing for {timeout:?} (--write-timeout)"),
                )))
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that stops reading fails the write after the deadline; one that reads slowly
    /// (a little now and then, within the deadline) never does.
    #[tokio::test]
    async fn a_stopped_reader_is_cut_and_a_slow_one_is_not() {
        let deadline = Duration::from_secs(2);
        let (ours, _silent) = tokio::io::duplex(64);
        let mut ours = WriteDeadline::new(ours, deadline);
        let started = std::time::Instant::now();
        let stuck = ours.write_all(&[7u8; 1024]).await.unwrap_err();
        assert_eq!(stuck.kind(), io::ErrorKind::TimedOut);
        assert!(stuck.to_string().contains("--write-timeout"), "{stuck}");
        assert!(started.elapsed() >= deadline);

        let (ours, mut slow) = tokio::io::duplex(64);
        let mut ours = WriteDeadline::new(ours, deadline);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut chunk = [0u8; 32];
            while got.len() < 512 {
                tokio::time::sleep(deadline / 20).await;
                let n = slow.read(&mut chunk).await.unwrap();
                got.extend_from_slice(&chunk[..n]);
            }
            got
        });
        ours.write_all(&[9u8; 512]).await.unwrap();
        assert_eq!(reader.await.unwrap(), vec![9u8; 512]);
    }
}
