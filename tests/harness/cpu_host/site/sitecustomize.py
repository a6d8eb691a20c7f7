"""Run at start-up by every Python process whose PYTHONPATH has this folder first: the test
drivers of tests/harness/cpu_host and every Ray worker they start (NeMo-RL forwards the driver's
environment to its actors).

0. In a Ray worker or a loop driver of a head with a zygote (``NEMO_GRANULAR_RAY_ZYGOTE``): the process is
   forked from it (``cpu_host/worker_zygote.py``); this one waits for it.
1. The typing shim of tests/harness/host_shims/typing_shim (only one ``sitecustomize`` runs per process).
2. With ``NEMO_GRANULAR_CPU_HOST=1``: the lazy CPU stand-ins (tests/harness/cpu_host/hooks.py).
"""

import os
import sys

_tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.environ.get("NEMO_GRANULAR_RAY_ZYGOTE"):
    # a Ray worker or a loop driver: forked from the head's zygote (cpu_host/worker_zygote.py), unless it cannot take it
    sys.path.append(_tests)
    from cpu_host.worker_zygote import delegate, forked_command

    if (_command := forked_command()) is not None:
        delegate(os.environ["NEMO_GRANULAR_RAY_ZYGOTE"], _command)
    sys.path.remove(_tests)
exec(
    compile(
        open(os.path.join(_tests, "host_shims", "typing_shim", "sitecustomize.py")).read(),
        "typing_shim_sitecustomize",
        "exec",
    )
)
if os.environ.get("NEMO_GRANULAR_CPU_HOST") == "1":
    if _tests not in sys.path:
        sys.path.append(_tests)
    from cpu_host import hooks

    hooks.install()
