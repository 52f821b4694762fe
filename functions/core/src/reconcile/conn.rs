//! The one database connection a pool worker steps its pools on ([`StepConn`]): checked out
//! on first use, kept for every statement that follows, given back around each flintlock
//! call. The cross-pool work and each create-hook step have their own.
//!
//! Never hold the connection while waiting for anything but the database (a gRPC call, a
//! sleep, another connection): see "Connections" in [`super`] for why that is what keeps a
//! one-connection pool (Lambda) from deadlocking.

use std::future::Future;

use crate::db::{Conn, Db};

use super::ReconcileError;

pub(super) struct StepConn<'a> {
    db: &'a Db,
    held: Option<Conn>,
}

impl<'a> StepConn<'a> {
    /// Holds nothing yet: the first [`StepConn::client`] checks a connection out.
    pub(super) fn new(db: &'a Db) -> StepConn<'a> {
        StepConn { db, held: None }
    }

    /// The step's connection, checked out now if none is held. A held connection the
    /// database closed meanwhile (a restart, a dropped socket), or one a statement timed out
    /// on (it is discarded: see [`crate::store::Executor::discard`]), is let go and replaced,
    /// as the pool's own checkout would, so one failed statement does not fail the rest of
    /// the step.
    pub(super) async fn client(&mut self) -> Result<&Conn, ReconcileError> {
        Ok(self.held_conn().await?)
    }

    /// [`StepConn::client`], mutable: for a transaction.
    pub(super) async fn client_mut(&mut self) -> Result<&mut Conn, ReconcileError> {
        self.held_conn().await
    }

    async fn held_conn(&mut self) -> Result<&mut Conn, ReconcileError> {
        if self.held.as_ref().is_some_and(|c| c.is_closed() || c.is_discarded()) {
            self.held = None;
        }
        if self.held.is_none() {
            self.held = Some(self.db.get().await?);
        }
        Ok(self.held.as_mut().expect("checked out just above"))
    }

    /// Gives the connection back to the pool (a no-op when none is held).
    pub(super) fn release(&mut self) {
        self.held = None;
    }

    /// Runs `call` (a flintlock call) with the connection given back first, so another pool
    /// step can use it meanwhile; the next [`StepConn::client`] checks one out again.
    pub(super) async fn released<T>(&mut self, call: impl Future<Output = T>) -> T {
        self.release();
        call.await
    }
}
