"""Two builds of the extension against each other, interleaved: for a change meant to keep speed.

Each build is a source tree with its extension built in place (`python3 setup.py build_ext --inplace`).
The rounds alternate the builds, one process each (two builds of one package cannot share a
process), and time forward and forward + backward at the README's shapes and at one shape of each
option, so that clock and temperature drift hits both alike. Prints each build's median over the
rounds and the ratio of the second build's time to the first's.

    python3 benchmarks/ab_builds.py --build before=/tmp/before --build after=. [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

# (name, batch, heads_q, heads_kv, len, head_dim, causal, options): the README's performance table,
# then one shape for each option the forward and backward take.
SHAPES = [
    ("d64 n4k", 4, 32, 32, 4096, 64, False, {}),
    ("d64 n4k causal", 4, 32, 32, 4096, 64, True, {}),
    ("d64 n16k", 1, 32, 32, 16384, 64, False, {}),
    ("d64 n16k causal", 1, 32, 32, 16384, 64, True, {}),
    ("d128 n4k", 4, 16, 16, 4096, 128, False, {}),
    ("d128 n4k causal", 4, 16, 16, 4096, 128, True, {}),
    ("d128 n16k", 1, 16, 16, 16384, 128, False, {}),
    ("d128 n16k causal", 1, 16, 16, 16384, 128, True, {}),
    ("d256 n4k causal", 2, 16, 16, 4096, 256, True, {}),
    ("d128 n4k gqa 16:4 causal", 4, 16, 4, 4096, 128, True, {}),
    ("d128 n4k key-padding mask", 4, 16, 16, 4096, 128, False, {"mask": True}),
    ("d64 n4k key-padding mask", 4, 32, 32, 4096, 64, False, {"mask": True}),
    ("d64 n2k (B,1,L,S) mask dropout 0.1", 8, 12, 12, 2048, 64, False, {"mask": "rows", "dropout_p": 0.1}),
    ("d128 n8k window (1024, 0)", 2, 16, 16, 8192, 128, False, {"window": (1024, 0)}),
    ("d128 n4k softcap 30", 4, 16, 16, 4096, 128, True, {"softcap": 30.0}),
    ("d128 n4k dropout 0.1", 4, 16, 16, 4096, 128, True, {"dropout_p": 0.1}),
    ("d128 n4k alibi causal", 4, 16, 16, 4096, 128, True, {"alibi": True}),
    ("d64 n4k sm80 key-padding mask", 4, 32, 32, 4096, 64, False, {"mask": True, "kernels": "sm80"}),
]

CHILD = r"""
import json, os, statistics, sys
import torch
import flashattn_ext
shapes, calls = json.loads(sys.argv[1]), int(sys.argv[2])
def burst_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(); fn(); torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / calls
times = {}
for name, b, hq, hkv, n, d, causal, opts in shapes:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(is_causal=causal, enable_gqa=hq != hkv, dropout_p=opts.get("dropout_p", 0.0))
    extra = {}
    if "window" in opts: extra["window"] = tuple(opts["window"])
    if "softcap" in opts: extra["softcap"] = opts["softcap"]
    if "alibi" in opts: extra["alibi_slopes"] = torch.rand(hq, device="cuda")
    # "kernels": FLASHATTN_EXT_KERNELS for this shape (read at each call), e.g. sm80 on a Hopper GPU
    os.environ.pop("FLASHATTN_EXT_KERNELS", None)
    if "kernels" in opts: os.environ["FLASHATTN_EXT_KERNELS"] = opts["kernels"]
    if opts.get("mask"):
        lengths = torch.randint(n // 2, n + 1, (b,), device="cuda")
        mask = (torch.arange(n, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
        # "rows": every row materialized, as transformers' BERT passes it
        kwargs["attn_mask"] = mask.expand(b, 1, n, n).contiguous() if opts["mask"] == "rows" else mask
    def forward():
        return flashattn_ext.attention_with_lse(q, k, v, **kwargs, **extra)[0]
    def step():
        out = forward()
        torch.autograd.grad(out, (q, k, v), dout)
    with torch.no_grad():
        fwd = burst_ms(forward)
    times[name] = (fwd, burst_ms(step))
print("RESULT " + json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", required=True, help="NAME=TREE (twice)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--shapes", nargs="*", help="only the shapes whose names contain one of these")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if not args.shapes or any(part in s[0] for part in args.shapes)]
    builds = [tuple(text.split("=", 1)) for text in args.build]
    assert len(builds) == 2, "two builds: --build NAME=TREE --build NAME=TREE"
    runs = {name: [] for name, _ in builds}
    for round_index in range(args.rounds):
        order = builds if round_index % 2 == 0 else builds[::-1]
        for name, tree in order:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shapes), str(args.calls)], env=env,
                                    capture_output=True, text=True, cwd="/")
            line = [l for l in result.stdout.splitlines() if l.startswith("RESULT ")]
            if result.returncode != 0 or not line:
                sys.exit(f"{name} ({tree}) failed:\n{result.stdout}\n{result.stderr}")
            runs[name].append(json.loads(line[0][len("RESULT "):]))
    (first, _), (second, _) = builds
    print(f"{args.rounds} rounds, {args.calls} calls a burst; medians in ms; {second} / {first}")
    print(f"| shape | {first} fwd | {second} fwd | ratio | {first} fwd+bwd | {second} fwd+bwd | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, *_ in shapes:
        med = {b: [statistics.median(r[name][i] for r in runs[b]) for i in (0, 1)] for b in runs}
        a, c = med[first], med[second]
        print(f"| {name} | {a[0]:.3f} | {c[0]:.3f} | {c[0] / a[0]:.3f} | {a[1]:.3f} | {c[1]:.3f} | {c[1] / a[1]:.3f} |")
    print("\nEach round's forward ms (first build / second):")
    for name, *_ in shapes:
        print(name, " ".join(f"{r1[name][0]:.3f}/{r2[name][0]:.3f}" for r1, r2 in zip(runs[first], runs[second])))


if __name__ == "__main__":
    main()
