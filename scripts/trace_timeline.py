#!/usr/bin/env python3
"""Summarises the forward kernel's timeline (a bench run built with FA3_NVCC_FLAGS=-DFA3_TRACE).

usage: trace_timeline.py [--serial [--warps]] LOG
The log holds, per launch, CTA 0's "FA3T wg iter t0..t7" lines (kernels/primitives/trace.cuh);
the last launch before each "ours" bench line is summarised under that line.
Consumer points (mainloop.cuh, pingpong loop): 0 loop top, 1 K landed, 2 own turn (barrier),
3 S and P·V issued + turn handed on, 4 S retired (wait<1>), 5 softmax done, 6 P·V retired
(wait<0>), 7 P converted / O rescaled. (The serial loop, consumer_serial, fp8 d128 on 256 keys,
stamps other points: 0 loop top, 1 K landed, 2 S retired, 3 max done, 4 turn taken, 5 exponentials
and P done, turn handed on, 6 P·V issued, 7 P·V retired: --serial names those; --warps reads a
build with FA3_NVCC_FLAGS="-DFA3_TRACE -DFA3_TRACE_WARPS", where every warp stamps.) Producer (wg 0): 0/1 K slot wait start/end, 2/3 V's.
Tiles ("FA3E wg tile t0..t7", by the CTA's tile count): consumers 0 tile start, 1 Q landed,
2 first S retired, 3 first softmax done (loop entry), 4 loop exit, 5 tail P·V retired, 6 epilogue
done, 7 (session 63) the next tile's slot wait passed (inside its receive: FA3F 7 -> FA3E 7 the
wait, FA3E 7 -> FA3F 6 the copy); their detail ("FA3F"): 0 epilogue entry, 1 staging free, 2 staged, 3 fenced (fp8 d256's two
passes: 2 and 3 the first pass's; 3 to 4 then the first half's stores read, the second staged), 4 store
recorded (its TMA issue follows under the next tile's first S; before session 60's version 34 the
issue itself), 5 epilogue done (LSE included), 7 the next tile's receive starts (the wait for the
scheduler thread's slot; until session 63: its validity checked, after 6), 6 next tile received
(since version 35 its fields copied from the scheduler thread's slot, decoded there);
producer (wg 0) 0 tile start, 1 Q issued, 2 first K issued, 3 last V issued, 4 / 5 before /
after the wait for a V^T pair the kernel writes (fp8 calls with fp8_vt_fill.cuh's writer, whose
units are "FA3W" lines: summarise_writer).
"""
import collections
import statistics
import sys

CONSUMER = ["K wait", "turn wait", "issue", "S wait", "softmax", "PV wait", "convert", "to next top"]
# consumer_serial's points: the segments, the point a period is measured from, and the turn's
# hand-over (this warpgroup's point 5 to the next one's point 4).
SERIAL = ["K wait", "S issue+wait", "max", "turn wait", "turn", "last P·V issue", "P·V wait", "to next top"]
LAYOUT = {"names": CONSUMER, "period_from": 2, "handed_on": 3, "taken": 2}


def gather(records, keep):
    """{warpgroup: {iteration or tile: stamps}} of the records that `keep` accepts, and the
    earliest first stamp (the origin of the absolute timelines printed)."""
    rows = collections.defaultdict(dict)
    for wg, idx, *t in records:
        if keep(t):
            rows[wg][idx] = t
    base = min((t[0] for wg in rows for t in rows[wg].values() if t[0]), default=0)
    return rows, base


