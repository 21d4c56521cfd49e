"""flashattn_ext as a transformers attention backend: small random-init models (no download) run with
attn_implementation="fa_ext" give SDPA's losses, logits, gradients and generated tokens. Skipped
where transformers is not installed."""
import pytest
import torch

import flashattn_ext
from helpers import dtype_name, on_paths_each, relative_error, small_config

transformers = pytest.importorskip("transformers")
try:
    NAME = flashattn_ext.register_with_transformers()
except ImportError as error:  # a transformers without AttentionInterface / AttentionMaskInterface
    pytest.skip(str(error), allow_module_level=True)
# Largest error relative to the largest magnitude: float32 runs come out within 1e-6; bfloat16 rounds
# every layer's activations, and two implementations' roundings drift apart over the layers.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
# The models' dtype on each path: the CUDA kernels take 16-bit types.
DTYPES_BY_PATH = {"cpu": [torch.float32], "cuda": [torch.bfloat16]}


# transformers' own attention for each family: SDPA, or eager where its SDPA path lacks the family's
# scores (Gemma 2's softcapping, gpt-oss's sinks).
THEIRS = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager"}


def twin_models(family, device, dtype):
    """The same random weights under transformers' own attention (THEIRS) and under flashattn_ext."""
    torch.manual_seed(0)
    theirs = THEIRS[family]
    # A config each: a model keeps its config, and from_config sets the implementation on it.
    sdpa = transformers.AutoModelForCausalLM.from_config(small_config(family), attn_implementation=theirs, dtype=dtype)
    ours = transformers.AutoModelForCausalLM.from_config(small_config(family), attn_implementation=NAME, dtype=dtype)
    assert (sdpa.config._attn_implementation, ours.config._attn_implementation) == (theirs, NAME)
    ours.load_state_dict(sdpa.state_dict())
    return sdpa.to(device), ours.to(device)


@on_paths_each("dtype", DTYPES_BY_PATH, ids=dtype_name)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "right_padded"])
@pytest.mark.parametrize("family", list(THEIRS))
def test_training_step_matches_sdpa(family, padded, path, dtype):
    device = path.device
    sdpa, ours = twin_models(family, device, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 24), generator=gen).to(device)
    mask = torch.ones(2, 24, dtype=torch.long, device=device)
    if padded:
        mask[1, 17:] = 0  # a padded batch: the mask reaches attention as a tensor
    # (No loss on the padding tokens, as in training: their outputs are SDPA's arbitrary ones, and 0
    # through the backend, whose mask hides their query rows.)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (sdpa, ours):
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        results.append((out.loss.detach(), out.logits.detach(), grads))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = results
    assert relative_error(loss_b, loss_a) <= TOLERANCE[dtype]
    visible = mask.bool()  # logits of padded positions are not compared (SDPA's are arbitrary there)
    assert relative_error(logits_b[visible], logits_a[visible]) <= TOLERANCE[dtype]
    for name, grad in grads_a.items():
        assert relative_error(grads_b[name], grad) <= TOLERANCE[dtype], name


def record_kernel_calls(monkeypatch):
    """The (window, attn_mask's shape or None, is_causal) of each call the backend makes to
    attention_with_lse from now on, in order."""
    from flashattn_ext import transformers_backend
    from flashattn_ext.attention import attention_with_lse

    calls = []

    def recording(*args, **kwargs):
        mask = kwargs.get("attn_mask")
        calls.append((kwargs.get("window"), None if mask is None else tuple(mask.shape), kwargs.get("is_causal")))
        return attention_with_lse(*args, **kwargs)

    monkeypatch.setattr(transformers_backend, "attention_with_lse", recording)
    return calls


@pytest.mark.parametrize("padding", ["none", "ones", "right_padded"])
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_sliding_window_layers_pass_the_window(family, padding, monkeypatch):
    """A sliding-window layer's call whose queries are its keys gets the window as the kernels' window
    (and the attention mask, if given, as a (B, 1, 1, S) key mask: whether it hides any key is not
    asked, which would wait for the device), not transformers' (B, 1, L, S) mask; full layers keep
    theirs. The results are SDPA's / eager's (test_training_step_matches_sdpa)."""
    calls = record_kernel_calls(monkeypatch)
    _, ours = twin_models(family, "cpu", torch.float32)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = None if padding == "none" else torch.ones(2, 24, dtype=torch.long)
    if padding == "right_padded":
        mask[1, 17:] = 0
    ours(ids, attention_mask=mask)
    layer_types = getattr(ours.config, "layer_types", None) or ["sliding_attention"] * 2
    assert len(calls) == len(layer_types)
    for (window, mask_shape, is_causal), layer_type in zip(calls, layer_types):
        if layer_type == "sliding_attention":
            assert window == (7, 0)
            assert (mask_shape, is_causal) == ((None, True) if mask is None else ((2, 1, 1, 24), False))
        else:
            assert window is None


