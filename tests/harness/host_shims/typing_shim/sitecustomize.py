"""Python < 3.12 compatibility for running NeMo-RL (written for 3.13) in the test environment.

Put this folder on PYTHONPATH (tests/conftest.py does, for the test process and its
subprocesses) when NEMO_RL_SRC is set. NeMo-RL declares ``typing.TypedDict`` configs that
pydantic validates, and pydantic only accepts ``typing_extensions.TypedDict`` before 3.12;
``typing.override`` appeared in 3.12. On 3.12+ this does nothing.
"""

import sys

if sys.version_info < (3, 12):
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict
    typing.override = typing_extensions.override
    typing.NotRequired = typing_extensions.NotRequired
