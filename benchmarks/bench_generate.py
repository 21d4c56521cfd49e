"""generate() through the transformers backend against transformers' own sdpa path (issue 44's bar): the
time per new token of a Llama-shaped model with random weights, bf16, greedy, batch 16 and a prompt of
4000 tokens (GQA 32:8, head dim 128: the decoding step of bench_decode_step.py's first row), with

- the dynamic cache, eager;
- the static cache, eager (transformers' automatic compilation turned off);
- the static cache with the decoding steps compiled, as generate() does by default (its CompileConfig,
  mode="reduce-overhead": CUDA graphs; fullgraph=True).

Per-token time: the median over REPEATS generate() calls after a first one (which also lets SDPA's
cuDNN path build its plans for every cache length, and torch.compile compile; its wall time is shown as
"first pass") of the time between consecutive steps' logits (CUDA events recorded by a logits processor,
the prefill's step left out), the two backends' calls interleaved. Both models hold the same weights;
the tokens they generate are compared (bf16 roundings may flip a near tie of a random model).

    python3 benchmarks/bench_generate.py [--out FILE] [--layers N]
"""
import argparse
import time
from pathlib import Path

import torch
import transformers

import flashattn_ext

BATCH, PROMPT, STEPS, REPEATS = 16, 4000, 32, 3


def model_config(layers):
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=128, max_position_embeddings=8192)


class StepClock(transformers.LogitsProcessor):
    """Records a CUDA event as each step's logits come out (no host sync)."""

    def __init__(self):
        self.events = []

    def __call__(self, input_ids, scores):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return scores


def generate_timed(model, ids, **settings):
    """generate()'s tokens, wall seconds, and the milliseconds between its decoding steps."""
    clock = StepClock()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, do_sample=False, pad_token_id=0,
                         logits_processor=transformers.LogitsProcessorList([clock]), **settings)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return out, seconds, [a.elapsed_time(b) for a, b in zip(clock.events, clock.events[1:])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    name = flashattn_ext.register_with_transformers()
    torch.manual_seed(0)
    with torch.device("cuda"):
        sdpa = transformers.AutoModelForCausalLM.from_config(model_config(args.layers), attn_implementation="sdpa",
                                                             dtype=torch.bfloat16)
        ours = transformers.AutoModelForCausalLM.from_config(model_config(args.layers), attn_implementation=name,
                                                             dtype=torch.bfloat16)
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 32000, (BATCH, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    lines = [f"# generate() per new token ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"transformers {transformers.__version__})", "",
             f"Llama-shaped, {args.layers} layers, hidden 4096, GQA 32:8, head dim 128, bf16, batch {BATCH}, "
             f"prompt {PROMPT}, {STEPS} timed steps.", "",
             "| cache | sdpa ms/token | ours ms/token | ours / sdpa | sdpa first pass | ours first pass "
             "| same tokens |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    modes = [("dynamic, eager", dict(disable_compile=True)),
             ("static, eager", dict(cache_implementation="static", disable_compile=True)),
             ("static, compiled", dict(cache_implementation="static",
                                       compile_config=transformers.CompileConfig(fullgraph=True)))]
    with torch.no_grad():
        for label, settings in modes:
            first, tokens, steps = {}, {}, {"sdpa": [], "ours": []}
            for key, model in (("sdpa", sdpa), ("ours", ours)):
                tokens[key], first[key], _ = generate_timed(model, ids, **settings)
            for _ in range(REPEATS):
                for key, model in (("sdpa", sdpa), ("ours", ours)):
                    steps[key] += generate_timed(model, ids, **settings)[2]
            median = {key: sorted(times)[len(times) // 2] for key, times in steps.items()}
            same = torch.equal(tokens["sdpa"], tokens["ours"])
            ratio = median["ours"] / median["sdpa"]
            line = (f"| {label} | {median['sdpa']:.2f} | {median['ours']:.2f} | {ratio:.2f} | "
                    f"{first['sdpa']:.2f} s | {first['ours']:.2f} s | {same} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
