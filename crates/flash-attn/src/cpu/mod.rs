//! The exact CPU path: tiled attention with an online softmax in f32, parallel over
//! (sequence, head, row block) with rayon. It never holds more than one
//! `BLOCK_Q × BLOCK_K` score block per task, so memory stays linear in the sequence length.
//!
//! Block products go through the `gemm` crate (candle's own CPU matmul), which reads the
//! strided q/k/v rows in place; the element-wise softmax work is in [`math`].

mod backward;
mod forward;
mod math;
mod rows;

pub(crate) use backward::backward;
pub(crate) use forward::forward;

use crate::params::{AttnParams, Dims};

/// Query rows per task.
const BLOCK_Q: usize = 64;
/// Keys per score block.
const BLOCK_K: usize = 256;

/// One attention problem as the CPU kernels see it: every call is a list of sequences
/// packed along the token dimension.
pub(crate) struct Problem<'a> {
    pub dims: &'a Dims,
    pub params: AttnParams,
    pub cu_q: &'a [usize],
    pub cu_k: &'a [usize],
    pub varlen: bool,
    /// Attention sinks (one logit per q head, joining each row's softmax denominator), or None.
    pub sinks: Option<&'a [f32]>,
}

impl<'a> Problem<'a> {
    pub fn new(dims: &'a Dims, params: AttnParams, cu_q: &'a [usize], cu_k: &'a [usize], varlen: bool) -> Self {
        Self {
            dims,
            params,
            cu_q,
            cu_k,
            varlen,
            sinks: None,
        }
    }

    pub fn with_sinks(mut self, sinks: Option<&'a [f32]>) -> Self {
        self.sinks = sinks;
        self
    }

    fn len_q(&self, b: usize) -> usize {
        self.cu_q[b + 1] - self.cu_q[b]
    }

    fn len_k(&self, b: usize) -> usize {
        self.cu_k[b + 1] - self.cu_k[b]
    }

    /// Where the LSE of query `i` of sequence `b`, head `h` lives: (batch, heads, seqlen_q)
    /// for fixed-length calls, (heads, total_q) for varlen ones.
    fn lse_index(&self, b: usize, h: usize, i: usize) -> usize {
        if self.varlen {
            h * self.dims.total_q + self.cu_q[b] + i
        } else {
            (b * self.dims.heads + h) * self.dims.seqlen_q + i
        }
    }

    /// The visible key range of query `i` of sequence `b`, in sequence-local indices.
    fn key_range(&self, b: usize, i: usize) -> (usize, usize) {
        self.params.key_range(i, self.len_q(b), self.len_k(b))
    }

    fn map(&self) -> math::ScoreMap {
        math::ScoreMap {
            scale: self.params.softmax_scale,
            softcap: self.params.softcap,
        }
    }

    /// Row blocks `(sequence, head, first row)` of the query side, the unit of parallel work.
    fn query_blocks(&self) -> Vec<(usize, usize, usize)> {
        let mut tasks = Vec::new();
        for b in 0..self.dims.batch {
            for h in 0..self.dims.heads {
                for r0 in (0..self.len_q(b)).step_by(BLOCK_Q) {
                    tasks.push((b, h, r0));
                }
            }
        }
        tasks
    }
}

/// A row-major matrix operand: element (i, j) is at `ptr[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
struct Operand {
    ptr: *const f32,
    row_stride: usize,
    col_stride: usize,
}

impl Operand {
    fn rows(ptr: *const f32, row_stride: usize) -> Self {
        Self {
            ptr,
            row_stride,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major block whose rows are `row_stride` apart.
    fn transposed(ptr: *const f32, row_stride: usize) -> Self {
        Self {
            ptr,
            row_stride: 1,
            col_stride: row_stride,
        }
    }
}

/// `dst (m × n, row stride ld) = [dst +] beta · a (m × k) · b (k × n)`.
///
/// # Safety
/// Every element the operands and `dst` describe must be in bounds.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ld: usize,
    accumulate: bool,
    a: Operand,
    b: Operand,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::slice::from_raw_parts_mut(dst.add(i * ld), n).fill(0.0);
            }
        }
        return;
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ld as isize,
        accumulate,
        a.ptr,
        a.col_stride as isize,
        a.row_stride as isize,
        b.ptr,
        b.col_stride as isize,
        b.row_stride as isize,
        1.0,
        beta,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}
