#!/usr/bin/env python3
"""FP8 (e4m3) attention-forward anchors on a Hopper GPU: timings and the FA3 paper's accuracy test.

Runs ON the GPU machine (Python 3.12, PyTorch 2.11 cu130 with its cuDNN 9.19, no network), with the
wheels of scripts/get-fp8-wheels.sh installed (no compile there):

    scripts/get-fp8-wheels.sh .device/fp8            # here; carry .device
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/fp8/*.whl
    PYTHONPATH=/tmp/site python3 scripts/fp8_anchors.py [--help]

Implementations (env IMPLS, default "fa3_fp8,cudnn_fp8"):
  fa3_fp8    FlashAttention-3's own FP8 forward, wheel fa3-fwd 0.0.3 (the bf16 anchor's wheel, built
             with FLASHATTENTION_DISABLE_FP8=False: its .so holds e4m3 FlashAttnFwdSm90 kernels for
             head dims 64/96/128/192/256; flash_attn_func takes q/k/v_descale, float32 of shape
             (batch, heads_k); e4m3 in, bf16 out).
  cudnn_fp8  cuDNN's FP8 SDPA (pygraph.sdpa_fp8) through nvidia-cudnn-frontend 1.18.0, run on the
             cuDNN that torch loads (nvidia-cudnn-cu13). Per-tensor descales (1,1,1,1). On sm90 the
             output must be e4m3 (the frontend allows bf16/fp16 output only on sm100+, cuDNN >= 9.13),
             so its O is e4m3 with a scale_o; the timing writes e4m3 O, the accuracy test dequantises it.
Not anchors, and why (checked when this script was written):
  * torch.nn.functional.scaled_dot_product_attention has no fp8 kernel of its own; torch 2.11's
    experimental _scaled_dot_product_attention_quantized needs an FA3 module registered as
    torch.ops.flash_attn_3 with fwd and bwd (fa3-fwd registers torch.ops.fa3_fwd, forward only).
    PROBE=1 (default) tries both on a tiny input and prints one NOTE line each.
  * flash-attn3-jax 0.2.3: its .so has e4m3 kernels, but the Python API asserts bf16/fp16 and always
    passes empty descales. dew-flash-attn-cu13: no fp8 (its README). FlashAttention-4
    (flash-attn-4): CuTe-DSL JIT, needs nvidia-cutlass-dsl (far over the carry budget).

Timing (TIMING=1, default): the grid of ../shared/anchors/anchors_bench.py (16k tokens, hidden 2048,
heads = 2048/d, head dims HDIMS (64,128,256), seqlens SEQS (512..16384), CAUSAL "0,1" (default: unmasked
then causal; "0" or "1" for one), forward
only, e4m3 inputs with every descale 1.0, CUDA events, median of 20 after 5 warmup; lines in
anchors_bench.py's format (impl names fa3_fp8, cudnn_fp8; FLOPs 4*b*h*s*s*d, halved when causal).
TIMING_MODE=sustained times as our Rust benchmark does by default instead (the mean of back-to-back
calls filling ~0.2 s): compare ours and the anchors under one method (docs/benchmarks.md; the
GPU idles between event-timed calls, so each call's host work counts and the clocks sit higher).

Accuracy (ACCURACY=1, default; runs first): the FA3 paper's protocol: batch 2, seqlen 4096, 16
heads, head dim 128, no mask, softmax scale 1/sqrt(128); entries N(0,1) + N(0,100)*Bernoulli(0.001)
(outliers of std 10), torch.manual_seed(ACC_SEED=0), drawn on the CPU (the same values on any GPU).
Writes to ACC_DIR (default /tmp/fp8_acc), all raw little-endian, row-major (batch, seq, heads, dim):
  q.f32 k.f32 v.f32     the inputs (float32)
  ref.f32               O of exact attention, computed in float64 on the GPU, stored as float32
  q.e4m3 k.e4m3 v.e4m3  the per-tensor quantisation below (1 byte each, torch's float8_e4m3fn)
  meta.json             shape, layout, scale, seed, descales, and the RMSEs printed below
Per-tensor quantisation: descale = amax(|x|)/448, x8 = clamp(x/descale, +-448).to(float8_e4m3fn).
Prints, each the RMSE over all elements against the float64 O:
  ACC torch_bf16 rmse=...               torch SDPA on bf16 inputs (the bf16 baseline)
  ACC fp8_naive_torch rmse=...          torch emulation of an fp8 kernel without block quantisation
  ACC fa3_fp8 per-tensor rmse=...       (and per-head, per-head+hadamard: see run_accuracy)
  ACC cudnn_fp8 per-tensor rmse=...     the best of a few scale_s choices (all listed with '#')

The host-side half of this (inputs, float64 reference, quantisation, the naive emulation, the
files) was run on a CPU with torch 2.11.0+cu130: torch_bf16 rmse=1.234e-03, fp8_naive_torch
rmse=1.948e-02 at the default shape and seed; the GPU should print about the same two numbers.

Env: SEQS, HDIMS, IMPLS, TIMING, TIMING_MODE (events|sustained), SETTLE_MS (sustained: run each cell
back to back this many ms before timing it, to its steady state under load), ACCURACY, PROBE, ACC_DIR, ACC_SEED, ACC_SHAPE (b,s,h,d; default
2,4096,16,128, the paper's), ACC_HEAD_CHUNK (heads per float64 chunk, default 4), P_SCALE (the
naive emulation's scale of P before the e4m3 cast, default 256 = FA3's), CUDNN_FP8_OUT
(auto|e4m3|bf16), OUT (also write $OUT/fp8_anchors.json).
"""
import ctypes
import json
import math
import os
import sys
import time
import traceback

