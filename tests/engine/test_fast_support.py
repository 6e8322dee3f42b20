"""Which chunked DeltaNet rule a prompt's fast path takes (engine/models/fast_support.py prompt_rule)."""
import logging
from types import SimpleNamespace

import torch

from engine.kernels import delta_rule_fla
from engine.models.fast_support import prompt_rule
from engine.models.token_graphs import BucketedRule


def test_a_cuda_model_without_fla_core_says_so_and_takes_the_torch_rule(monkeypatch, caplog):
    """Without fla-core a CUDA model's prompts run the torch rule (None: the layers' own), and the log says what
    that costs and how to install it; with fla-core, bf16 takes its kernels, fp32 keeps the exact torch rule."""
    cuda = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"))
    monkeypatch.setattr(delta_rule_fla, "available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="killick.engine"):
        assert prompt_rule(cuda, capture=False) is None
    assert "fla-core is not installed" in caplog.text and "killick[gpu]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="killick.engine"):  # a CPU model has no other rule: nothing said
        assert prompt_rule(SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu")), capture=False) is None
    assert caplog.text == ""
    monkeypatch.setattr(delta_rule_fla, "available", lambda: True)
    assert isinstance(prompt_rule(cuda, capture=False), BucketedRule)
    assert prompt_rule(SimpleNamespace(dtype=torch.float32, device=torch.device("cuda")), capture=False) is None
