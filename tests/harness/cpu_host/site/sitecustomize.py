"""Run at start-up by every Python process whose PYTHONPATH has this folder first: the test
drivers of tests/harness/cpu_host and every Ray worker they start (NeMo-RL forwards the driver's
environment to its actors).

1. The typing shim of tests/harness/host_shims/typing_shim (only one ``sitecustomize`` runs per process).
2. With ``NEMO_GRANULAR_CPU_HOST=1``: the lazy CPU stand-ins (tests/harness/cpu_host/hooks.py).
"""

import os
import sys

_tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
exec(compile(open(os.path.join(_tests, "host_shims", "typing_shim", "sitecustomize.py")).read(),
             "typing_shim_sitecustomize", "exec"))
if os.environ.get("NEMO_GRANULAR_CPU_HOST") == "1":
    if _tests not in sys.path:
        sys.path.append(_tests)
    from cpu_host import hooks

    hooks.install()
