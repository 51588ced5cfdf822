//! The KV cache of [`crate::Llama`]: keys and values of every layer for a batch of sequences,
//! preallocated and written in place, in the model's dtype or as e4m3 (the fp8 cache), in one slot
//! per sequence or in pages (the paged cache), and how a step's new keys are written into it and
//! grouped for `flash_attn_with_kvcache` calls.

use std::collections::{HashMap, VecDeque};
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, InplaceOp2, Layout, Result, Tensor};

use crate::config::Config;

/// Keys and values of every layer for a batch of sequences, preallocated and written in place.
///
/// Layout: per layer, one contiguous tensor of shape (batch × max_seq, 2 × kv_heads, head_dim):
/// each row holds a token's k heads then its v heads. Sequence `i` owns rows
/// `[i·max_seq, (i+1)·max_seq)`, of which the first `lens[i]` are filled. The k and v halves are
/// flash-attn3's (batch, max_seq, kv_heads, head_dim) layout with the first two axes merged and
/// a row stride of 2 × kv_heads × head_dim, which the op reads as it is. Appending a token is one
/// strided copy of its row (k and v together when they come from the fused q/k/v projection,
/// where they are adjacent), no concatenation, no reallocation.
///
/// Sequences of different lengths: the varlen op reads sequence `b`'s keys from the cumulative
/// offsets `seqlens_k[b]..seqlens_k[b+1]`, which must tile the packed axis without holes. The
/// unused tail of each slot is described as an extra *gap* sequence that has no query, so the
/// call sees 2 × batch sequences:
///
/// ```text
/// rows      | seq 0: lens[0] keys | gap 0 | seq 1: lens[1] keys | gap 1 | ...
/// seqlens_k   0      lens[0]        S      S + lens[1]          2S      ...   (S = max_seq)
/// seqlens_q   0      n0             n0     n0 + n1              n0 + n1 ...   (n_i new tokens)
/// ```
///
/// A gap has zero queries, so the op does no work for it; each real sequence attends to exactly
/// its own keys, with the causal mask aligned bottom-right (its new tokens are its last keys).
///
/// **fp8 caches** ([`crate::Llama::new_cache_of`] with `F8E4M3`): each layer holds its keys and values
/// as e4m3 in two planes, k then v, each (batch, max_seq, kv_heads, head_dim), half the bytes
/// of bf16. The first write into an empty cache (the prefill) fixes one scale per (layer, kv
/// head) for k and for v: [`E4M3_HEADROOM`] times that write's largest magnitude (after RoPE),
/// mapped to e4m3's largest value 448; later tokens are multiplied by the same factor and
/// saturated to ±448 (so up to 64 times the prompt's largest value is stored without clipping).
/// The fused GPU RoPE + KV store quantizes as it stores. A step that reads the cache runs
/// `flash_attn_with_kvcache` on the e4m3 planes directly (q quantized for the call, one scale
/// per (sequence, kv head) at decode so the kernel packs GQA groups; the varlen call would
/// transpose all of V each step), one call per group of
/// sequences with the same number of new tokens. A prefill into an empty cache attends to the
/// fresh keys in the model's dtype, as for any cache.
///
/// Not `Clone`: a tensor clone shares storage, and the in-place writes would show in both.
#[derive(Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerKv>,
    pub(crate) lens: Vec<usize>,
    pub(crate) max_seq: usize,
    pub(crate) dtype: DType,
    /// A paged cache's pages (`None`: one slot of max_seq rows per sequence).
    pub(crate) paging: Option<Paging>,
    /// A 16-bit cache on the GPU: cos and sin (max_seq, head_dim / 2) f32 of every position's
    /// rotary angles, for a device decode step whose attention call turns q and the new key
    /// itself ([`crate::Llama`]'s `decode_on_device`). Made with the cache, so that a CUDA graph
    /// of the step reads them at fixed addresses.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) rotary: Option<(Tensor, Tensor)>,
}

/// [`KvCache::rotary`] for a cache of `max_seq` positions in `dtype` on `device`: the angles
/// position × inv_freq in f32 and their cos and sin, as the model's own tables
/// ([`crate::nn::rope_angles`]) before their cast to the run dtype. None on the CPU and for fp8.
fn rotary_tables(cfg: &Config, max_seq: usize, dtype: DType, device: &Device) -> Result<Option<(Tensor, Tensor)>> {
    if !device.is_cuda() || dtype == DType::F8E4M3 {
        return Ok(None);
    }
    let positions = Tensor::arange(0u32, max_seq as u32, device)?;
    let inv_freq = Tensor::new(cfg.rope_inv_freq(), device)?;
    let (cos, sin) = crate::nn::rope_angles(&positions, &inv_freq)?;
    Ok(Some((cos.contiguous()?, sin.contiguous()?)))
}