def test_wide_heads_keep_the_window_in_the_mask(monkeypatch):
    """Above head dim 128 a mask runs the sm80 kernels on CUDA, which have no window: a padded sliding-window
    batch keeps transformers' mask, window and all."""
    calls = record_kernel_calls(monkeypatch)
    config = small_config("mistral")
    config.head_dim = 160
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    model(torch.randint(0, 96, (2, 24)), attention_mask=mask)
    assert calls == [(None, (2, 1, 24, 24), False)] * 2


def test_compiled_forward_of_a_padded_sliding_window_batch():
    """Under torch.compile(fullgraph=True) the mask builder keeps transformers' masks (it cannot read the
    mask functions' closures there): no graph break, and the real tokens' logits are SDPA's."""
    sdpa, ours = twin_models("mistral", "cpu", torch.float32)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    want = sdpa(ids, attention_mask=mask, use_cache=False).logits
    torch._dynamo.reset()
    got = torch.compile(ours.forward, fullgraph=True)(ids, attention_mask=mask, use_cache=False).logits
    assert relative_error(got[mask.bool()], want[mask.bool()]) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("family", list(THEIRS))
def test_generation_matches_sdpa(family, padded):
    """Prefill and one-token steps against a growing cache, greedy: the same tokens, also for a
    left-padded batch (its prefill hides the padding tokens' query rows)."""
    sdpa, ours = twin_models(family, "cpu", torch.float32)
    ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        ids[1, :4] = 0
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **settings), sdpa.generate(ids, **settings))


def test_position_bias_is_refused_by_name():
    module = torch.nn.Module()
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="`position_bias`"):
        flashattn_ext.transformers_backend.attention_forward(module, q, k, v, None,
                                                             position_bias=torch.zeros(1, 2, 4, 4))


def test_names_with_flash_are_refused():
    with pytest.raises(ValueError, match="containing 'flash'"):
        flashattn_ext.register_with_transformers("flashattn_ext")


@on_paths_each("dtype", DTYPES_BY_PATH, ids=dtype_name)
def test_encoder_training_step_matches_sdpa_on_real_tokens(path, dtype):
    """BERT on a right-padded batch: the backend's mask also hides the padding tokens' query rows
    (their outputs are 0, so that the kernels skip them); the loss (on real tokens), the real
    tokens' logits and every gradient are SDPA's."""
    device = path.device
    config = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    sdpa = transformers.BertForMaskedLM(transformers.BertConfig(**config, attn_implementation="sdpa"))
    ours = transformers.BertForMaskedLM(transformers.BertConfig(**config, attn_implementation=NAME))
    ours.load_state_dict(sdpa.state_dict())
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (3, 40), generator=gen).to(device)
    mask = torch.ones(3, 40, dtype=torch.long, device=device)
    mask[1, 29:] = 0
    mask[2, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (sdpa.to(device, dtype), ours.to(device, dtype)):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = results
    assert relative_error(loss_b, loss_a) <= TOLERANCE[dtype]
    real = mask.bool()
    assert relative_error(logits_b[real], logits_a[real]) <= TOLERANCE[dtype]
    # (Errors relative to the largest gradient of any: the key bias's is 0 up to rounding.)
    largest = max(grad.abs().max().item() for grad in grads_a.values())
    for name, grad in grads_a.items():
        assert (grads_b[name].double() - grad.double()).abs().max().item() <= TOLERANCE[dtype] * largest, name
    # The padding tokens' query rows are hidden: the mask the backend builds.
    from transformers.masking_utils import create_bidirectional_mask

    embeds = torch.zeros(3, 40, 64, device=device)
    built = create_bidirectional_mask(config=ours.config, inputs_embeds=embeds, attention_mask=mask)
    assert built.shape == (3, 1, 40, 40) and built.dtype == torch.bool
    assert torch.equal(built[:, 0], real[:, :, None] & real[:, None, :])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_compiled_static_cache_generation(family, device):
    """generate() with a static cache and its decoding steps under torch.compile(fullgraph=True): no graph
    break (our ops trace through their fake kernels), and the same tokens as uncompiled (on the CPU in
    float32 also transformers' own attention's). On CUDA, transformers' own compilation of the steps
    (mode="reduce-overhead") runs them as CUDA graphs, which a host sync inside the ops would stop
    (counted as a cudagraph skip)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo.utils import counters

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    theirs, ours = twin_models(family, device, dtype)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(3)).to(device)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    uncompiled = ours.generate(ids, disable_compile=True, **settings)
    if device == "cpu":
        assert torch.equal(uncompiled, theirs.generate(ids, disable_compile=True, **settings))
    torch._dynamo.reset()
    counters.clear()
    if device == "cpu":
        ours.forward = torch.compile(ours.forward, fullgraph=True)
        compiled = ours.generate(ids, disable_compile=True, **settings)
    else:
        compiled = ours.generate(ids, compile_config=transformers.CompileConfig(fullgraph=True), **settings)
        assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(compiled, uncompiled)
