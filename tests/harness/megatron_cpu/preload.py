"""What the forkserver of :mod:`megatron_cpu.world` imports once, before it forks any rank: the
stand-ins, then the Megatron worker's module tree (torch, transformers, NeMo-RL, Megatron-LM and
Megatron-Bridge). A spawned rank spent ~25 s of CPU on these imports; a layout of 8 ranks spent
most of its time importing (issue #32: CI time). Per rank, ``standins.install(local_rank)`` runs
again in ``cases.build_worker`` (idempotent; it sets the rank's GPU id).
"""

from megatron_cpu import standins

standins.install(0)

import transformers  # noqa: E402,F401

import nemo_granular.nemo_rl.megatron_worker  # noqa: E402,F401