/// The pages of a paged cache (vLLM's layout): a pool of pages of `page_size` rows, each
/// sequence holding a list of them in order, so that memory follows what sequences hold rather
/// than batch × max_seq.
#[derive(Debug)]
pub(crate) struct Paging {
    pub(crate) page_size: usize,
    /// Pages in the pool.
    pages: usize,
    /// Free pages, taken from the end.
    free: Vec<u32>,
    /// Each sequence's pages, in position order.
    pub(crate) owned: Vec<Vec<u32>>,
    /// Holders of each page: the sequences and the retired prefixes that hold it (prefix
    /// sharing: a page goes back to the pool at 0).
    holders: Vec<u32>,
    /// Pages one sequence may hold (max_seq / page_size): the page table's width.
    pub(crate) max_pages: usize,
    /// A page held for the cache's lifetime once a CUDA-graph decode step asked for it
    /// ([`KvCache::scratch_page`]): where the graph's empty slots write their dummy token.
    scratch: Option<u32>,
    /// Finished sequences' whole pages of keys, kept for later prompts that start the same way,
    /// least recently used first; given back (oldest first) when the pool runs short.
    retired: VecDeque<RetiredPrefix>,
}

/// A finished sequence's first tokens and the pages holding their keys (whole pages), each page
/// with one holder for the entry.
#[derive(Debug)]
struct RetiredPrefix {
    tokens: Vec<u32>,
    pages: Vec<u32>,
}

/// How many of `prompt`'s first tokens a sequence whose cached keys are those of `held` can give
/// it: their common start in whole pages of `page` tokens, leaving at least one prompt token to
/// feed (for its logits).
pub(crate) fn shareable_tokens(held: &[u32], prompt: &[u32], page: usize) -> usize {
    let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    (common.min(prompt.len().saturating_sub(1)) / page) * page
}

/// The most retired prefixes a paged cache keeps (each costs nothing but its pages, which the
/// pool takes back when it needs them; the bound keeps the prefix search short).
const MAX_RETIRED_PREFIXES: usize = 256;

impl Paging {
    /// Sequence `i`'s row of a page table: its pages in position order, then page 0 up to
    /// max_pages (the kernel reads no page past a sequence's keys).
    fn table_row(&self, i: usize) -> impl Iterator<Item = u32> + '_ {
        (0..self.max_pages).map(move |j| self.owned[i].get(j).copied().unwrap_or(0))
    }

    /// Drops one holder of `page`; the page goes back to the pool at 0.
    fn release(&mut self, page: u32) {
        let holders = &mut self.holders[page as usize];
        *holders -= 1;
        if *holders == 0 {
            self.free.push(page);
        }
    }

    /// Gives retired prefixes' pages back, least recently used first, until `need` pages are
    /// free or no prefix is left.
    fn evict_retired(&mut self, need: usize) {
        while self.free.len() < need {
            let Some(entry) = self.retired.pop_front() else { break };
            for page in entry.pages.into_iter().rev() {
                self.release(page);
            }
        }
    }

    /// Pages that only retired prefixes hold: free once those are evicted.
    fn reclaimable(&self) -> usize {
        let mut refs: HashMap<u32, u32> = HashMap::new();
        for entry in &self.retired {
            for &page in &entry.pages {
                *refs.entry(page).or_default() += 1;
            }
        }
        refs.iter()
            .filter(|&(&page, &n)| self.holders[page as usize] == n)
            .count()
    }
}

/// Headroom of an fp8 cache's scales over the largest value of its first write (see
/// [`KvCache`]). Large, because the first write may be a short prompt (a lone BOS token has
/// far smaller keys than the text after it) and headroom costs little: e4m3 keeps its 4
/// significant bits over 2^15 of range, so only values under 1/437 of the first write's largest
/// fall into its subnormals, where they weigh little in a dot product. Measured on
/// SmolLM2-135M (`generate --perplexity`, prefill of one token): headroom 2 raised the
/// perplexity by 27% (later keys clipped), 8 by 0.4%, 64 and 1000 left it within 0.5% of the
/// f32 cache (docs/benchmarks.md).
pub const E4M3_HEADROOM: f64 = 64.0;
/// e4m3's largest finite value.
pub(crate) const E4M3_MAX: f64 = 448.0;

/// One layer's cached keys and values.
#[derive(Debug)]
pub(crate) enum LayerKv {
    /// In the model's dtype: (rows, 2 × kv_heads, head_dim), k heads first (rows: batch ×
    /// max_seq, or pages × page_size for a paged cache).
    Rows(Tensor),
    /// e4m3: (2, rows, kv_heads, head_dim), the k plane then the v plane, with the layer's
    /// scales, fixed by its first write.
    E4m3 { kv: Tensor, scales: OnceLock<E4m3Scales> },
}

/// An fp8 cache layer's scales.
#[derive(Debug)]
pub(crate) struct E4m3Scales {
    /// (2 × kv_heads,) f32, k heads first: value → e4m3 factor of each cached head.
    pub(crate) quant: Tensor,
    /// (1, kv_heads) f32 each: e4m3 → value factors, in flash-attn3's descale shape.
    pub(crate) k_descale: Tensor,
    pub(crate) v_descale: Tensor,
}

