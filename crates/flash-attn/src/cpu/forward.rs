//! The CPU forward: for each (sequence, head, block of query rows), stream the visible key
//! blocks through S = Q·Kᵀ, the online softmax and O += P·V, then normalise once.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use super::math::{exp2, online_softmax, SoftmaxBlock};
use super::rows::{Element, Rows, SharedMut};
use super::{matmul, Operand, Problem, BLOCK_K, BLOCK_Q};

type Input<'a> = (&'a CpuStorage, &'a Layout);

/// Returns the output (in the input dtype, contiguous) and the f32 LSE.
pub(crate) fn forward(p: &Problem, q: Input, k: Input, v: Input) -> Result<(CpuStorage, CpuStorage)> {
    let (qr, kr, vr) = (Rows::new(q.0, q.1)?, Rows::new(k.0, k.1)?, Rows::new(v.0, v.1)?);
    Ok(match q.0 {
        CpuStorage::F32(_) => run::<f32>(p, &qr, &kr, &vr),
        CpuStorage::F16(_) => run::<f16>(p, &qr, &kr, &vr),
        CpuStorage::BF16(_) => run::<bf16>(p, &qr, &kr, &vr),
        other => bail!("flash-attn3: unsupported dtype {:?} on the CPU", other.dtype()),
    })
}

/// Per-task buffers, reused across the tasks a thread runs.
struct Scratch {
    scores: Vec<f32>,
    acc: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    ranges: Vec<(usize, usize)>,
}

impl Scratch {
    fn new(dv: usize) -> Self {
        Self {
            scores: vec![0.0; BLOCK_Q * BLOCK_K],
            acc: vec![0.0; BLOCK_Q * dv],
            row_max: vec![0.0; BLOCK_Q],
            row_sum: vec![0.0; BLOCK_Q],
            ranges: Vec::with_capacity(BLOCK_Q),
        }
    }
}

fn run<T: Element>(p: &Problem, q: &Rows, k: &Rows, v: &Rows) -> (CpuStorage, CpuStorage) {
    let dims = p.dims;
    let mut out = vec![T::from_f32(0.0); dims.total_q * dims.heads * dims.head_dim_v];
    let mut lse = vec![f32::NEG_INFINITY; dims.total_q * dims.heads];
    let (out_ptr, lse_ptr) = (SharedMut(out.as_mut_ptr()), SharedMut(lse.as_mut_ptr()));
    p.query_blocks().into_par_iter().for_each_init(
        || Scratch::new(dims.head_dim_v),
        |scratch, (b, h, r0)| attend_rows(p, q, k, v, (b, h, r0), scratch, out_ptr, lse_ptr),
    );
    (T::to_cpu_storage_owned(out), CpuStorage::F32(lse))
}

#[allow(clippy::too_many_arguments)]
fn attend_rows<T: Element>(
    p: &Problem,
    q: &Rows,
    k: &Rows,
    v: &Rows,
    (b, h, r0): (usize, usize, usize),
    s: &mut Scratch,
    out: SharedMut<T>,
    lse: SharedMut<f32>,
) {
    let dims = p.dims;
    let (d, dv) = (dims.head_dim, dims.head_dim_v);
    let rows = BLOCK_Q.min(p.len_q(b) - r0);
    let kv_head = h / dims.group();
    let (tq, tk) = (p.cu_q[b] + r0, p.cu_k[b]);

    s.ranges.clear();
    s.ranges.extend((r0..r0 + rows).map(|i| p.key_range(b, i)));
    let live = s.ranges.iter().filter(|r| r.0 < r.1);
    let span = (
        live.clone().map(|r| r.0).min().unwrap_or(0),
        live.map(|r| r.1).max().unwrap_or(0),
    );

    let acc = &mut s.acc[..rows * dv];
    acc.fill(0.0);
    s.row_max[..rows].fill(f32::NEG_INFINITY);
    s.row_sum[..rows].fill(0.0);
    for c0 in (span.0..span.1).step_by(BLOCK_K) {
        let cols = BLOCK_K.min(span.1 - c0);
        // SAFETY: `rows` query rows and `cols` key rows of this sequence exist in q, k and v,
        // and the scratch blocks hold rows × BLOCK_K and rows × dv values.
        unsafe {
            matmul(
                rows,
                cols,
                d,
                s.scores.as_mut_ptr(),
                BLOCK_K,
                false,
                Operand::rows(q.ptr(tq, h), q.token_stride()),
                Operand::transposed(k.ptr(tk + c0, kv_head), k.token_stride()),
                1.0,
            );
        }
        online_softmax(SoftmaxBlock {
            scores: &mut s.scores[..rows * BLOCK_K],
            ld: BLOCK_K,
            cols,
            col0: c0,
            ranges: &s.ranges,
            row_max: &mut s.row_max[..rows],
            row_sum: &mut s.row_sum[..rows],
            acc,
            dv,
            map: p.map(),
        });
        // SAFETY: as above.
        unsafe {
            matmul(
                rows,
                dv,
                cols,
                acc.as_mut_ptr(),
                dv,
                true,
                Operand::rows(s.scores.as_ptr(), BLOCK_K),
                Operand::rows(v.ptr(tk + c0, kv_head), v.token_stride()),
                1.0,
            );
        }
    }

    // The head's sink logit in log2 units: one more term of every row's denominator.
    let sink_log2 = p.sinks.map(|s| s[h] * std::f32::consts::LOG2_E);
    for r in 0..rows {
        let (row_max, row_sum) = (s.row_max[r], s.row_sum[r]);
        let o = &mut acc[r * dv..(r + 1) * dv];
        let keys_lse2 = if row_sum > 0.0 {
            row_max + row_sum.log2()
        } else {
            f32::NEG_INFINITY
        };
        // log2 of the whole denominator (keys and sink), without overflow for a sink far above
        // the keys: max + log2(1 + 2^(min - max)).
        let lse2 = match sink_log2 {
            Some(z) if keys_lse2 == f32::NEG_INFINITY => z,
            Some(z) => keys_lse2.max(z) + (1.0 + exp2(-(keys_lse2 - z).abs())).log2(),
            None => keys_lse2,
        };
        let row_lse = if row_sum > 0.0 {
            // acc holds the numerators in units of 2^row_max: divide by 2^(lse2 - row_max),
            // which is row_sum itself without a sink.
            let inv = match sink_log2 {
                Some(_) => exp2(row_max - lse2),
                None => 1.0 / row_sum,
            };
            o.iter_mut().for_each(|x| *x *= inv);
            lse2 * std::f32::consts::LN_2
        } else {
            // The row sees no key: output 0, LSE -inf (or the sink's logit).
            o.fill(0.0);
            lse2 * std::f32::consts::LN_2
        };
        // SAFETY: row (tq + r, h) and its LSE belong to this task alone.
        unsafe {
            out.write(((tq + r) * dims.heads + h) * dv, o);
            lse.write(p.lse_index(b, h, r0 + r), &[row_lse]);
        }
    }
}