if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)
    sys.exit(0)

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    sys.exit("fp8_anchors.py: PyTorch not found (this script runs on the GPU machine)")

SEQS = [int(s) for s in os.environ.get("SEQS", "512,1024,2048,4096,8192,16384").split(",")]
HDIMS = [int(s) for s in os.environ.get("HDIMS", "64,128,256").split(",")]
CAUSAL = [c != "0" for c in os.environ.get("CAUSAL", "0,1").split(",")]  # as BENCH_CAUSAL: "0", "1" or both
IMPLS = [s for s in os.environ.get("IMPLS", "fa3_fp8,cudnn_fp8").split(",") if s]
TIMING = os.environ.get("TIMING", "1") != "0"
TIMING_MODE = os.environ.get("TIMING_MODE", "events")  # or "sustained" (t_sustained)
SETTLE_MS = float(os.environ.get("SETTLE_MS", "0"))  # sustained: each cell back to back this long first
ACCURACY = os.environ.get("ACCURACY", "1") != "0"
PROBE = os.environ.get("PROBE", "1") != "0"
ACC_DIR = os.environ.get("ACC_DIR", "/tmp/fp8_acc")
ACC_SEED = int(os.environ.get("ACC_SEED", "0"))
ACC_HEAD_CHUNK = int(os.environ.get("ACC_HEAD_CHUNK", "4"))
ACC_SHAPE = [int(x) for x in os.environ.get("ACC_SHAPE", "2,4096,16,128").split(",")]  # b,s,h,d
P_SCALE = float(os.environ.get("P_SCALE", "256"))
CUDNN_FP8_OUT = os.environ.get("CUDNN_FP8_OUT", "auto")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DEV = "cuda"
results = []


# ---------------------------------------------------------------- timing (as anchors_bench.py)

def flops(b, h, s, d, causal, mode):
    f = 4 * b * h * s * s * d
    if causal: f /= 2
    return f * (2.5 if mode == "bwd" else 1.0)


