"""The functional core: pure tensor functions of docs/algorithms/math.md, in two faces.

**What the loss runs** (:class:`~nemo_granular.losses.GranularPolicyLoss`, in this order):
:mod:`.objective` — group ratios (§2), surrogate terms (§4), aggregation weights (§5), the
objective and its gradient in closed form, per token or per group; :mod:`.clipping` — the clip
bounds (§3) and the clipped surrogate's terms; :mod:`.group_index` — the :class:`GroupIndex`
protocol of the group sums and gathers and its three indexes (:mod:`.scatter_index` the scatter
plan); :mod:`.offpolicy` — the π_old/π_gen weights, truncations and the KL penalty (§10);
:mod:`.masks` — the compute dtype and 0/1 masks; :mod:`.linearized_loss` — the scalar autograd
sees; :mod:`.diagnostics` — NeMo-RL's π_old-vs-π_gen metrics. Beside them, for the hosts:
:mod:`.groups` (group ids, §1), :mod:`.entropy` (the π_old pass), :mod:`.advantages` (§6, §7).

**The reference**: :mod:`.reference_forms` — the same formulas written as the papers write them,
autograd giving every gradient; the loss does not run them, the tests check the closed forms
against them (and them against the naive float64 ``tests/harness/reference.py``).
"""

from .advantages import *  # noqa: F403
from .clipping import *  # noqa: F403
from .diagnostics import *  # noqa: F403
from .entropy import *  # noqa: F403
from .group_index import *  # noqa: F403
from .groups import *  # noqa: F403
from .linearized_loss import *  # noqa: F403
from .masks import *  # noqa: F403
from .objective import *  # noqa: F403
from .offpolicy import *  # noqa: F403
from .reference_forms import *  # noqa: F403
from .scatter_index import *  # noqa: F403