impl E4m3Scales {
    /// The scales for `kv_new` (tokens, 2 × kv_heads, head_dim), k heads first: each head's
    /// largest magnitude times [`E4M3_HEADROOM`] maps to 448 (a head of zeros gets a tiny scale
    /// rather than a division by zero).
    fn of(kv_new: &Tensor) -> Result<Self> {
        let hk = kv_new.dim(1)? / 2;
        let amax = kv_new.to_dtype(DType::F32)?.abs()?.max(2)?.max(0)?.maximum(1e-6f32)?;
        let descale = (amax * (E4M3_HEADROOM / E4M3_MAX))?;
        Ok(Self {
            quant: descale.recip()?,
            k_descale: descale.narrow(0, 0, hk)?.reshape((1, hk))?,
            v_descale: descale.narrow(0, hk, hk)?.reshape((1, hk))?,
        })
    }
}

impl LayerKv {
    /// The layer's k and v as `flash_attn_with_kvcache` reads them, (view.0, view.1, kv_heads, d)
    /// each ([`KvCache::view_dims`]: slots and max_seq, or pages and page_size): the two planes,
    /// or for [`LayerKv::Rows`] the k and v heads of each row as two strided views (no copy).
    pub(crate) fn cache_views(&self, view: (usize, usize), kv_heads: usize, d: usize) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            LayerKv::Rows(kv) => {
                let rows = kv.reshape((view.0, view.1, 2 * kv_heads, d))?;
                (rows.narrow(2, 0, kv_heads)?, rows.narrow(2, kv_heads, kv_heads)?)
            }
            LayerKv::E4m3 { kv, .. } => (
                kv.get(0)?.reshape((view.0, view.1, kv_heads, d))?,
                kv.get(1)?.reshape((view.0, view.1, kv_heads, d))?,
            ),
        })
    }

    /// Stores the new tokens' k and v heads, `kv_new` (tokens, 2 × kv_heads, head_dim), k heads
    /// first, at the cache rows `writes` names (an fp8 layer's first write fixes its scales).
    /// `rows` (tokens,) u32, the cache row of each token, is needed on the GPU.
    pub(crate) fn store(&self, kv_new: &Tensor, writes: &[(usize, usize, usize)], rows: Option<&Tensor>) -> Result<()> {
        match self {
            LayerKv::Rows(kv) => write_rows(kv, kv_new, 0, writes),
            LayerKv::E4m3 { kv, scales } => {
                let scales = match scales.get() {
                    Some(s) => s,
                    None => {
                        let _ = scales.set(E4m3Scales::of(kv_new)?);
                        scales.get().expect("just set")
                    }
                };
                if kv_new.device().is_cuda() {
                    let Some(rows) = rows else {
                        bail!("internal error: a GPU cache write without its rows")
                    };
                    return crate::fused::store_e4m3(kv_new, kv, rows, &scales.quant);
                }
                let hk = kv_new.dim(1)? / 2;
                let e4m3 = kv_new
                    .to_dtype(DType::F32)?
                    .broadcast_mul(&scales.quant.reshape((1, 2 * hk, 1))?)?
                    .clamp(-E4M3_MAX as f32, E4M3_MAX as f32)?
                    .to_dtype(DType::F8E4M3)?;
                write_rows(&kv.get(0)?, &e4m3.narrow(1, 0, hk)?, 0, writes)?;
                write_rows(&kv.get(1)?, &e4m3.narrow(1, hk, hk)?, 0, writes)
            }
        }
    }
}

impl KvCache {
    /// An empty cache for `batch` sequences of at most `max_seq` tokens each, holding keys and
    /// values in `dtype`: the model's, or `F8E4M3` (see above).
    pub fn new(cfg: &Config, batch: usize, max_seq: usize, dtype: DType, device: &Device) -> Result<Self> {
        if batch == 0 || max_seq == 0 {
            bail!("a KV cache needs batch >= 1 and max_seq >= 1, got batch {batch}, max_seq {max_seq}")
        }
        let (hk, d) = (cfg.num_key_value_heads, cfg.head_dim);
        let layer = || -> Result<LayerKv> {
            Ok(match dtype {
                DType::F8E4M3 => LayerKv::E4m3 {
                    kv: Tensor::zeros((2, batch * max_seq, hk, d), dtype, device)?,
                    scales: OnceLock::new(),
                },
                _ => LayerKv::Rows(Tensor::zeros((batch * max_seq, 2 * hk, d), dtype, device)?),
            })
        };
        Ok(Self {
            layers: (0..cfg.num_hidden_layers).map(|_| layer()).collect::<Result<_>>()?,
            lens: vec![0; batch],
            max_seq,
            dtype,
            paging: None,
            rotary: rotary_tables(cfg, max_seq, dtype, device)?,
        })
    }

