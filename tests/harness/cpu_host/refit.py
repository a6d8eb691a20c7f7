"""The refit on CPU: the training workers' current weights into the generation stand-in.

Two receivers, one per backend, each at the narrowest seam that runs NeMo-RL's own sending side:

* Megatron (:class:`IpcZmqReceiver`): NeMo-RL's colocated vLLM refit as ``grpo_train`` runs it
  when the generation has no weight synchronizer (``refit_policy_generation``):
  ``offload_before_refit``, the worker's real ``stream_weights_via_ipc_zmq`` (Megatron-Bridge's
  ``export_hf_weights`` — HF names, tensor/expert-parallel shards gathered — packed into ping-pong
  staging buffers and sent over its ZMQ socket), ``offload_after_refit``. Only the receiving vLLM
  worker is ours: on CPU the "IPC handle" of a staging buffer pickles its bytes (torch's
  ``reduce_tensor`` of a host tensor), so the buffer is rebuilt here, cut by the refit metadata
  (``prepare_refit_info``) and acknowledged as vLLM's worker does.
* DTensor-v2 on NeMo-RL main (:class:`StateDictSynchronizer`): a ``WeightSynchronizer`` refitting
  through NeMo-RL's own ``Policy.save_checkpoint`` (every rank its FSDP shard, HF key names,
  Automodel's MoE adapter) read back whole by :func:`read_sharded_safetensors`, the harness's own
  reader (not the package's export reader, which the export test checks against it). Its IPC path would hand vLLM the
  weights cast to the policy precision; the loops compare the worker's π_old log-probs with the
  generation model exactly, which needs the worker's own parameters.
* DTensor-v2 on NeMo-RL v0.7.0 (:class:`IpcZmqReceiver`): v0.7.0 has no synchronizer to replace, so
  its own colocated refit runs as for Megatron (the workers' ``stream_weights_via_ipc_zmq``: each
  gathers the full tensors from its FSDP / TP shards and sends them cast to ``policy.precision``),
  with the staging buffers sized from NVML's free memory (``cpu_host.hooks``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch


def dtensor_refit_path() -> str:
    """How the importable NeMo-RL's ``grpo_train`` / ``ppo_train`` refit the generation from a DTensor
    policy, and so which receiver the harness uses: ``"checkpoint"`` where NeMo-RL refits through a
    ``WeightSynchronizer`` (main; :class:`StateDictSynchronizer` takes its place), ``"ipc_zmq"``
    where ``refit_policy_generation`` streams over ZMQ itself (v0.7.0, which builds no synchronizer;
    :class:`IpcZmqReceiver` receives). The Megatron loop always takes ``"ipc_zmq"``. Asked of
    ``compat.version()``, which reads NeMo-RL's package folder without importing it (the test process
    asks too, and importing ``grpo`` there took 16 s)."""
    from nemo_granular.nemo_rl import compat

    return "ipc_zmq" if compat.version().key == compat.V0_7 else "checkpoint"


def _weight_synchronizer_base():
    from nemo_rl.weight_sync.interfaces import WeightSynchronizer

    return WeightSynchronizer


REFIT_CHECKPOINT = {"model_save_format": "safetensors", "save_consolidated": False}


def read_sharded_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Whole tensors from the ``*.safetensors`` shards of a DCP save in Hugging Face layout: each file holds
    every rank's chunk of its tensors, placed by the ``saved_offsets`` of the ``DCP_SHARDING_INFO`` JSON in
    its header (no offsets: the whole tensor). Written from the file format, with safetensors alone."""
    import json

    from safetensors import safe_open

    chunks: dict[str, list] = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"refit: no *.safetensors in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            info = json.loads((st.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            for key in st.keys():
                t = st.get_tensor(key)
                chunks.setdefault(key, []).append((info.get(key, {}).get("saved_offsets", [0] * t.dim()), t))
    out = {}
    for key, parts in chunks.items():
        size = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        full = torch.empty(size, dtype=parts[0][1].dtype)
        covered = 0
        for o, t in parts:
            full[tuple(slice(o[d], o[d] + t.shape[d]) for d in range(t.dim()))] = t
            covered += t.numel()
        if covered != full.numel():
            raise ValueError(f"refit: the chunks of {key} cover {covered} of its {full.numel()} elements")
        out[key] = full
    return out


