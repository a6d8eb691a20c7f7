#!/usr/bin/env python
"""Stand-in for ``uv run python examples/run_eval.py``: ``eval-checkpoints --launcher`` on CPU (a test fixture).

``nemo-granular eval-checkpoints`` runs ``<launcher> --config <benchmark>.yaml key=value ...`` in the
NeMo-RL checkout, once per checkpoint and benchmark. This script runs that checkout's own
``examples/run_eval.py`` as ``__main__`` with those arguments — NeMo-RL's config loading and CLI
overrides, ``init_ray``, ``get_tokenizer``, ``configure_generation_config``, the data (the staged
JSONL through ``load_eval_dataset``, or NeMo-RL's loader), ``MathEnvironment`` (a Ray actor and
its math-verify workers), ``setup`` (``RayVirtualCluster`` with its GPU placement groups),
``run_env_eval`` (pass@k, the environment's rewards) and the ``evaluation_data.json`` /
``config.json`` it saves — with two substitutions, because vLLM and Ray's GPUs need a GPU:

* vLLM: ``nemo_rl.evals.eval.VllmGeneration(cluster, config)`` runs NeMo-RL's own ``__init__``
  (config checks, placement groups, worker builder) until it would create its vLLM workers
  (``RayWorkerGroup``), then :class:`CpuTextGeneration` takes its place: ``generate_text`` as
  vLLM's worker does it (text prompts tokenized with special tokens, ``SamplingParams`` from the
  config: temperature 0 = greedy, ``top_p``, ``top_k``, ``max_new_tokens`` capped by
  ``max_model_len``, ``stop_token_ids``; the text of the new tokens without special tokens),
  with transformers ``generate`` on the model of ``generation.model_name`` in
  ``vllm_cfg.precision`` (CPU autocast) — :class:`cpu_host.generation.CpuHFGeneration`;
* Ray: the local Ray instance ``init_ray`` starts (no cluster to attach to) declares the node's
  GPUs, ``SLURM_GPUS_ON_NODE`` (else ``cluster.gpus_per_node``), and 16 CPUs: Ray detects no GPU
  on this machine, and ``RayVirtualCluster`` asks for one per bundle. And ``init_ray``'s
  ``ray.init(address="auto")`` does not find other nodes' Ray: the local cluster's nodes are
  network namespaces of one machine, whose process table Ray's legacy "auto" scans for any GCS
  server; the scan finds none, as on a compute node where no Ray runs.

docs/nemo-rl.md §7 lists both. Installed as an executable (``--launcher /path/to/this.py``: one
word, so it passes through ``submit_comparison.sh --eval-args``); ``python`` is the one on PATH
(the image's, in a container).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LOCAL_RAY_CPUS = 16


def install_ray_gpus(gpus: int) -> None:
    """``ray.init`` without an address (a fresh local instance) declares ``gpus`` GPUs; Ray's scan
    for running GCS servers (``address="auto"``'s legacy fallback) finds none, as on a compute node
    where no Ray runs (the local cluster's nodes share this machine's process table)."""
    import ray
    from ray._private import services

    def find_gcs_addresses():
        return frozenset()

    find_gcs_addresses.cache_clear = lambda: None  # (Ray clears the real one's cache)
    services.find_gcs_addresses = find_gcs_addresses
    real_init = ray.init

    def init(*args, **kwargs):
        if not args and kwargs.get("address") is None:
            kwargs.setdefault("num_gpus", gpus)
            kwargs.setdefault("num_cpus", LOCAL_RAY_CPUS)
        return real_init(*args, **kwargs)

    ray.init = init


def text_generation_class():
    import torch

    from cpu_host.generation import CpuHFGeneration

    class CpuTextGeneration(CpuHFGeneration):
        """vLLM's ``generate_text`` on CPU (the module docstring)."""

        def __init__(self, config: dict):
            from transformers import AutoTokenizer

            super().__init__(config, refit="ipc_zmq")  # nothing to refit: the model is the checkpoint
            self.tokenizer = AutoTokenizer.from_pretrained(config["model_name"])

        def generate_text(self, data, greedy: bool = False):
            from nemo_rl.distributed.batched_data_dict import BatchedDataDict

            if self.cfg.get("stop_strings"):
                raise NotImplementedError("CpuTextGeneration: stop_strings")
            prompts = list(data["prompts"])
            encoded = [self.tokenizer(p)["input_ids"] for p in prompts]  # vLLM: special tokens added
            lengths = torch.tensor([len(e) for e in encoded])
            ids = torch.full((len(encoded), int(lengths.max())), self.pad_id, dtype=torch.long)
            for i, e in enumerate(encoded):
                ids[i, : len(e)] = torch.tensor(e)
            greedy = greedy or float(self.cfg["temperature"]) == 0.0  # vLLM: temperature 0 is greedy
            out = self.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths), greedy=greedy)
            texts = []
            for i, n in enumerate(lengths.tolist()):
                g = int(out["generation_lengths"][i])
                texts.append(self.tokenizer.decode(out["output_ids"][i, n : n + g].tolist(), skip_special_tokens=True))
            return BatchedDataDict(texts=texts)

    return CpuTextGeneration


def install_generation_seam() -> None:
    """``nemo_rl.evals.eval.VllmGeneration`` → its real ``__init__`` up to the worker group, then the stand-in."""
    import nemo_rl.evals.eval as nemo_eval

    from cpu_host.generation import vllm_init_up_to_workers

    stand_in = text_generation_class()

    def vllm_generation(cluster, config, **kw):
        vllm_init_up_to_workers(cluster, config, **kw)
        print(f"[eval launcher] vLLM stand-in: transformers generate on CPU for {config['model_name']}", flush=True)
        return stand_in(config)

    nemo_eval.VllmGeneration = vllm_generation


def gpus_on_node(argv: list[str]) -> int:
    if os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(os.environ["SLURM_GPUS_ON_NODE"])
    for a in argv:
        if a.startswith("cluster.gpus_per_node="):
            return int(a.split("=", 1)[1])
    return 8  # the benchmark configs' cluster.gpus_per_node


def main(argv: list[str]) -> None:
    script = Path.cwd() / "examples" / "run_eval.py"
    if not script.is_file():
        raise SystemExit(f"nemo_rl_eval_launcher: no {script}: run it in a NeMo-RL checkout (eval-checkpoints does)")
    # sys.path as `python examples/run_eval.py` has it (the script's folder first; run_eval.py itself
    # appends the checkout, which the substitutions below need before it runs), then cpu_host
    sys.path[0] = str(script.parent)
    sys.path += [str(script.parent.parent), str(TESTS)]
    install_ray_gpus(gpus_on_node(argv))
    install_generation_seam()
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