    /// An empty paged cache: a pool of `pages` pages of `page_size` tokens (one of
    /// flash-attn3's `PAGE_SIZES`, 16 to 256) shared by `batch` sequences of at most `max_seq`
    /// tokens each (a multiple of `page_size`), in `dtype` (the model's or `F8E4M3`). A
    /// sequence takes pages as it grows ([`KvCache::reserve`], or the step that needs them) and
    /// gives them back when cleared. Attention reads it through `flash_attn_with_kvcache` with a
    /// page table.
    pub fn new_paged(
        cfg: &Config,
        batch: usize,
        pages: usize,
        page_size: usize,
        max_seq: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if !flash_attn3::kvcache::PAGE_SIZES.contains(&page_size) {
            bail!(
                "a paged KV cache takes pages of {:?} tokens, got {page_size}",
                flash_attn3::kvcache::PAGE_SIZES
            )
        }
        if batch == 0 || pages == 0 || max_seq == 0 || max_seq % page_size != 0 {
            bail!(
                "a paged KV cache needs batch, pages and max_seq >= 1, max_seq a multiple of the page size: got batch {batch}, {pages} pages of {page_size}, max_seq {max_seq}"
            )
        }
        if pages > u32::MAX as usize {
            bail!("a paged KV cache holds at most 2^32 - 1 pages, got {pages}")
        }
        let (hk, d) = (cfg.num_key_value_heads, cfg.head_dim);
        let rows = pages * page_size;
        // The contiguous cache's layouts over pages × page_size rows: a page is page_size rows.
        let layer = || -> Result<LayerKv> {
            Ok(match dtype {
                DType::F8E4M3 => LayerKv::E4m3 {
                    kv: Tensor::zeros((2, rows, hk, d), dtype, device)?,
                    scales: OnceLock::new(),
                },
                _ => LayerKv::Rows(Tensor::zeros((rows, 2 * hk, d), dtype, device)?),
            })
        };
        Ok(Self {
            layers: (0..cfg.num_hidden_layers).map(|_| layer()).collect::<Result<_>>()?,
            lens: vec![0; batch],
            max_seq,
            dtype,
            paging: Some(Paging {
                page_size,
                pages,
                // Taken from the end: page 0 first.
                free: (0..pages as u32).rev().collect(),
                owned: vec![Vec::new(); batch],
                holders: vec![0; pages],
                max_pages: max_seq / page_size,
                retired: VecDeque::new(),
                scratch: None,
            }),
            rotary: rotary_tables(cfg, max_seq, dtype, device)?,
        })
    }

    /// A paged cache's page size (`None` for a contiguous cache).
    pub fn page_size(&self) -> Option<usize> {
        self.paging.as_ref().map(|p| p.page_size)
    }

    /// A paged cache's pool size in pages that sequences can hold: all of them but the scratch
    /// page once CUDA-graph decode took it (`None` for a contiguous cache).
    pub fn pool_pages(&self) -> Option<usize> {
        self.paging.as_ref().map(|p| p.pages - p.scratch.is_some() as usize)
    }

    /// A paged cache's free pages, counting those that only retired prefixes hold (the pool
    /// takes them back when it needs them) (`None` for a contiguous cache).
    pub fn free_pages(&self) -> Option<usize> {
        self.paging.as_ref().map(|p| p.free.len() + p.reclaimable())
    }

    /// Pages that retired prefixes of finished sequences hold (`None` for a contiguous cache):
    /// keys kept for later prompts that start the same way ([`KvCache::retire_sequence`]).
    pub fn prefix_cache_pages(&self) -> Option<usize> {
        self.paging.as_ref().map(|p| {
            let mut pages: Vec<u32> = p.retired.iter().flat_map(|e| e.pages.iter().copied()).collect();
            pages.sort_unstable();
            pages.dedup();
            pages.len()
        })
    }

    /// Makes sure sequence `i` of a paged cache has pages for `tokens` tokens, taking what it
    /// lacks from the pool (all or none: an error if the pool has too few, and nothing taken).
    /// Contiguous caches have their room already: only `tokens <= max_seq` is checked.
    pub fn reserve(&mut self, i: usize, tokens: usize) -> Result<()> {
        if i >= self.lens.len() || tokens > self.max_seq {
            bail!(
                "reserve: sequence {i} of {}, {tokens} tokens of at most {}",
                self.lens.len(),
                self.max_seq
            )
        }
        let Some(paging) = &mut self.paging else {
            return Ok(());
        };
        let need = tokens.div_ceil(paging.page_size).saturating_sub(paging.owned[i].len());
        paging.evict_retired(need);
        if need > paging.free.len() {
            bail!(
                "the KV cache's page pool is exhausted: sequence {i} needs {need} more pages, {} are free",
                paging.free.len()
            )
        }
        let at = paging.free.len() - need;
        let taken: Vec<u32> = paging.free.drain(at..).rev().collect();
        for &page in &taken {
            paging.holders[page as usize] = 1;
        }
        paging.owned[i].extend(taken);
        Ok(())
    }

