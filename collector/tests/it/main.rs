//! The collector's integration tests, one binary (one link of DataFusion) for all: the
//! in-process API driven through `oneshot` and the real binary on a random port.

mod alert_delivery;
mod alerting;
mod bad_input;
mod browser;
mod common;
mod consistency;
mod crash;
mod dashboard;
mod deletion;
mod disk_full;
mod hostile;
mod incidents;
mod openapi;
mod power_loss;
mod recovery;
mod replay;
mod rollups;
mod round_trip;
mod time;
mod two_writers;
mod wal_faults;
