"""The preset checks that need no torch run, and pass, in an environment without torch."""

import subprocess
import sys
from pathlib import Path

from llamem.model import preset_names

TESTS = Path(__file__).parent

# Block torch and transformers before pytest collects anything: `import torch` then raises ImportError.
RUN_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
sys.modules["transformers"] = None
import pytest
sys.exit(pytest.main(["-o", "addopts=", "-q", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def test_preset_checks_run_without_torch():
    out = subprocess.run([sys.executable, "-c", RUN_WITHOUT_TORCH, str(TESTS / "test_presets.py")],
                         capture_output=True, text=True, cwd=TESTS.parent, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # Only the transformers comparisons skip: one per preset (the 405B one on a 2-layer slice).
    assert f"{len(preset_names())} skipped" in out.stdout, out.stdout
    torch_free = 1 + 1 + 6 + 1 + len(preset_names())  # 405B count, published, KV sizes, lookup, rules
    assert f"{torch_free} passed" in out.stdout, out.stdout