    /// [`KvCache::reserve`] for every sequence at once, `tokens[i]` for sequence `i`: all or
    /// none (an exhausted pool is an error before any page is taken, so a failed step writes
    /// nothing).
    pub fn reserve_all(&mut self, tokens: &[usize]) -> Result<()> {
        if tokens.len() != self.lens.len() {
            bail!("reserve_all: {} counts for {} sequences", tokens.len(), self.lens.len())
        }
        let Some(p) = &mut self.paging else {
            return Ok(());
        };
        let need: usize = tokens
            .iter()
            .zip(&p.owned)
            .map(|(&t, owned)| t.div_ceil(p.page_size).saturating_sub(owned.len()))
            .sum();
        p.evict_retired(need);
        if need > p.free.len() {
            bail!(
                "the KV cache's page pool is exhausted: {need} more pages needed, {} are free",
                p.free.len()
            )
        }
        for (i, &t) in tokens.iter().enumerate() {
            self.reserve(i, t)?;
        }
        Ok(())
    }

    /// Prefix sharing (paged caches): empty sequence `to` starts with the first `tokens` keys of
    /// sequence `from`, whose pages it shares instead of computing and storing them again (a
    /// common system prompt). `tokens` must be whole pages (later writes never touch a shared
    /// page) and held by `from`; the pages go back to the pool when the last holder is cleared.
    pub fn share_prefix(&mut self, from: usize, to: usize, tokens: usize) -> Result<()> {
        let n = self.lens.len();
        let Some(p) = &mut self.paging else {
            bail!("share_prefix: only a paged cache shares pages")
        };
        if from >= n || to >= n || from == to || tokens % p.page_size != 0 || tokens > self.lens[from] {
            bail!(
                "share_prefix: sequences {from} -> {to} of {n}, {tokens} tokens (whole pages of {}, at most the {} that {from} holds)",
                p.page_size,
                self.lens.get(from).copied().unwrap_or(0)
            )
        }
        if self.lens[to] != 0 || !p.owned[to].is_empty() {
            bail!("share_prefix: sequence {to} is not empty")
        }
        let pages: Vec<u32> = p.owned[from][..tokens / p.page_size].to_vec();
        for &page in &pages {
            p.holders[page as usize] += 1;
        }
        p.owned[to] = pages;
        self.lens[to] = tokens;
        Ok(())
    }

    /// [`KvCache::clear_sequence`] for a finished sequence `i` of a paged cache whose tokens
    /// are `tokens` (its first `lens()[i]` have their keys here): its whole pages of keys stay,
    /// as a retired prefix, for later prompts that start the same way ([`KvCache::share_retired`])
    /// until the pool needs them (then the least recently used go first). A contiguous cache
    /// just clears the sequence.
    pub fn retire_sequence(&mut self, i: usize, tokens: &[u32]) -> Result<()> {
        let held = self.lens.get(i).copied().unwrap_or(0).min(tokens.len());
        if let Some(p) = &mut self.paging {
            let whole = held / p.page_size;
            let tokens = &tokens[..whole * p.page_size];
            // Nothing new if a kept prefix already starts with these tokens.
            let known = p.retired.iter().any(|e| e.tokens.starts_with(tokens));
            if whole > 0 && !known {
                let pages = p.owned[i][..whole].to_vec();
                for &page in &pages {
                    p.holders[page as usize] += 1;
                }
                p.retired.push_back(RetiredPrefix {
                    tokens: tokens.to_vec(),
                    pages,
                });
                if p.retired.len() > MAX_RETIRED_PREFIXES {
                    let oldest = p.retired.pop_front().expect("more than the bound");
                    for page in oldest.pages.into_iter().rev() {
                        p.release(page);
                    }
                }
            }
        }
        self.clear_sequence(i)
    }

    /// The retired prefix (its index) sharing the longest start with `prompt`, in whole pages,
    /// leaving at least one prompt token, and that many tokens; `None` if no page's worth.
    pub(crate) fn retired_match(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        let p = self.paging.as_ref()?;
        let mut best: Option<(usize, usize)> = None;
        for (e, entry) in p.retired.iter().enumerate() {
            let tokens = shareable_tokens(&entry.tokens, prompt, p.page_size);
            if tokens > 0 && best.is_none_or(|(_, t)| tokens > t) {
                best = Some((e, tokens));
            }
        }
        best
    }

    /// [`KvCache::share_prefix`] from retired prefix `entry` (of [`KvCache::retired_match`]):
    /// empty sequence `to` starts with its first `tokens` keys (whole pages); the entry becomes
    /// the most recently used.
    pub(crate) fn share_retired(&mut self, entry: usize, to: usize, tokens: usize) -> Result<()> {
        let n = self.lens.len();
        let Some(p) = &mut self.paging else {
            bail!("share_retired: only a paged cache keeps prefixes")
        };
        let fits = p
            .retired
            .get(entry)
            .is_some_and(|e| tokens % p.page_size == 0 && tokens <= e.tokens.len());
        if to >= n || !fits {
            bail!("share_retired: prefix {entry}, {tokens} tokens, for sequence {to} of {n}")
        }
        if self.lens[to] != 0 || !p.owned[to].is_empty() {
            bail!("share_retired: sequence {to} is not empty")
        }
        let e = p.retired.remove(entry).expect("checked above");
        let pages: Vec<u32> = e.pages[..tokens / p.page_size].to_vec();
        for &page in &pages {
            p.holders[page as usize] += 1;
        }
        p.retired.push_back(e);
        p.owned[to] = pages;
        self.lens[to] = tokens;
        Ok(())
    }