class StateDictSynchronizer(_weight_synchronizer_base()):
    """DTensor-v2 refit through ``Policy.save_checkpoint`` and the export reader (module docstring)."""

    def __init__(self, generation):
        self.generation = generation
        self.policy = None  # set once setup() built the policy (the test launcher does it)
        self._stale = True

    @property
    def is_stale(self) -> bool:
        return self._stale

    def mark_stale(self) -> None:  # abstract in NeMo-RL v0.7.0's WeightSynchronizer, gone on main
        self._stale = True

    def init_communicator(self) -> None:
        return None

    def sync_weights(self, *, timer=None, kv_scales=None):
        if self.policy is None:
            raise RuntimeError("StateDictSynchronizer: no policy attached (the launcher attaches it after setup())")
        scratch = Path(tempfile.mkdtemp(prefix="refit_"))
        try:
            # every rank writes its shard through NeMo-RL's own save path (HF key names)
            self.policy.save_checkpoint(weights_path=str(scratch / "weights"), checkpointing_cfg=REFIT_CHECKPOINT)
            path = scratch / "weights" / "model"
            full = read_sharded_safetensors(path)
            self.generation.last_refit = {
                "path": "checkpoint",
                "workers": len(self.policy.worker_group.workers),
                "tensors": [len(full)],
                "files": sorted(p.name for p in Path(path).iterdir() if p.is_file()),
            }
            self.generation.load_weights(full, scratch / "hf")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._stale = False
        return {"cpu_refit_tensors": float(len(full))}

    def shutdown(self) -> None:
        return None


class IpcZmqReceiver:
    """The receiving side of NeMo-RL's ZMQ refit, for every policy worker's socket at once (the
    workers block on each acknowledgement, so they are served together)."""

    def __init__(self, addresses: list[str], state_dict_info: dict):
        self.addresses = list(addresses)
        self.info = state_dict_info  # HF name → (shape, dtype), from the policy's prepare_refit_info
        self.payloads = [0] * len(self.addresses)  # staging buffers received, per worker

    def _unpack(self, payload) -> dict[str, torch.Tensor]:
        from nemo_rl.models.policy.utils import calculate_aligned_size
        from torch.multiprocessing.reductions import rebuild_tensor

        handle, names, used_bytes = payload
        buffer = rebuild_tensor(*handle[0])  # the staging buffer's bytes (a host tensor pickles them)
        out, offset = {}, 0
        for name in names:
            shape, dtype = self.info[name]
            size = dtype.itemsize * torch.Size(shape).numel()
            out[name] = buffer[offset : offset + size].view(dtype).view(torch.Size(shape)).clone()
            offset += calculate_aligned_size(size)
        if offset != used_bytes:
            raise RuntimeError(f"refit: {offset} bytes unpacked, the sender used {used_bytes} (names {names[:3]}...)")
        return out

    def receive(self, timeout_ms: int = 300_000) -> list[dict[str, torch.Tensor]]:
        """One state dict per worker, in worker order."""
        import zmq
        from nemo_rl.models.policy.utils import IPCProtocol

        ctx = zmq.Context()
        socks = []
        try:
            poller = zmq.Poller()
            for address in self.addresses:
                sock = ctx.socket(zmq.REP)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                poller.register(sock, zmq.POLLIN)
                socks.append(sock)
            got: list[dict] = [{} for _ in socks]
            done: set[int] = set()
            while len(done) < len(socks):
                ready = dict(poller.poll(timeout_ms))
                if not ready:
                    raise TimeoutError(
                        f"refit: no weights from workers {sorted(set(range(len(socks))) - done)} within {timeout_ms} ms"
                    )
                for i, sock in enumerate(socks):
                    if sock not in ready:
                        continue
                    payload = sock.recv_pyobj()
                    if payload == IPCProtocol.COMPLETE:
                        done.add(i)
                        poller.unregister(sock)
                    else:
                        got[i].update(self._unpack(payload))
                        self.payloads[i] += 1
                    sock.send(IPCProtocol.ACK.value.encode())
            return got
        finally:
            for sock in socks:
                sock.close()
            ctx.term()
