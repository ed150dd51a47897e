//! The tables a client can write: the unit of one ingest request, of one collector
//! write-ahead-log entry and of one agent spool record.

use super::{runs, samples, sketches};

/// An ingest table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    Samples,
    Sketches,
    Runs,
}

impl Table {
    /// Every ingest table.
    pub const ALL: [Table; 3] = [Table::Samples, Table::Sketches, Table::Runs];

    /// The table's name: the `?table=` value and the Hive directory `table=<name>`.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Samples => samples::TABLE,
            Table::Sketches => sketches::TABLE,
            Table::Runs => runs::TABLE,
        }
    }

    /// The table named `name`, if any.
    pub fn from_name(name: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.as_str() == name)
    }

    /// The one-byte tag of the table in binary records (collector WAL, agent spool). Stable:
    /// changing it would make existing files unreadable.
    pub fn tag(self) -> u8 {
        match self {
            Table::Samples => 1,
            Table::Sketches => 2,
            Table::Runs => 3,
        }
    }

    /// The table of a tag, if it is one.
    pub fn from_tag(tag: u8) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.tag() == tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags_round_trip() {
        for t in Table::ALL {
            assert_eq!(Table::from_name(t.as_str()), Some(t));
            assert_eq!(Table::from_tag(t.tag()), Some(t));
        }
        assert_eq!(Table::from_name("alerts"), None);
        assert_eq!(Table::from_tag(0), None);
    }
}