    /// A paged cache's scratch page (`None` for a contiguous cache, or when the pool has no free
    /// page left for it): taken from the pool the first time and held for the cache's lifetime,
    /// one page less for sequences. A CUDA-graph decode step decodes every row of its batch,
    /// empty slots too, and an empty slot of a paged cache has no page of its own to write its
    /// dummy token to (crate::decode_graph).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn scratch_page(&mut self) -> Option<u32> {
        let p = self.paging.as_mut()?;
        if p.scratch.is_none() {
            p.evict_retired(1);
            let page = p.free.pop()?;
            p.holders[page as usize] += 1;
            p.scratch = Some(page);
        }
        p.scratch
    }

    /// A paged CUDA-graph decode step's inputs for the first `lens.len()` sequences, from the
    /// host's page lists: each sequence's cache row for its key at position `lens[i]`, and the
    /// page table (rows × max_pages, row-major; unused entries page 0). An empty sequence (no
    /// keys, no pages) writes to and reads from `scratch`'s first row. Fails for a sequence that
    /// holds keys but no page for its next one (a batcher's sequences take their pages when they
    /// join).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn paged_decode_inputs(&self, lens: &[usize], scratch: u32) -> Result<(Vec<u32>, Vec<u32>)> {
        let Some(p) = &self.paging else {
            bail!("internal error: paged decode inputs of a contiguous cache")
        };
        let mut rows = Vec::with_capacity(lens.len());
        let mut table: Vec<u32> = (0..lens.len()).flat_map(|i| p.table_row(i)).collect();
        for (i, &len) in lens.iter().enumerate() {
            let owned = &p.owned[i];
            if len == 0 && owned.is_empty() {
                rows.push(scratch * p.page_size as u32);
                table[i * p.max_pages] = scratch;
                continue;
            }
            let Some(&page) = owned.get(len / p.page_size) else {
                bail!("decode step: sequence {i} holds {len} keys and no page for its next one")
            };
            rows.push(page * p.page_size as u32 + (len % p.page_size) as u32);
        }
        Ok((rows, table))
    }

    /// The cache row of sequence `i`'s key at position `pos` (its slot's row, or its page's).
    pub(crate) fn row(&self, i: usize, pos: usize) -> usize {
        match &self.paging {
            None => i * self.max_seq + pos,
            Some(p) => p.owned[i][pos / p.page_size] as usize * p.page_size + pos % p.page_size,
        }
    }

    /// The first two dims of the caches' 4-D view for flash-attn3: (batch, max_seq), or (pages,
    /// page_size) when paged.
    pub(crate) fn view_dims(&self) -> (usize, usize) {
        match &self.paging {
            None => (self.lens.len(), self.max_seq),
            Some(p) => (p.pages, p.page_size),
        }
    }

    /// Counts one more key in every sequence (a step that stored one per sequence on the device,
    /// [`crate::decode_graph`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn advance_all(&mut self) {
        for len in &mut self.lens {
            *len += 1;
        }
    }

    /// Tokens held for each sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// The dtype the keys and values are held in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Forgets sequence `i` alone (a finished member of a running batch; its slot's memory is
    /// overwritten by the next sequence there, a paged cache's pages go back to the pool). An fp8
    /// cache keeps its scales.
    pub fn clear_sequence(&mut self, i: usize) -> Result<()> {
        match self.lens.get_mut(i) {
            Some(len) => *len = 0,
            None => bail!(
                "clear_sequence: no sequence {i} in a cache of batch {}",
                self.lens.len()
            ),
        }
        if let Some(p) = &mut self.paging {
            let pages = std::mem::take(&mut p.owned[i]);
            for page in pages.into_iter().rev() {
                p.release(page);
            }
        }
        Ok(())
    }

    /// Forgets every sequence and retired prefix (the memory is kept and overwritten by the next
    /// prefill, which also sets an fp8 cache's scales afresh).
    pub fn reset(&mut self) {
        for i in 0..self.lens.len() {
            let _ = self.clear_sequence(i);
        }
        // Retired prefixes too: their keys may belong to the fp8 scales dropped below.
        if let Some(p) = &mut self.paging {
            p.evict_retired(usize::MAX);
        }
        for layer in &mut self.layers {
            if let LayerKv::E4m3 { scales, .. } = layer {
                scales.take();
            }
        }
    }
}

