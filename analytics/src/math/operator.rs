//! Linear operators: a matrix, or a composition of matrices applied one after another.
//!
//! Power iteration only needs x ↦ Ax and y ↦ Aᵀy. Composing those keeps ‖W_down·W_up‖₂ at the
//! cost of two matrix-vector products per side instead of forming a d×d product, and lets
//! σ_OV under grouped-query attention repeat key/value heads implicitly rather than copying
//! W_v. Transposed storage (GPT-2's `Conv1D` keeps Wᵀ) is a [`Transposed`] view, not a copy.

use nalgebra::{DMatrix, DVector, RealField};

use crate::error::{Error, Result};

/// A real linear map ℝⁿ → ℝᵐ that can also apply its transpose.
pub trait LinearOperator<T: RealField> {
    /// m, the output dimension.
    fn nrows(&self) -> usize;
    /// n, the input dimension.
    fn ncols(&self) -> usize;
    /// y = A x, with `x.len() == ncols()`.
    fn apply(&self, x: &DVector<T>) -> DVector<T>;
    /// x = Aᵀ y, with `y.len() == nrows()`.
    fn apply_transpose(&self, y: &DVector<T>) -> DVector<T>;
}

impl<T: RealField + Copy> LinearOperator<T> for DMatrix<T> {
    fn nrows(&self) -> usize {
        self.nrows()
    }
    fn ncols(&self) -> usize {
        self.ncols()
    }
    fn apply(&self, x: &DVector<T>) -> DVector<T> {
        let mut y = DVector::zeros(self.nrows());
        y.gemv(T::one(), self, x, T::zero());
        y
    }
    fn apply_transpose(&self, y: &DVector<T>) -> DVector<T> {
        let mut x = DVector::zeros(self.ncols());
        x.gemv_tr(T::one(), self, y, T::zero());
        x
    }
}

impl<T: RealField, A: LinearOperator<T> + ?Sized> LinearOperator<T> for &A {
    fn nrows(&self) -> usize {
        (**self).nrows()
    }
    fn ncols(&self) -> usize {
        (**self).ncols()
    }
    fn apply(&self, x: &DVector<T>) -> DVector<T> {
        (**self).apply(x)
    }
    fn apply_transpose(&self, y: &DVector<T>) -> DVector<T> {
        (**self).apply_transpose(y)
    }
}

/// Aᵀ as an operator, without copying A.
#[derive(Debug, Clone, Copy)]
pub struct Transposed<A>(pub A);

impl<T: RealField, A: LinearOperator<T>> LinearOperator<T> for Transposed<A> {
    fn nrows(&self) -> usize {
        self.0.ncols()
    }
    fn ncols(&self) -> usize {
        self.0.nrows()
    }
    fn apply(&self, x: &DVector<T>) -> DVector<T> {
        self.0.apply_transpose(x)
    }
    fn apply_transpose(&self, y: &DVector<T>) -> DVector<T> {
        self.0.apply(y)
    }
}

/// The product `left · right`, applied right to left and never formed.
#[derive(Debug, Clone, Copy)]
pub struct Product<A, B> {
    left: A,
    right: B,
}

impl<A, B> Product<A, B> {
    /// `left · right`; fails unless `left.ncols() == right.nrows()`.
    pub fn new<T: RealField>(left: A, right: B) -> Result<Self>
    where
        A: LinearOperator<T>,
        B: LinearOperator<T>,
    {
        if left.ncols() != right.nrows() {
            return Err(Error::Dimension(format!(
                "product of {}×{} and {}×{}",
                left.nrows(),
                left.ncols(),
                right.nrows(),
                right.ncols()
            )));
        }
        Ok(Product { left, right })
    }
}

impl<T: RealField, A: LinearOperator<T>, B: LinearOperator<T>> LinearOperator<T> for Product<A, B> {
    fn nrows(&self) -> usize {
        self.left.nrows()
    }
    fn ncols(&self) -> usize {
        self.right.ncols()
    }
    fn apply(&self, x: &DVector<T>) -> DVector<T> {
        self.left.apply(&self.right.apply(x))
    }
    fn apply_transpose(&self, y: &DVector<T>) -> DVector<T> {
        self.right.apply_transpose(&self.left.apply_transpose(y))
    }
}

