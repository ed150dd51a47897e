//! The analytics crate's integration tests in one binary: Arrow tables, detectors, and the
//! numerical properties checked against FP64 references.

mod arrow_tables;
mod detectors;
mod properties;
mod spectral_parity;
