"""The cache policy modules import neither torch nor aiohttp (checked in a fresh interpreter)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
POLICY = ("proxy.policy.planner", "proxy.policy.cache_policy", "proxy.policy.diff", "proxy.policy.sessions",
          "proxy.policy.anchors", "proxy.policy.turns", "harness_adapters.normalize", "harness_adapters")


def test_policy_imports_no_torch_and_no_aiohttp():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in POLICY) +
            "heavy = sorted(m for m in ('torch', 'aiohttp', 'numpy', 'transformers') if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
