"""The functional core: pure tensor functions, one per formula of docs/algorithms/math.md."""

from .advantages import *  # noqa: F403
from .aggregation import *  # noqa: F403
from .clipping import *  # noqa: F403
from .entropy import *  # noqa: F403
from .groups import *  # noqa: F403
from .objective import *  # noqa: F403
from .offpolicy import *  # noqa: F403
from .ratios import *  # noqa: F403
