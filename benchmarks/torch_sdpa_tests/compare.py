"""Compares two junit xml files from run.sh: flashattn_ext active (ext) against torch's own FA2 (base).

    python3 benchmarks/torch_sdpa_tests/compare.py OUT/torch_tests_ext.xml OUT/torch_tests_base.xml

Prints the outcome counts of each run, then the tests whose outcome differs (ext failed where base passed first:
those are the regressions to look at), grouped by test function, with the first line of ext's failure message.
"""
import collections
import os
import re
import sys
import xml.etree.ElementTree as ET


def load(path):
    res = {}
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        print(f"{path}: unreadable ({e})")
        return None
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"
        outcome, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, msg = ("failed" if child.tag == "failure" else "error"), (child.get("message") or "")
            elif child.tag == "skipped":
                outcome, msg = "skipped", (child.get("message") or "")
        res[name] = (outcome, msg.strip().splitlines()[0][:200] if msg.strip() else "")
    return res


def base_name(name):
    cls, test = name.split("::", 1)
    return cls + "::" + re.split(r"_(batch_size|seq_len|head_dim|kernel|fused_kernel|type|contiguous_inputs|is_causal|"
                                 r"dropout|expand_|causal_variant|shape|max_seq|use_|enable_|warn_only|dtype|float16|"
                                 r"bfloat16|scale|cuda)", test, maxsplit=1)[0]


def main(ext_path, base_path):
    runs = {"ext": load(ext_path), "base": load(base_path)}
    for k, r in runs.items():
        if r is None:
            print(f"{k}: no results")
            continue
        c = collections.Counter(o for o, _ in r.values())
        print(f"{k}: {len(r)} tests: " + ", ".join(f"{n} {o}" for o, n in sorted(c.items())))
    ext, base = runs["ext"], runs["base"]
    if not ext or not base:
        return
    only_ext = sorted(set(ext) - set(base))
    only_base = sorted(set(base) - set(ext))
    if only_ext or only_base:
        print(f"ran in ext only: {len(only_ext)}, in base only: {len(only_base)} (a run stopped by its timeout?)")
    groups = collections.defaultdict(list)
    for name in sorted(set(ext) & set(base)):
        (eo, em), (bo, bm) = ext[name], base[name]
        if eo != bo:
            groups[(eo, bo)].append((name, em or bm))
    order = sorted(groups, key=lambda k: (k[0] == "passed", k))
    for eo, bo in order:
        items = groups[(eo, bo)]
        print(f"\n== ext {eo}, base {bo}: {len(items)}")
        by_fn = collections.defaultdict(list)
        for name, msg in items:
            by_fn[base_name(name)].append((name, msg))
        for fn, lst in sorted(by_fn.items()):
            print(f"  {fn}: {len(lst)}   e.g. {lst[0][0].split('::')[1]}")
            if lst[0][1]:
                print(f"      {lst[0][1]}")
    both_failed = [n for n in set(ext) & set(base) if ext[n][0] in ("failed", "error") and base[n][0] in ("failed", "error")]
    if both_failed:
        print(f"\n== failed in both (the test file's age, not flashattn_ext?): {len(both_failed)}")
        by_fn = collections.Counter(base_name(n) for n in both_failed)
        for fn, n in sorted(by_fn.items()):
            print(f"  {fn}: {n}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
