"""Summarizes the SASS source pages that ncu_backward.sh exports (one .sass.csv per kernel): instructions
executed, the mainloop (the instructions executed equally often that issue the most: how many, how often), the opcode mix and the
stall samples by reason.
    python3 benchmarks/fa4/ncu_sass_summary.py ours_4_16_4096_128_0.sass.csv fa4_4_16_4096_128_0.sass.csv
"""
import collections
import csv
import sys


def summarize(path):
    rows = list(csv.reader(open(path)))
    header, body = rows[1], [r for r in rows[2:] if len(r) == len(rows[1])]
    col = {name: i for i, name in enumerate(header)}
    executed = [int(r[col["Instructions Executed"]]) for r in body]
    samples = [int(r[col["Warp Stall Sampling (All Samples)"]]) for r in body]
    loop_count = max(collections.Counter(e for e in executed if e > 0).items(), key=lambda kv: kv[0] * kv[1])[0]
    loop = [i for i, e in enumerate(executed) if e == loop_count]
    print(f"== {path}: {sum(executed):,} warp instructions executed, {sum(samples):,} stall samples")
    print(f"   mainloop: {len(loop)} instructions, each executed {loop_count:,} times "
          f"({sum(samples[i] for i in loop):,} samples)")
    opcodes, opcode_samples = collections.Counter(), collections.Counter()
    for r, e, s in zip(body, executed, samples):
        words = r[1].split()
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        opcodes[op] += e
        opcode_samples[op] += s
    print("   opcodes (executed, share of samples): " + ", ".join(
        f"{op} {n / 1e6:.1f}M {100 * opcode_samples[op] / sum(samples):.0f}%" for op, n in opcodes.most_common(12)))
    reasons = {name[6:]: sum(int(r[i]) for r in body) for name, i in col.items()
               if name.startswith("stall_") and "Not Issued" not in name}
    print("   stalls (samples): " + ", ".join(f"{k} {v:,}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])
                                               if v > 0.02 * sum(samples)))


for p in sys.argv[1:]:
    summarize(p)