/// Sequences of one step with the same number of new tokens, for one kvcache call; or (a paged
/// 16-bit cache, [`CacheGroup::varlen`]) every sequence of the step with its own count.
pub(crate) struct CacheGroup {
    /// Their queries' packed rows, (batch × new,) u32; `None`: every packed row, in order.
    pub(crate) rows: Option<Tensor>,
    pub(crate) batch: usize,
    pub(crate) new: usize,
    /// Keys each holds after this step's write, (batch,) u32.
    pub(crate) seqlens: Tensor,
    /// Their cache rows, (batch,) u32; `None`: 0..batch, the whole cache (contiguous caches).
    pub(crate) cache_idx: Option<Tensor>,
    /// Their pages, (batch, max_pages) u32 (paged caches).
    pub(crate) page_table: Option<Tensor>,
    /// Varlen queries: every sequence's new tokens at these offsets of the packed rows
    /// (`KvCacheAttn::varlen_q`); `new` is then the most any sequence has.
    pub(crate) cu_q: Option<flash_attn3::SeqOffsets>,
}

impl CacheGroup {
    /// The first `batch` sequences of a contiguous cache, in order, with one new token each and
    /// `seqlens` (batch,) u32 keys after this step's.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn one_token_each(batch: usize, seqlens: Tensor) -> Self {
        Self {
            rows: None,
            batch,
            new: 1,
            seqlens,
            cache_idx: None,
            page_table: None,
            cu_q: None,
        }
    }

    /// [`CacheGroup::one_token_each`] over a paged cache: the first `batch` sequences' pages,
    /// (batch, max_pages) u32.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn one_token_each_paged(batch: usize, seqlens: Tensor, page_table: Tensor) -> Self {
        Self {
            page_table: Some(page_table),
            ..Self::one_token_each(batch, seqlens)
        }
    }

    /// A step over a paged 16-bit cache as one group: sequence `i` (holding `lens[i]` keys before
    /// the step) brings `new[i]` queries, packed in order, through one kvcache call with varlen
    /// queries, where [`CacheGroup::plan`] would make one call per distinct count (a prefill chunk
    /// beside decode tokens: two calls, and the rows gathered and put back around them).
    pub(crate) fn varlen(lens: &[usize], new: &[usize], paging: &Paging, dev: &Device) -> Result<Self> {
        let seqlens: Vec<u32> = lens.iter().zip(new).map(|(&l, &n)| (l + n) as u32).collect();
        let table: Vec<u32> = (0..new.len()).flat_map(|i| paging.table_row(i)).collect();
        Ok(Self {
            rows: None,
            batch: new.len(),
            new: new.iter().copied().max().unwrap_or(0),
            seqlens: Tensor::new(seqlens, dev)?,
            cache_idx: None,
            page_table: Some(Tensor::from_vec(table, (new.len(), paging.max_pages), dev)?),
            cu_q: Some(flash_attn3::SeqOffsets::from_lengths(new.iter().copied(), dev)?),
        })
    }

    /// The groups of a step that appends `new[i]` tokens to sequence `i`, holding `lens[i]`
    /// before it (sequences given no token are in none), and, with several groups, the
    /// permutation that puts their concatenated outputs back in packed order.
    pub(crate) fn plan(
        lens: &[usize],
        new: &[usize],
        paging: Option<&Paging>,
        dev: &Device,
    ) -> Result<(Vec<CacheGroup>, Option<Tensor>)> {
        let mut first_row = Vec::with_capacity(new.len());
        let mut packed = 0;
        for &n in new {
            first_row.push(packed);
            packed += n;
        }
        let mut counts: Vec<usize> = Vec::new();
        for &n in new {
            if n > 0 && !counts.contains(&n) {
                counts.push(n);
            }
        }
        let single = counts.len() == 1;
        let mut order: Vec<u32> = Vec::with_capacity(packed);
        let mut groups = Vec::with_capacity(counts.len());
        for n in counts {
            let seqs: Vec<usize> = (0..new.len()).filter(|&i| new[i] == n).collect();
            let rows: Vec<u32> = seqs
                .iter()
                .flat_map(|&i| (first_row[i]..first_row[i] + n).map(|r| r as u32))
                .collect();
            order.extend(&rows);
            let seqlens: Vec<u32> = seqs.iter().map(|&i| (lens[i] + n) as u32).collect();
            let whole_cache = seqs.len() == new.len();
            let page_table = match paging {
                None => None,
                Some(p) => {
                    let table: Vec<u32> = seqs.iter().flat_map(|&i| p.table_row(i)).collect();
                    Some(Tensor::from_vec(table, (seqs.len(), p.max_pages), dev)?)
                }
            };
            groups.push(CacheGroup {
                rows: if single { None } else { Some(Tensor::new(rows, dev)?) },
                batch: seqs.len(),
                new: n,
                seqlens: Tensor::new(seqlens, dev)?,
                page_table,
                cache_idx: if whole_cache || paging.is_some() {
                    None
                } else {
                    Some(Tensor::new(seqs.iter().map(|&i| i as u32).collect::<Vec<_>>(), dev)?)
                },
                cu_q: None,
            });
        }
        let unpermute = if single {
            None
        } else {
            let mut inverse = vec![0u32; order.len()];
            for (pos, &row) in order.iter().enumerate() {
                inverse[row as usize] = pos as u32;
            }
            Some(Tensor::new(inverse, dev)?)
        };
        Ok((groups, unpermute))
    }
}

