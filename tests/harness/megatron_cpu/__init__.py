"""Real NeMo-RL Megatron policy worker on CPU: stand-ins, tiny checkpoints, gloo worlds (see docs/nemo-rl.md §7)."""
