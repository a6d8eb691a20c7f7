"""Test-only stand-in for Transformer Engine, which needs CUDA.

Megatron-Bridge imports ``transformer_engine.pytorch`` at module level (LoRA layers, comm
overlap), so NeMo-RL's Megatron worker module cannot even be imported without it. Every
attribute here is an inert placeholder class: enough to import, never to compute. Put this
folder on ``sys.path`` only AFTER megatron.core has been imported, so megatron.core keeps
its own "Transformer Engine absent" code paths (see tests/conftest.py: ``megatron_workers``).
"""


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {})
