"""killick engine: hybrid MoE models served from a host expert pool. `from engine import Engine`."""


def __getattr__(name):  # lazy: importing engine.api must not import torch
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)
