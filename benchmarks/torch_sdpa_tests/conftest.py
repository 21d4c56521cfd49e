"""pytest glue for running PyTorch's own test/test_transformers.py with flashattn_ext as torch's
flash-attention implementation.

FLASHATTN_EXT_ACTIVATE=1 (default): import flashattn_ext (registers the name "flashattn_ext") and
    torch.nn.attention.activate_flash_attention_impl("flashattn_ext") before any test module is
    imported, so aten's flash ops (_scaled_dot_product_flash_attention, _flash_attention_forward and
    their backwards) run our kernels for the whole session.
FLASHATTN_EXT_ACTIVATE=0: nothing is imported or activated: torch's own FA2 (the baseline).
FLASHATTN_EXT_COUNT=1 (default): while active, count the calls that reach flashattn_ext's four aten
    kernels (transparent wrappers installed before activation) and print the counts at the end, so a
    green run is also shown to have gone through our kernels.

Also: PyTorch's torch.testing._internal.common_utils imports `expecttest`, which the GPU image lacks;
if it is not importable, the vendored copy in _vendor/ (expecttest 0.3.0, MIT) is put on sys.path.
"""
import functools
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

try:  # common_utils needs it at import time
    import expecttest  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE / "_vendor"))

if str(REPO_ROOT) not in sys.path:  # flashattn_ext, built in place
    sys.path.insert(0, str(REPO_ROOT))

ACTIVATE = os.environ.get("FLASHATTN_EXT_ACTIVATE", "1") not in ("0", "", "false", "False")
COUNT = os.environ.get("FLASHATTN_EXT_COUNT", "1") not in ("0", "", "false", "False")

_calls = {}
_state = {"active": None, "error": None}


def _counting(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _calls[name] = _calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


def _activate():
    import torch
    import torch.nn.attention as attention

    import flashattn_ext  # noqa: F401  registers "flashattn_ext"
    from flashattn_ext import torch_flash

    if COUNT:
        for name in ("_sdpa_flash_forward", "_sdpa_flash_backward", "_flash_forward", "_flash_backward"):
            fn = getattr(torch_flash, name, None)
            if fn is not None and not hasattr(fn, "__wrapped__"):
                setattr(torch_flash, name, _counting(name, fn))
    attention.activate_flash_attention_impl("flashattn_ext")
    _state["active"] = attention.current_flash_attention_impl()
    if _state["active"] != "flashattn_ext":
        raise RuntimeError(f"flashattn_ext not active after activation: {_state['active']!r}")


def pytest_configure(config):
    if ACTIVATE:
        try:
            _activate()
        except Exception as e:  # a broken build must not look like a baseline run
            _state["error"] = repr(e)
            raise
    else:
        try:
            import torch.nn.attention as attention
            _state["active"] = attention.current_flash_attention_impl()
        except Exception as e:
            _state["active"] = f"? ({e!r})"


def pytest_report_header(config):
    import torch
    lines = [
        f"torch {torch.__version__} git {torch.version.git_version} cuda {torch.version.cuda} "
        f"cuda_available={torch.cuda.is_available()}"
        + (f" device={torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        f"FLASHATTN_EXT_ACTIVATE={int(ACTIVATE)}: current_flash_attention_impl() = {_state['active']!r}",
    ]
    return lines


def pytest_runtest_setup(item):
    # The registry is process-global; a test that restores torch's kernels would silently turn
    # the rest of the run into a baseline run.
    if ACTIVATE:
        import torch.nn.attention as attention
        now = attention.current_flash_attention_impl()
        if now != "flashattn_ext":
            attention.activate_flash_attention_impl("flashattn_ext")
            _calls["reactivated"] = _calls.get("reactivated", 0) + 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    tr.section("flashattn_ext")
    tr.write_line(f"FLASHATTN_EXT_ACTIVATE={int(ACTIVATE)}, impl at start: {_state['active']!r}")
    if ACTIVATE:
        try:
            import torch.nn.attention as attention
            tr.write_line(f"impl at end: {attention.current_flash_attention_impl()!r}")
        except Exception:
            pass
        if COUNT:
            tr.write_line("calls that reached flashattn_ext's aten kernels: "
                          + (", ".join(f"{k}={v}" for k, v in sorted(_calls.items())) or "none"))
