"""The shared bf16 anchor benchmark (../shared/anchors/anchors_bench.py, given as the first argument)
with a choice of timing, so that its anchors and our Rust benchmark can be compared under one method:

  TIMING_MODE=events     its own method: the median of 20 calls each between two CUDA events and a
                         synchronisation (the PyTorch anchors; FA3 through JAX always times the mean
                         of back-to-back dispatches, its script's `jt`)
  TIMING_MODE=sustained  the mean of back-to-back calls filling ~0.2 s, as
                         crates/flash-attn/benches/gpu_attention.rs times ours by default and
                         scripts/fp8_anchors.py's TIMING_MODE=sustained (`t_sustained` there)

SETTLE_MS=n (sustained) first runs each cell back to back for n ms, so that it is timed at the
GPU's steady state under load (BENCH_SETTLE_MS on ours).

Ours the same ways: BENCH_TIMING=events or unset (sustained) on the gpu_attention binary. The
anchors script's own environment passes through (SEQS, HDIMS, PASSES, IMPLS, OUT); it writes
$OUT/anchors.json (scripts/anchor_table.py reads it), each record with its "timing".
"""
import importlib.util
import json
import os
import sys
import traceback

from fp8_anchors import t_sustained  # the fp8 anchors' sustained timer (SETTLE_MS included)

spec = importlib.util.spec_from_file_location("anchors_bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)  # defines the runners; its __main__ block does not run

mode = os.environ.get("TIMING_MODE", "events")
if mode == "sustained":
    bench.t_events = t_sustained  # the runners look the timer up at call time
elif mode != "events":
    sys.exit(f"anchors_timed: TIMING_MODE must be events or sustained, got {mode!r}")
print(bench.torch.cuda.get_device_name(), bench.torch.__version__, f"timing {mode}", flush=True)
runners = {
    "sdpa_flash": lambda: bench.run_sdpa("sdpa_flash"),
    "sdpa_cudnn": lambda: bench.run_sdpa("sdpa_cudnn"),
    "fa3_torch": bench.run_fa3_torch,
    "fa3_jax": bench.run_fa3_jax,
}
for impl in bench.IMPLS:
    try:
        runners[impl]()
    except Exception:
        print(f"{impl}: SETUP FAILED")
        traceback.print_exc()
for r in bench.results:
    r["timing"] = mode if r["impl"] != "fa3_jax" else "dispatches"
with open(os.path.join(os.environ.get("OUT", "."), "anchors.json"), "w") as f:
    json.dump(bench.results, f, indent=1)
