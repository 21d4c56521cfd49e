"""The `path` fixture: which kernel family a test runs (helpers.on_paths parametrizes a test over the
paths it takes; helpers.PATH_MARKS lists them, with the marks that skip each where it is absent)."""
from dataclasses import dataclass

import pytest

KERNELS_VARIABLE = "FLASHATTN_EXT_KERNELS"  # read at each call (csrc/fallback.cpp)


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90: runs the Hopper kernels (skipped but on an sm_90 GPU)")


@dataclass(frozen=True)
class KernelPath:
    """name: the path (cpu, cuda, sm80, sm90, deterministic); device: where its tensors live."""

    name: str

    @property
    def device(self):
        return "cpu" if self.name == "cpu" else "cuda"


@pytest.fixture
def path(request, monkeypatch):
    """Sets up the kernel path request.param names: sm80 sets FLASHATTN_EXT_KERNELS=sm80 (the
    mma.sync kernels on any GPU), sm90 unsets it (the Hopper kernels, the default where the path is
    not skipped); cpu, cuda and deterministic leave the environment as it is. Undone after the test
    (monkeypatch: a test that changes the variable itself shares the same one)."""
    name = request.param
    if name == "sm80":
        monkeypatch.setenv(KERNELS_VARIABLE, "sm80")
    elif name == "sm90":
        monkeypatch.delenv(KERNELS_VARIABLE, raising=False)
    return KernelPath(name)