/// Copies runs of packed rows of `src` (tokens, heads, d) into the cache rows given by
/// `writes`, in place, at heads `first_head..first_head + heads` of each cache row.
///
/// A row of `src` must be contiguous (heads × d elements), but rows may be any distance apart
/// (a view into a fused q/k/v projection). Runs whose source and destination rows are both
/// equally spaced (one token for each sequence of a batch whose caches hold the same lengths:
/// the usual decode step) are one strided copy; otherwise one copy per run.
pub(crate) fn write_rows(
    cache: &Tensor,
    src: &Tensor,
    first_head: usize,
    writes: &[(usize, usize, usize)],
) -> Result<()> {
    let (_, heads, d) = src.dims3()?;
    let row = heads * d;
    let (_, c_heads, c_d) = cache.dims3()?;
    if c_d != d || first_head + heads > c_heads || !cache.is_contiguous() {
        bail!(
            "internal error: cache rows {:?} for new keys {:?} at head {first_head}",
            cache.dims(),
            src.dims()
        )
    }
    let cache_row = c_heads * d;
    let col = first_head * d;
    let src = match src.stride() {
        [_, h_stride, 1] if *h_stride == d || heads == 1 => src.clone(),
        _ => src.contiguous()?,
    };
    let src_stride = src.stride()[0];
    let equally_spaced = writes.len() > 1
        && writes.iter().all(|&(_, n, _)| n == 1)
        && writes.windows(2).all(|w| {
            w[1].0 as isize - w[0].0 as isize == writes[1].0 as isize - writes[0].0 as isize
                && w[1].2 as isize - w[0].2 as isize == writes[1].2 as isize - writes[0].2 as isize
        })
        && writes[1].0 > writes[0].0
        && writes[1].2 > writes[0].2;
    if equally_spaced {
        let (from_step, to_step) = (writes[1].0 - writes[0].0, writes[1].2 - writes[0].2);
        return cache.inplace_op2(
            &src,
            &CopyRows {
                rows: writes.len(),
                row,
                src_stride: src_stride * from_step,
                dst_stride: cache_row * to_step,
                src_offset: writes[0].0 * src_stride,
                dst_offset: writes[0].2 * cache_row + col,
            },
        );
    }
    for &(from, n, to) in writes {
        cache.inplace_op2(
            &src,
            &CopyRows {
                rows: n,
                row,
                src_stride,
                dst_stride: cache_row,
                src_offset: from * src_stride,
                dst_offset: to * cache_row + col,
            },
        )?;
    }
    Ok(())
}

/// `rows` rows of `row` elements from `src` into `dst` (in place), rows `src_stride` and
/// `dst_stride` elements apart, starting `src_offset` / `dst_offset` elements after each
/// tensor's own start: one 2-D copy (candle's `copy2d`, a single launch on the GPU).
struct CopyRows {
    rows: usize,
    row: usize,
    src_stride: usize,
    dst_stride: usize,
    src_offset: usize,
    dst_offset: usize,
}

impl CopyRows {
    /// Absolute element offsets (src, dst), after checking that every row lies inside the
    /// elements each tensor's layout spans.
    fn offsets(&self, dst_l: &Layout, src_l: &Layout) -> Result<(usize, usize)> {
        // One past the last element a layout can address.
        let end = |l: &Layout| {
            l.start_offset()
                + 1
                + l.dims()
                    .iter()
                    .zip(l.stride())
                    .map(|(&n, &s)| n.saturating_sub(1) * s)
                    .sum::<usize>()
        };
        let last = |o: usize, stride: usize| o + (self.rows.max(1) - 1) * stride + self.row;
        let src_o = src_l.start_offset() + self.src_offset;
        let dst_o = dst_l.start_offset() + self.dst_offset;
        if last(src_o, self.src_stride) > end(src_l) {
            bail!("internal error: copying rows past the end of the source")
        }
        if (self.rows > 1 && self.dst_stride < self.row) || last(dst_o, self.dst_stride) > end(dst_l) {
            bail!("internal error: copying rows past the end of the cache")
        }
        Ok((src_o, dst_o))
    }
}

impl InplaceOp2 for CopyRows {
    fn name(&self) -> &'static str {
        "copy-rows"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, src: &CpuStorage, src_l: &Layout) -> Result<()> {
        let (src_o, dst_o) = self.offsets(dst_l, src_l)?;
        src.copy2d(dst, self.rows, self.row, self.src_stride, self.dst_stride, src_o, dst_o)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let (src_o, dst_o) = self.offsets(dst_l, src_l)?;
        src.copy2d(dst, self.rows, self.row, self.src_stride, self.dst_stride, src_o, dst_o)
    }
}