def segment_line(stamps):
    """One row's (warpgroup's or warp's) median period and segments over consecutive iterations
    ({iteration: stamps}), or None when no two consecutive iterations are complete."""
    its = sorted(stamps)
    seg = collections.defaultdict(list)
    period = []
    names, at = LAYOUT["names"], LAYOUT["period_from"]
    for a, b in zip(its, its[1:]):
        t, u = stamps[a], stamps[b]
        if b != a + 1 or not all(t) or not u[0]:
            continue
        for k in range(7):
            seg[names[k]].append(t[k + 1] - t[k])
        seg[names[7]].append(u[0] - t[7])
        period.append(u[at] - t[at])
    if not period:
        return None
    parts = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in seg.items())
    return f"period median {statistics.median(period):.0f} cycles; {parts}"


def summarise(launch):
    # The buffer has room for 4 warpgroups; a kernel with fewer leaves zeros.
    rows, base = gather(launch, any)
    out = []
    for wg in sorted(rows):
        its = sorted(rows[wg])
        if wg == 0:
            kw = [rows[0][i][1] - rows[0][i][0] for i in its]
            vw = [rows[0][i][3] - rows[0][i][2] for i in its]
            out.append(f"  producer: K slot wait median {statistics.median(kw):.0f}, V slot wait median {statistics.median(vw):.0f} cycles")
            continue
        line = segment_line(rows[wg])
        if line:
            out.append(f"  wg {wg}: {line}")
    # Hand-over: from one warpgroup's issue end (3; serial: 5) to the next warpgroup's turn (2;
    # serial: 4): same iteration, or the next one where the ring wraps back to the first.
    wgs = sorted(w for w in rows if w > 0)
    off, on = LAYOUT["handed_on"], LAYOUT["taken"]
    for a, b in zip(wgs, wgs[1:] + wgs[:1]):
        step = 1 if b == wgs[0] else 0
        d = [rows[b][i + step][on] - t[off] for i, t in rows[a].items() if i + step in rows[b] and t[off] and rows[b][i + step][on]]
        if d:
            out.append(f"  wg {a} hands on -> wg {b} takes its turn: median {statistics.median(d):.0f} cycles")
    # A few iterations as an absolute timeline.
    for i in sorted(rows[wgs[0]])[8:11]:
        for wg in wgs:
            if i in rows[wg]:
                out.append(f"  it {i} wg {wg}: " + " ".join(f"{x - base:>7}" for x in rows[wg][i]))
    return out


EDGE = ["Q wait", "first S", "first softmax", "loop", "tail P·V", "epilogue"]


