#!/usr/bin/env python3
"""Counts the SASS instructions on one path through a kernel's main loop.

The forward kernels' loops hold several paths (masked and plain blocks, softcap, the rare
rescale); the one that matters for speed is the steady block's. This walks a loop's body from
its top, falling through every conditional branch except those named in --take, and prints the
instruction mix of the path it walked.

  eval "$(scripts/install-cuda-toolkit.sh ~/.cache/flash-attn3/cuda)"
  nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 kernels/flash_fwd/kernel.cu -o fwd.cubin
  cuobjdump -sass -fun flash_fwd_d64x3_e4m3 fwd.cubin > d64.sass
  scripts/sass_loop_path.py d64.sass --branches        # the loops, and the main one's branches
  scripts/sass_loop_path.py d64.sass --take beb0,c360,11f20 [--show]

A loop is a backward branch whose body holds a GMMA and an exponential (MUFU.EX2); --loop picks
one (0: the first, usually the consumer's main loop). --take lists the addresses (hex, as
cuobjdump prints them) of the conditional branches to follow: for the steady block of the fp8
d64 kernel, the ones that skip O's rescale, prepare_scores and the max's move. --show prints the
path's instructions other than the softmax's arithmetic. (docs/kernels/forward-fp8.md, version 17.)
"""
import argparse
import re
from collections import Counter

BRANCH = re.compile(r"BRA (?:U?!?U?P[0-9T], )?(0x[0-9a-f]+)")


def parse(path):
    ins = []
    for line in open(path):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip().rstrip(";").strip()))
    return ins


def loops(ins, index):
    found = []
    for i, (a, t) in enumerate(ins):
        m = BRANCH.search(t)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < a and target in index:
            body = ins[index[target]:i + 1]
            if any("MUFU.EX2" in x for _, x in body) and any("GMMA" in x for _, x in body) and len(body) > 200:
                found.append((index[target], i))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass", help="cuobjdump -sass output of one kernel")
    ap.add_argument("--loop", type=int, default=0, help="which loop (0: the first)")
    ap.add_argument("--take", default="", help="comma-separated addresses of conditional branches to follow")
    ap.add_argument("--branches", action="store_true", help="list the loop's branches, GMMAs, waits and votes")
    ap.add_argument("--show", action="store_true", help="print the path's instructions but the softmax arithmetic")
    args = ap.parse_args()

    ins = parse(args.sass)
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = loops(ins, index)
    if not found:
        raise SystemExit("no loop with a GMMA and an exponential")
    start, end = found[args.loop]
    if args.branches:
        for s, e in found:
            print(f"loop {ins[s][0]:x}..{ins[e][0]:x}: {e - s + 1} instructions")
        for a, t in ins[start:end + 1]:
            if re.search(r"BRA|GMMA|DEPBAR|VOTE|TRYWAIT|BAR\.", t):
                print(f"{a:x} {t}")
        return

    take = {x.strip().lower() for x in args.take.split(",") if x.strip()}
    path, seen, i = [], set(), start
    first, last = ins[start][0], ins[end][0]
    while i <= end and i not in seen:
        seen.add(i)
        a, t = ins[i]
        path.append((a, t))
        m = BRANCH.search(t)
        if m and (not t.startswith("@") or f"{a:x}" in take):
            target = int(m.group(1), 16)
            if target <= first or target > last:
                break  # the loop's back edge, or a retry outside the body
            i = index[target]
            continue
        i += 1
    mix = Counter(re.sub(r"^@!?U?P[0-9T]+ ", "", t).split()[0].split(".")[0] for _, t in path)
    print(f"{len(path)} instructions on the path (loop {first:x}..{last:x})")
    print(", ".join(f"{k} {v}" for k, v in mix.most_common()))
    if args.show:
        for a, t in path:
            if not re.match(r"(MUFU|FFMA|FADD|FMNMX|F2FP)", t):
                print(f"{a:x} {t}")


if __name__ == "__main__":
    main()
