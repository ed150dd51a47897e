//! A query's expressions nest at most [`MAX_DEPTH`] deep.
//!
//! DataFusion plans, optimises and evaluates an expression by recursion, one stack frame or
//! more a level; a chain of a thousand `||` (four kilobytes of text, the read token enough)
//! overflowed the stack of the thread answering it, which aborts the whole collector. The
//! parser's own recursion limit does not see such a chain: it parses a left-associative chain
//! in a loop, and only the tree it builds is deep. So the depth is measured on the parsed
//! statement, before anything recurses over it.

use std::ops::ControlFlow;

use datafusion::sql::parser::{CopyToSource, Statement};
use datafusion::sql::sqlparser::ast::{Expr, Visit, Visitor};

use crate::error::{Error, Result};

/// Deep enough for any query a person writes (a `CASE` of a hundred branches is one level, a
/// sixty-term sum sixty). The debug build, whose frames are the largest, answered a 90-term
/// chain of `||` on a 2 MiB stack and overflowed at 97. A query's thread has 256 MiB
/// (`query/mod.rs`), for what DataFusion nests itself (projections merged into one expression,
/// a union of thousands); this check refuses the deepest text before any planning.
pub(super) const MAX_DEPTH: usize = 64;

/// Counts the nesting of expressions, stopping at the first past the limit.
struct Depth {
    now: usize,
}

impl Visitor for Depth {
    type Break = ();

    fn pre_visit_expr(&mut self, _expr: &Expr) -> ControlFlow<()> {
        self.now += 1;
        if self.now > MAX_DEPTH {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    fn post_visit_expr(&mut self, _expr: &Expr) -> ControlFlow<()> {
        self.now -= 1;
        ControlFlow::Continue(())
    }
}

fn too_deep(statement: &Statement) -> bool {
    let mut depth = Depth { now: 0 };
    match statement {
        Statement::Statement(s) => s.visit(&mut depth).is_break(),
        Statement::Explain(e) => too_deep(&e.statement),
        Statement::CopyTo(c) => match &c.source {
            CopyToSource::Query(q) => q.visit(&mut depth).is_break(),
            CopyToSource::Relation(_) => false,
        },
        Statement::CreateExternalTable(_) | Statement::Reset(_) => false,
    }
}

/// Refuses a statement whose expressions nest past [`MAX_DEPTH`], saying so.
pub(super) fn refuse_deep(statement: &Statement) -> Result<()> {
    if too_deep(statement) {
        return Err(Error::Sql(format!(
            "the query's expressions nest more than {MAX_DEPTH} deep (a long chain of `||` or \
             `+` is one level a term); split it into steps with WITH"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::sql::parser::DFParser;

    fn parse(sql: &str) -> Statement {
        DFParser::parse_sql(sql).unwrap().pop_front().unwrap()
    }

    #[test]
    fn a_chain_is_as_deep_as_it_is_long_and_refused_past_the_limit() {
        let chain = |n: usize| format!("SELECT {}1", "1 + ".repeat(n));
        assert!(refuse_deep(&parse(&chain(MAX_DEPTH - 1))).is_ok());
        let refused = refuse_deep(&parse(&chain(MAX_DEPTH)))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("nest more than 64 deep"), "{refused}");
        // EXPLAIN and subqueries are measured too; wide is not deep.
        assert!(refuse_deep(&parse(&format!("EXPLAIN {}", chain(1000)))).is_err());
        assert!(refuse_deep(&parse(&format!("SELECT (SELECT {}1)", "1 || ".repeat(500)))).is_err());
        let wide = format!("SELECT {}1", "1, ".repeat(5000));
        assert!(refuse_deep(&parse(&wide)).is_ok());
    }
}