def summarise_edges(edges):
    rows, base = gather(edges, lambda t: t[0])
    if not rows:
        return []
    out = []
    for wg in sorted(w for w in rows if w > 0):
        seg = collections.defaultdict(list)
        for tile, t in rows[wg].items():
            if not all(t[:7]):
                continue
            for k in range(6):
                seg[EDGE[k]].append(t[k + 1] - t[k])
            u = rows[wg].get(tile + 1)
            if u and all(u[:4]):
                seg["to next tile"].append(u[0] - t[6])
                seg["loop exit -> next loop entry"].append(u[3] - t[4])
        out.append(f"  tiles wg {wg}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in seg.items()))
    waits = [t[5] - t[4] for t in rows.get(0, {}).values() if t[4] and t[5]]
    if waits:
        out.append(f"  TMA thread, wait for a V^T pair written by the kernel (fp8_vt_fill.cuh): median {statistics.median(waits):.0f}, max {max(waits)}")
    for tile in sorted(rows[min(rows)])[:4]:
        for wg in sorted(rows):
            if tile in rows[wg]:
                out.append(f"  tile {tile} wg {wg}: " + " ".join(f"{x - base:>8}" if x else "       -" for x in rows[wg][tile][:7]))
    return out


WRITER = ["V rows landed", "transposed", "store and next load issued", "store performed", "published"]


def summarise_writer(units):
    """The fp8 V^T writer warp ("FA3W 0 unit t0..t7", fp8_vt_fill.cuh): per unit 0 loop top
    (claim of the next unit sent), 1 its V rows landed, 2 transposed, 3 its TMA store and the next
    unit's load issued, 4 the store's writes performed, 5 published; the medians of the segments
    and of the period between units."""
    rows, _ = gather(units, lambda t: t[0])
    seg = collections.defaultdict(list)
    for unit, t in rows.get(0, {}).items():
        if not all(t[:6]):
            continue
        for k in range(5):
            seg[WRITER[k]].append(t[k + 1] - t[k])
        u = rows[0].get(unit + 1)
        if u and u[0]:
            seg["unit period"].append(u[0] - t[0])
    return ["  V^T writer: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in seg.items())] if seg else []


# FA3F points in time order (point 7, the receive's start, comes before point 6, its end).
FINE = [(1, "staging free"), (2, "staged"), (3, "fenced"), (4, "store recorded"), (5, "LSE stored"),
        (7, "to the receive"), (6, "next received")]


def summarise_fine(fine):
    """The boundary's detail ("FA3F wg tile t0..t7"): per warpgroup the median of each step from
    the epilogue's entry to the next tile received (a step that a path skips reads 0: left out)."""
    rows, _ = gather(fine, lambda t: t[0])
    out = []
    for wg in sorted(w for w in rows if w > 0):
        seg = collections.defaultdict(list)
        for t in rows[wg].values():
            last = t[0]
            for k, name in FINE:
                if t[k]:
                    seg[name].append(t[k] - last)
                    last = t[k]
        out.append(f"  boundary wg {wg}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in seg.items()))
    return out


def summarise_warps(records):
    """consumer_serial traced with FA3_TRACE_WARPS (every warp stamps, as row wg + 4·warp): per
    warp its segments, and per warpgroup how long its turn starts after it could have, i.e. after
    both its last warp finished the max and the other warpgroup's last warp handed the turn on."""
    rows, _ = gather(records, lambda t: t[0] > 0)
    out = []
    for wg in (1, 2):
        for k in range(4):
            line = segment_line(rows.get(wg + 4 * k, {}))
            if line:
                out.append(f"  wg {wg} warp {k}: {line}")
    for wg, other in ((1, 2), (2, 1)):
        late, skew = [], []
        for it in rows.get(wg, {}):
            mine = [rows[wg + 4 * k].get(it) for k in range(4)]
            theirs = [rows[other + 4 * k].get(it if wg == 2 else it - 1) for k in range(4)]
            if not all(mine) or not all(theirs):
                continue
            ready = max(max(t[3] for t in mine), max(t[5] for t in theirs))
            late.append(min(t[4] for t in mine) - ready)
            skew.append(max(t[3] for t in mine) - min(t[3] for t in mine))
        if late:
            out.append(f"  wg {wg}: turn taken {statistics.median(late):.0f} cycles after it could be "
                       f"(its last warp's max done and wg {other}'s last hand-on); max done spread "
                       f"over its warps {statistics.median(skew):.0f}")
    return out


def main():
    # Per tag, the latest launch's records: a new launch starts where (warpgroup, index) goes back.
    summaries = {"FA3T": summarise, "FA3E": summarise_edges, "FA3F": summarise_fine, "FA3W": summarise_writer}
    records = {tag: [] for tag in summaries}
    args = sys.argv[1:]
    if args and args[0] == "--serial":
        LAYOUT.update(names=SERIAL, period_from=0, handed_on=5, taken=4)
        args = args[1:]
        if args and args[0] == "--warps":
            summaries["FA3T"] = summarise_warps
            args = args[1:]
    for line in open(args[0], errors="replace"):
        tag, *fields = line.split() or [""]
        if tag in records:
            rec = tuple(int(x) for x in fields)
            if records[tag] and rec[:2] <= records[tag][-1][:2]:
                records[tag] = []
            records[tag].append(rec)
        elif line.startswith("ours"):
            print(line.rstrip())
            for tag, summary in summaries.items():
                if records[tag]:
                    print("\n".join(summary(records[tag])))
                records[tag] = []


if __name__ == "__main__":
    main()