def t_events(fn, iters=20, warmup=5):
    if TIMING_MODE == "sustained":
        return t_sustained(fn)
    for _ in range(warmup): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort(); return times[len(times)//2] / 1e3


def t_sustained(fn):
    """TIMING_MODE=sustained: the mean over back-to-back calls filling ~0.2 s, as the Rust
    benchmark times ours by default (crates/flash-attn/benches/gpu_attention.rs `time_sustained`)."""
    for _ in range(3): fn()
    torch.cuda.synchronize()
    settle_end = time.perf_counter() + SETTLE_MS / 1e3  # SETTLE_MS: run back to back first
    while time.perf_counter() < settle_end:
        for _ in range(4): fn()
        torch.cuda.synchronize()
    t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = min(200, max(5, int(0.2 / max(one, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def shapes():
    for d in HDIMS:
        h = 2048 // d
        for s in SEQS:
            b = max(1, 16384 // s)
            for causal in CAUSAL:
                yield b, s, h, d, causal


def record(impl, mode, b, s, h, d, causal, sec):
    tf = flops(b, h, s, d, causal, mode) / sec / 1e12
    results.append(dict(impl=impl, mode=mode, b=b, s=s, h=h, d=d, causal=causal, ms=sec*1e3, tflops=tf))
    print(f"{impl:12s} {mode} d={d:3d} causal={int(causal)} s={s:5d} b={b:2d} h={h:2d}: {sec*1e3:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)


def fail_line(impl, what, ex):
    print(f"{impl} {what}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)


# ---------------------------------------------------------------- FA3 (fa3-fwd)

def fa3_import():
    try:
        from fa3_fwd_interface import flash_attn_func
    except ImportError as ex:
        raise RuntimeError("fa3-fwd is not installed (scripts/get-fp8-wheels.sh DIR; pip install --no-index "
                           f"--no-deps --target /tmp/site DIR/*.whl; PYTHONPATH=/tmp/site): {ex}") from ex
    return flash_attn_func


def fa3_call(flash_attn_func, q8, k8, v8, dq, dk, dv, causal, scale=None):
    """q8/k8/v8: e4m3 (b, s, h, d); dq/dk/dv: float32 (b, heads_k). Returns bf16 (b, s, h, d)."""
    return flash_attn_func(q8, k8, v8, softmax_scale=scale, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv)


def run_fa3_timing():
    flash_attn_func = fa3_import()
    for b, s, h, d, causal in shapes():
        try:
            q8, k8, v8 = [torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16).to(FP8) for _ in range(3)]
            ones = torch.ones(b, h, device=DEV, dtype=torch.float32)
            o = fa3_call(flash_attn_func, q8, k8, v8, ones, ones, ones, causal)
            assert o.dtype == torch.bfloat16 and o.shape == (b, s, h, d), (o.dtype, tuple(o.shape))
            record("fa3_fp8", "fwd", b, s, h, d, causal,
                   t_events(lambda: fa3_call(flash_attn_func, q8, k8, v8, ones, ones, ones, causal)))
        except Exception as ex:
            fail_line("fa3_fp8", f"d={d} s={s} causal={int(causal)}", ex)


# ---------------------------------------------------------------- cuDNN (nvidia-cudnn-frontend)

def _loaded_libcudnn():
    """Path of the libcudnn.so.9 this process has mapped (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libcudnn.so"):
                    return path
    except OSError:
        pass
    return None


class CudnnFp8:
    """cuDNN FP8 SDPA forward graphs on torch's cuDNN and torch's current stream."""

    def __init__(self):
        # Make torch load its cuDNN first, then point the frontend at that very library (the
        # frontend otherwise globs sysconfig's purelib, which may hold another copy or none).
        torch_cudnn = torch.backends.cudnn.version()
        lib_path = _loaded_libcudnn()
        lib = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL) if lib_path else None
        try:
            import cudnn
        except ImportError as ex:
            raise RuntimeError("nvidia-cudnn-frontend is not installed (scripts/get-fp8-wheels.sh DIR; pip install "
                               f"--no-index --no-deps --target /tmp/site DIR/*.whl; PYTHONPATH=/tmp/site): {ex}") from ex
        if lib is not None:
            cudnn._pybind_module._set_dlhandle_cudnn(ctypes.cast(lib._handle, ctypes.c_void_p).value)
        self.cudnn = cudnn
        print(f"# cudnn_fp8: frontend {cudnn.__version__}, backend {cudnn.backend_version_string()}, "
              f"torch's cuDNN {torch_cudnn} ({lib_path or 'path not found'})", flush=True)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        major = torch.cuda.get_device_capability()[0]
        want = CUDNN_FP8_OUT if CUDNN_FP8_OUT != "auto" else ("bf16" if major >= 10 else "e4m3")
        self.out_torch = torch.bfloat16 if want == "bf16" else FP8
        self.out_cudnn = cudnn.data_type.BFLOAT16 if want == "bf16" else cudnn.data_type.FP8_E4M3
        self.out_name = want

    def runner(self, q8, k8, v8, causal, scale):
        """Builds the graph for e4m3 (b, s, h, d) q8/k8/v8. Returns (run, o, sc, amax): run() executes;
        o is the output buffer (b, s, h, d); sc maps descale_q/k/v, descale_s, scale_s, scale_o to
        float32 (1,1,1,1) device tensors (set them before run); amax holds amax_s and amax_o."""
        cd = self.cudnn
        b, s, h, d = q8.shape
        dims, strides = [b, h, s, d], [s * h * d, d, h * d, 1]  # (b, s, h, d) memory seen as (b, h, s, d)
        g = cd.pygraph(io_data_type=cd.data_type.FP8_E4M3, intermediate_data_type=cd.data_type.FLOAT,
                       compute_data_type=cd.data_type.FLOAT, handle=self.handle)
        tq, tk, tv = [g.tensor(name=n, dim=dims, stride=strides, data_type=cd.data_type.FP8_E4M3) for n in "qkv"]
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        ts = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cd.data_type.FLOAT) for n in names}
        to, _, tamax_s, tamax_o = g.sdpa_fp8(
            q=tq, k=tk, v=tv, descale_q=ts["descale_q"], descale_k=ts["descale_k"], descale_v=ts["descale_v"],
            descale_s=ts["descale_s"], scale_s=ts["scale_s"], scale_o=ts["scale_o"],
            generate_stats=False, attn_scale=scale, use_causal_mask=causal, name="sdpa_fp8")
        to.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.out_cudnn)
        for t in (tamax_s, tamax_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cd.data_type.FLOAT)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cd.heur_mode.A, cd.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        ws = torch.empty(max(1, g.get_workspace_size()), device=DEV, dtype=torch.uint8)
        o = torch.empty(b, s, h, d, device=DEV, dtype=self.out_torch)
        sc = {n: torch.ones(1, 1, 1, 1, device=DEV, dtype=torch.float32) for n in names}
        amax = {n: torch.zeros(1, 1, 1, 1, device=DEV, dtype=torch.float32) for n in ("amax_s", "amax_o")}
        pack = {tq: q8, tk: k8, tv: v8, to: o, tamax_s: amax["amax_s"], tamax_o: amax["amax_o"]}
        pack.update({ts[n]: sc[n] for n in names})
        uid_ptr = {t.get_uid(): x.data_ptr() for t, x in pack.items()}
        keep = (g, pack, ws)  # the graph and every buffer live as long as run does
        handle = self.handle

        def run():
            keep[0]._execute(uid_ptr, ws.data_ptr(), handle)

        return run, o, sc, amax


def run_cudnn_timing():
    if torch.cuda.get_device_capability()[0] < 9:
        raise RuntimeError("cuDNN FP8 SDPA needs sm90 or newer")
    c = CudnnFp8()
    print(f"# cudnn_fp8: output {c.out_name}; every descale/scale 1.0", flush=True)
    for b, s, h, d, causal in shapes():
        try:
            q8, k8, v8 = [torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16).to(FP8) for _ in range(3)]
            run, o, sc, amax = c.runner(q8, k8, v8, causal, 1.0 / math.sqrt(d))
            record("cudnn_fp8", "fwd", b, s, h, d, causal, t_events(run))
            del run, o
        except Exception as ex:
            fail_line("cudnn_fp8", f"d={d} s={s} causal={int(causal)}", ex)


# ---------------------------------------------------------------- probe of torch's own SDPA

def probe_torch_sdpa():
    q = torch.randn(1, 2, 128, 64, device=DEV).to(FP8)
    try:
        o = F.scaled_dot_product_attention(q, q, q)
        print(f"NOTE torch sdpa: fp8 inputs accepted (output {o.dtype}): check this", flush=True)
    except Exception as ex:
        print(f"NOTE torch sdpa: fp8 inputs unsupported ({type(ex).__name__}: {str(ex).splitlines()[0][:160]})", flush=True)
    try:
        from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
            _scaled_dot_product_attention_quantized as sdpa_q)
    except Exception as ex:
        print(f"NOTE torch _scaled_dot_product_attention_quantized: not importable ({type(ex).__name__})", flush=True)
        return
    try:
        ds = torch.ones(1, 2, device=DEV, dtype=torch.float32)
        o = sdpa_q(q, q, q, q_descale=ds, k_descale=ds, v_descale=ds)
        print(f"NOTE torch _scaled_dot_product_attention_quantized: works without FA3 registered (output {o.dtype})", flush=True)
    except Exception as ex:
        print(f"NOTE torch _scaled_dot_product_attention_quantized: unusable here ({type(ex).__name__}: "
              f"{str(ex).splitlines()[0][:160] if str(ex) else ''})", flush=True)


# ---------------------------------------------------------------- accuracy (FA3 paper protocol)

def write_raw(path, t):
    """Raw little-endian bytes of t, row-major."""
    assert sys.byteorder == "little"
    t = t.detach().contiguous().cpu()
    if t.dtype == FP8:
        t = t.view(torch.uint8)
    with open(path, "wb") as f:
        f.write(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))


def make_inputs(b, s, h, d, seed):
    """N(0,1) + N(0,100)*Bernoulli(0.001), float32 on the CPU, (b, s, h, d), for q, k, v in turn."""
    torch.manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(b, s, h, d, dtype=torch.float32)
        outlier = torch.randn(b, s, h, d, dtype=torch.float32) * 10.0
        mask = torch.rand(b, s, h, d, dtype=torch.float32) < 0.001
        out.append(x + outlier * mask)
    return out


def reference(q, k, v, scale, hc):
    """Exact attention in float64 on the GPU, chunked over (batch, hc heads). q/k/v float32 (b, s, h, d).
    Returns O float64 (b, s, h, d) and max softmax probability (the amax of P)."""
    b, s, h, d = q.shape
    o = torch.empty(b, s, h, d, device=DEV, dtype=torch.float64)
    pmax = 0.0
    for bi in range(b):
        for h0 in range(0, h, hc):
            qq, kk, vv = [x[bi, :, h0:h0 + hc].transpose(0, 1).double() for x in (q, k, v)]  # (hc, s, d)
            p = torch.softmax(torch.matmul(qq, kk.transpose(1, 2)) * scale, dim=-1)
            pmax = max(pmax, p.max().item())
            o[bi, :, h0:h0 + hc] = torch.matmul(p, vv).transpose(0, 1)
            del p
    return o, pmax


def quantize(x, per):
    """x float32 (b, s, h, d) on the GPU -> (e4m3 tensor, descale float32 (b, h)).
    per='tensor': one scale (descale = amax/448); per='head': one per (batch, head)."""
    b, s, h, d = x.shape
    if per == "tensor":
        amax = x.abs().amax().reshape(1, 1).expand(b, h)
    else:
        amax = x.abs().amax(dim=(1, 3))
    descale = (amax / FP8_MAX).clamp_min(1e-12).contiguous().float()
    x8 = (x / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, descale


def dequant(x8, descale):
    return x8.float() * descale[:, None, :, None]


def naive_fp8(q8, k8, v8, dq, dk, dv, scale, hc):
    """An fp8 attention without block quantisation, emulated in torch: the dequantised per-tensor fp8
    inputs (exact in float32), S = Q K^T in float32, then P = exp(S*scale - rowmax) scaled by P_SCALE
    (FA3's fp8 path scales P by 2^8 so its row max is 256 before the e4m3 cast) and rounded to e4m3
    after the softmax's exponent, O = (P_e4m3 V) / rowsum, the row sum from the unrounded P (as a
    kernel accumulates it in float32). No online-softmax blocking: one exact row max."""
    q, k, v = dequant(q8, dq), dequant(k8, dk), dequant(v8, dv)
    b, s, h, d = q.shape
    o = torch.empty(b, s, h, d, device=DEV, dtype=torch.float32)
    for bi in range(b):
        for h0 in range(0, h, hc):
            qq, kk, vv = [x[bi, :, h0:h0 + hc].transpose(0, 1) for x in (q, k, v)]
            sc = torch.matmul(qq, kk.transpose(1, 2)) * scale
            p = torch.exp(sc - sc.amax(dim=-1, keepdim=True)) * P_SCALE
            l = p.sum(dim=-1, keepdim=True)
            p8 = p.to(FP8).float()
            o[bi, :, h0:h0 + hc] = (torch.matmul(p8, vv) / l).transpose(0, 1)
            del sc, p, p8
    return o


def hadamard_rotation(d, seed):
    """Incoherent processing (FA3 paper): M = diag(random +-1) H / sqrt(d), orthogonal, so
    (Q M)(K M)^T = Q K^T while outliers are spread over the head dimension."""
    assert d & (d - 1) == 0, "head dim must be a power of two"
    hm = torch.ones(1, 1, dtype=torch.float64)
    while hm.shape[0] < d:
        hm = torch.cat([torch.cat([hm, hm], 1), torch.cat([hm, -hm], 1)], 0)
    g = torch.Generator().manual_seed(seed + 1)
    signs = torch.randint(0, 2, (d,), generator=g).double() * 2 - 1
    return (signs[:, None] * hm / math.sqrt(d)).float().to(DEV)


def rmse(o, ref):
    return ((o.double() - ref) ** 2).mean().sqrt().item()


def run_accuracy():
    b, s, h, d = ACC_SHAPE
    scale = 1.0 / math.sqrt(d)
    os.makedirs(ACC_DIR, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    q, k, v = make_inputs(b, s, h, d, ACC_SEED)
    for name, x in zip("qkv", (q, k, v)):
        write_raw(os.path.join(ACC_DIR, f"{name}.f32"), x)
    q, k, v = q.to(DEV), k.to(DEV), v.to(DEV)
    ref, pmax = reference(q, k, v, scale, ACC_HEAD_CHUNK)
    write_raw(os.path.join(ACC_DIR, "ref.f32"), ref.float())
    o_amax = ref.abs().max().item()
    (q8, dq), (k8, dk), (v8, dv) = [quantize(x, "tensor") for x in (q, k, v)]
    for name, x8 in zip("qkv", (q8, k8, v8)):
        write_raw(os.path.join(ACC_DIR, f"{name}.e4m3"), x8)
    meta = dict(
        shape=[b, s, h, d], layout="row-major (batch, seq, heads, head_dim), little-endian",
        files=dict(q="q.f32", k="k.f32", v="v.f32", ref="ref.f32", q8="q.e4m3", k8="k.e4m3", v8="v.e4m3"),
        dtype_f32="float32", dtype_e4m3="float8_e4m3fn (OCP e4m3, bias 7, max 448, no inf)",
        causal=False, softmax_scale=scale, seed=ACC_SEED,
        inputs="N(0,1) + N(0,100)*Bernoulli(0.001), torch.manual_seed(seed), CPU, q then k then v "
               "(per tensor: randn, randn*10, rand<0.001)",
        ref="float64 attention on the GPU, stored as float32",
        quantization="per-tensor: descale = amax/448, x8 = clamp(x/descale, +-448).to(float8_e4m3fn)",
        descale=dict(q=dq[0, 0].item(), k=dk[0, 0].item(), v=dv[0, 0].item()),
        ref_amax_p=pmax, ref_amax_o=o_amax, rmse={})

    def report(key, label, fn):
        try:
            r = rmse(fn(), ref)
            meta["rmse"][key] = r
            print(f"ACC {label} rmse={r:.3e}", flush=True)
        except Exception as ex:
            print(f"ACC {label} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)

    def torch_bf16():
        qb, kb, vb = [x.to(torch.bfloat16).transpose(1, 2) for x in (q, k, v)]
        return F.scaled_dot_product_attention(qb, kb, vb, scale=scale).transpose(1, 2)

    print(f"# accuracy: b={b} s={s} h={h} d={d} no mask, seed {ACC_SEED}; files in {ACC_DIR}; "
          f"descale q/k/v {meta['descale']['q']:.4g}/{meta['descale']['k']:.4g}/{meta['descale']['v']:.4g}; "
          f"amax(P) {pmax:.4g}, amax(O) {o_amax:.4g}", flush=True)
    report("torch_bf16", "torch_bf16", torch_bf16)
    report("fp8_naive_torch", "fp8_naive_torch", lambda: naive_fp8(q8, k8, v8, dq, dk, dv, scale, ACC_HEAD_CHUNK))

    if "fa3_fp8" in IMPLS:
        try:
            fa = fa3_import()
            report("fa3_fp8 per-tensor", "fa3_fp8 per-tensor", lambda: fa3_call(fa, q8, k8, v8, dq, dk, dv, False, scale))
            # FA3's descales are per (batch, head): the finest granularity its API has (the paper's
            # block quantisation is finer), then with the paper's incoherent processing on top.
            (qh, dqh), (kh, dkh), (vh, dvh) = [quantize(x, "head") for x in (q, k, v)]
            report("fa3_fp8 per-head", "fa3_fp8 per-head", lambda: fa3_call(fa, qh, kh, vh, dqh, dkh, dvh, False, scale))
            m = hadamard_rotation(d, ACC_SEED)
            (qr, dqr), (kr, dkr) = quantize(q @ m, "head"), quantize(k @ m, "head")
            report("fa3_fp8 per-head+hadamard", "fa3_fp8 per-head+hadamard",
                   lambda: fa3_call(fa, qr, kr, vh, dqr, dkr, dvh, False, scale))
        except Exception as ex:
            print(f"ACC fa3_fp8 FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)

    if "cudnn_fp8" in IMPLS:
        try:
            c = CudnnFp8()
            run, o, sc, amax = c.runner(q8, k8, v8, False, scale)
            for n, x in (("descale_q", dq), ("descale_k", dk), ("descale_v", dv)):
                sc[n].fill_(x[0, 0].item())
            # O: e4m3 on sm90, scaled by scale_o = 448/amax(O) (amax from the reference: the best case).
            s_o = FP8_MAX / o_amax if c.out_torch == FP8 else 1.0
            sc["scale_o"].fill_(s_o)
            # P's scale: cuDNN's tests use 448/amax(P) (normalised P), FA3 uses 256 on exp(S - max);
            # try both and 1, keep the best.
            best = None
            for s_s in (FP8_MAX / pmax, 256.0, 1.0):
                sc["scale_s"].fill_(s_s)
                sc["descale_s"].fill_(1.0 / s_s)
                run()
                torch.cuda.synchronize()
                r = rmse(o.float() / s_o, ref)
                print(f"#   cudnn_fp8 per-tensor scale_s={s_s:.4g} scale_o={s_o:.4g} (O {c.out_name}): rmse={r:.3e} "
                      f"amax_s={amax['amax_s'].item():.4g} amax_o={amax['amax_o'].item():.4g}", flush=True)
                if not math.isnan(r) and (best is None or r < best[0]):
                    best = (r, s_s)
            if best is None:
                raise RuntimeError("every scale_s gave NaN")
            meta["rmse"]["cudnn_fp8 per-tensor"] = best[0]
            meta["cudnn_fp8"] = dict(scale_s=best[1], scale_o=s_o, output=c.out_name)
            print(f"ACC cudnn_fp8 per-tensor rmse={best[0]:.3e}", flush=True)
        except Exception as ex:
            print(f"ACC cudnn_fp8 per-tensor FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)

    with open(os.path.join(ACC_DIR, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("fp8_anchors.py: no CUDA device")
    print(torch.cuda.get_device_name(), torch.__version__, f"cuda {torch.version.cuda}",
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    unknown = [i for i in IMPLS if i not in ("fa3_fp8", "cudnn_fp8")]
    if unknown:
        sys.exit(f"fp8_anchors.py: unknown IMPLS {unknown} (known: fa3_fp8, cudnn_fp8)")
    if PROBE:
        try:
            probe_torch_sdpa()
        except Exception:
            print("NOTE torch sdpa probe: SETUP FAILED"); traceback.print_exc()
    acc = None
    if ACCURACY:
        try:
            acc = run_accuracy()
        except Exception:
            print("ACC: SETUP FAILED"); traceback.print_exc()
        torch.cuda.empty_cache()
    if TIMING:
        for impl in IMPLS:
            try:
                {"fa3_fp8": run_fa3_timing, "cudnn_fp8": run_cudnn_timing}[impl]()
            except Exception:
                print(f"{impl}: SETUP FAILED"); traceback.print_exc()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_anchors.json"), "w") as f:
            json.dump(dict(timings=results, accuracy=acc["rmse"] if acc else None), f, indent=1)
