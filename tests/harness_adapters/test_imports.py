"""Imports run one way: the proxy's policy uses harness_adapters, which uses only the conversation vocabulary."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_harness_adapters_import_no_proxy_module_but_the_vocabulary():
    code = ("import sys\n"
            "import harness_adapters, harness_adapters.normalize, harness_adapters.user_rules, "
            "harness_adapters.layout\n"
            "print(','.join(sorted(m for m in sys.modules if m == 'proxy' or m.startswith('proxy.'))))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "proxy,proxy.conversation"
