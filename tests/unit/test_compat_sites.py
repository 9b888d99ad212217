"""Every upstream megatron-core site that megarl.compat patches still exists in the installed
version; if one moved or was fixed upstream this fails and names the patch to revisit. The sites
are read from megatron-core's source files, not from the live modules: another test of the same
process may already have patched them (setup_cpu)."""
import ast
import importlib
import inspect

import pytest

from megarl.compat.megatron_cpu import SITES


@pytest.mark.parametrize("site", SITES, ids=[f"{s.patch}:{s.module.split('.')[-1]}.{s.attr}" for s in SITES])
def test_patched_site_still_upstream(site):
    module = importlib.import_module(site.module)
    assert hasattr(module, site.attr), (
        f"{site.patch}: {site.module}.{site.attr} is gone upstream; revisit megarl/compat/megatron_cpu.py")
    if site.needle:
        tree = ast.parse(inspect.getsource(module))
        defs = [node for node in tree.body if getattr(node, "name", None) == site.attr]
        assert defs, f"{site.patch}: no top-level definition of {site.attr} in {site.module}'s source"
        source = ast.get_source_segment(inspect.getsource(module), defs[-1])
        assert site.needle in source, (
            f"{site.patch}: {site.module}.{site.attr} no longer contains {site.needle!r}: the upstream "
            "bug may be fixed or moved; revisit the patch")


def test_setup_cpu_is_idempotent_and_reports_cpu():
    # In a subprocess: setup_cpu() enters a process-wide TorchFunctionMode.
    import subprocess
    import sys
    code = """
import torch
from megarl import compat
assert compat.setup_cpu() is True and compat.setup_cpu() is True
from megatron.core.models.gpt import gpt_layer_specs
from megarl.compat.te_cpu import CpuTESpecProvider
assert gpt_layer_specs.TESpecProvider is CpuTESpecProvider
assert torch.cuda.current_device() == torch.device("cpu")
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert compat.has_apex() is False
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
