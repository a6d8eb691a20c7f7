"""A CPU world in which NeMo-RL's own driver and worker code (DTensor-v2, Megatron) runs for real (test code only).

* :mod:`.cluster` — a private local Ray head that declares GPUs (one per test module), the drivers'
  environment (NeMo-RL's ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1``, private ``HOME``, Ray auth off).
* :mod:`.hooks`, ``site/sitecustomize.py`` — the CPU stand-ins (the shared ones of ``tests/harness/cpu_stand_ins``
  and this harness's own), installed lazily in the driver and in every Ray worker (docs/nemo-rl.md §7
  lists each with why).
* :mod:`.generation` — vLLM's place taken by transformers ``generate`` (NeMo-RL's
  ``GenerationInterface`` + a real ``WeightSynchronizer`` refitting through ``save_checkpoint``).
* :mod:`.launch` — ``python -m cpu_host.launch {grpo|sppo}``: our unchanged ``run_grpo`` / ``run_sppo``
  with the generation seam, recording facts for the tests.
* :mod:`.models`, :mod:`.configs`, :mod:`.runs` — tiny local models and data, shrunk child configs of the
  shipped examples, one run read back (facts, TensorBoard scalars).
"""
