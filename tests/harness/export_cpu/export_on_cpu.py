"""``nemo-granular export ARGS`` in a process with the shared CPU stand-ins installed.

    python tests/harness/export_cpu/export_on_cpu.py SRC OUT [export options]

For checkpoints whose Megatron model cannot be built on a host without a GPU even in one process:
Megatron's YaRN rotary embedding asks ``torch.cuda.current_device()`` while it is constructed
(``YarnRotaryEmbedding._set_cos_sin_cache`` → ``get_emb``), which :mod:`cpu_stand_ins.torch_cuda`
answers. Everything else is the export as a user runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/, as under pytest
    import cpu_stand_ins

    cpu_stand_ins.install()
    from nemo_granular.cli import main

    sys.exit(main(["export", *sys.argv[1:]]))