/// W_o · W_v under grouped-query attention.
///
/// With `n_heads` query heads sharing `n_kv_heads` key/value heads, query head h reads value
/// head h / (n_heads / n_kv_heads). The effective OV circuit is W_o · R · W_v, where R
/// (n_heads·d_h × n_kv_heads·d_h) copies each value head's block to the query heads of its
/// group. R is applied by copying blocks (and Rᵀ by summing them), never stored.
/// Shapes: W_o is d_model × n_heads·d_h, W_v is n_kv_heads·d_h × d_model (PyTorch `Linear`
/// weight layout: out × in).
#[derive(Debug, Clone, Copy)]
pub struct GroupedOv<'a, T: RealField> {
    w_o: &'a DMatrix<T>,
    w_v: &'a DMatrix<T>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl<'a, T: RealField + Copy> GroupedOv<'a, T> {
    /// Checks that the shapes agree with the head counts.
    pub fn new(
        w_o: &'a DMatrix<T>,
        w_v: &'a DMatrix<T>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        if n_heads == 0 || n_kv_heads == 0 || head_dim == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(Error::Dimension(format!(
                "{n_heads} query heads, {n_kv_heads} key/value heads of dimension {head_dim}"
            )));
        }
        if w_o.ncols() != n_heads * head_dim {
            return Err(Error::Dimension(format!(
                "W_o has {} columns, expected n_heads·head_dim = {}",
                w_o.ncols(),
                n_heads * head_dim
            )));
        }
        if w_v.nrows() != n_kv_heads * head_dim {
            return Err(Error::Dimension(format!(
                "W_v has {} rows, expected n_kv_heads·head_dim = {}",
                w_v.nrows(),
                n_kv_heads * head_dim
            )));
        }
        Ok(GroupedOv {
            w_o,
            w_v,
            n_heads,
            n_kv_heads,
            head_dim,
        })
    }

    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// R · v: value heads copied out to query heads.
    fn repeat_heads(&self, v: &DVector<T>) -> DVector<T> {
        let d = self.head_dim;
        let mut out = DVector::zeros(self.n_heads * d);
        for h in 0..self.n_heads {
            let kv = h / self.group();
            out.rows_mut(h * d, d).copy_from(&v.rows(kv * d, d));
        }
        out
    }

    /// Rᵀ · y: query-head blocks summed back onto their value head.
    fn sum_heads(&self, y: &DVector<T>) -> DVector<T> {
        let d = self.head_dim;
        let mut out = DVector::zeros(self.n_kv_heads * d);
        for h in 0..self.n_heads {
            let kv = h / self.group();
            let mut block = out.rows_mut(kv * d, d);
            block += y.rows(h * d, d);
        }
        out
    }

    /// The explicit matrix W_o · R · W_v, for tests and small models only.
    pub fn to_dense(&self) -> DMatrix<T> {
        let d = self.head_dim;
        let mut repeated = DMatrix::zeros(self.n_heads * d, self.w_v.ncols());
        for h in 0..self.n_heads {
            let kv = h / self.group();
            repeated
                .rows_mut(h * d, d)
                .copy_from(&self.w_v.rows(kv * d, d));
        }
        self.w_o * repeated
    }
}

impl<T: RealField + Copy> LinearOperator<T> for GroupedOv<'_, T> {
    fn nrows(&self) -> usize {
        self.w_o.nrows()
    }
    fn ncols(&self) -> usize {
        self.w_v.ncols()
    }
    fn apply(&self, x: &DVector<T>) -> DVector<T> {
        let v = LinearOperator::apply(self.w_v, x);
        LinearOperator::apply(self.w_o, &self.repeat_heads(&v))
    }
    fn apply_transpose(&self, y: &DVector<T>) -> DVector<T> {
        let o = LinearOperator::apply_transpose(self.w_o, y);
        LinearOperator::apply_transpose(self.w_v, &self.sum_heads(&o))
    }
}
