"""Stand-in for PyTorch's test/test_cpp_extensions_open_device_registration.py (not in the wheel).

test_transformers.py imports two helpers from it, used only by TestSDPAPrivateUse1Only (a fake
"foo" PrivateUse1 device built from test/cpp_extensions/open_registration_extension.cpp, which is
not here either). With this stub the module imports; TestSDPAPrivateUse1Only is not selected by
run.sh (its setUpClass would fail to build the missing extension). Nothing flash-related uses these.
"""
import types


def remove_build_path():
    """The real one deletes torch.utils.cpp_extension's build root; nothing to do here."""


def generate_faked_module():
    """The real one returns a module of device hooks for the fake 'foo' device."""
    return types.ModuleType("foo")
