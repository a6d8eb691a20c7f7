"""One batch schema (``nemo_granular.batch_schema.POLICY_BATCH``): the policy loss reads no key it does
not declare, every key it declares as read is read, and the trainer and the tests' batch contract
take their key lists from it.

Two ways: the source of ``read_policy_batch`` and its helpers (every branch, whatever the config), and
the loss run on a recording mapping under configs that reach every optional key."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

import reference as R
from nemo_granular import GranularPolicyLoss
from nemo_granular.batch_schema import GUARANTEED_KEYS, LOSS_KEYS, POLICY_BATCH, policy_key

LOSSES = Path(__file__).resolve().parents[1] / "nemo_granular" / "losses.py"
READERS = ("read_policy_batch", "_group_keys", "_penalty_keys")  # the functions that read ``data``


def _keys_in_source() -> dict[str, int]:
    """key → line of every string key the readers take from ``data``: ``data[k]``, ``k in data``,
    ``data.get(k)`` and ``_key(data, k, ...)``."""
    tree = ast.parse(LOSSES.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in READERS]
    assert sorted(f.name for f in funcs) == sorted(READERS), "a reader of the batch was renamed: update READERS"
    found: dict[str, int] = {}

    def is_data(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "data"

    def const(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for func in funcs:
        for node in ast.walk(func):
            key = None
            if isinstance(node, ast.Subscript) and is_data(node.value):
                key = const(node.slice)
            elif isinstance(node, ast.Compare) and any(is_data(c) for c in node.comparators):
                key = const(node.left)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_data(node.func.value):
                key = const(node.args[0]) if node.args else None
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_key" and len(node.args) > 1:
                key = const(node.args[1])
            if key is not None:
                found.setdefault(key, node.lineno)
    return found


def test_every_key_the_loss_reads_is_declared_and_every_declared_key_is_read():
    read = _keys_in_source()
    undeclared = {k: f"nemo_granular/losses.py:{line}" for k, line in read.items() if k not in LOSS_KEYS}
    assert not undeclared, f"the loss reads keys nemo_granular/batch_schema.py does not declare: {undeclared}"
    unread = sorted(set(LOSS_KEYS) - set(read))
    assert not unread, f"batch_schema declares {unread} as read by the loss, but read_policy_batch never reads them"


class Recording(Mapping):
    """A batch that records every key asked for (item, membership, ``get``)."""

    def __init__(self, data):
        self.data, self.asked = dict(data), set()

    def __getitem__(self, key):
        self.asked.add(key)
        return self.data[key]

    def __contains__(self, key):
        self.asked.add(key)
        return key in self.data

    def get(self, key, default=None):
        self.asked.add(key)
        return self.data.get(key, default)

    def __iter__(self):
        raise AssertionError("the loss must ask for keys by name, not iterate the batch")

    def __len__(self):
        return len(self.data)


@pytest.mark.parametrize(
    "cfg,extra",
    [
        # segments cut in the loss from input_ids; the KL and NLL penalties with their optional keys
        (
            {"granular": {"algorithm": "sspo"}, "reference_policy_kl_penalty": 0.1, "positive_example_nll_weight": 0.5},
            ("rewards", "curr_logprobs_unfiltered"),
        ),
        ({"granular": {"algorithm": "espo", "espo": {"vocab_size": 16, "alpha": 1.0}}}, ("granular_group_ids",)),
        ({"granular": {"algorithm": "gspo"}, "use_importance_sampling_correction": True}, ()),
    ],
)
def test_the_loss_asks_only_for_declared_keys(cfg, extra):
    from nemo_granular.core.groups import group_ids_for

    data, logp, gvs, gvt = R.make_batch(B=4, S=12, V=16, seed=3)
    fn = GranularPolicyLoss(cfg, delimiter_table=R.delimiter_table(16))
    if "rewards" in extra:
        data["rewards"] = (data["sample_mask"] > 0).float()
    if "curr_logprobs_unfiltered" in extra:
        data["curr_logprobs_unfiltered"] = logp.clone()
    if "granular_group_ids" in extra:
        data["granular_group_ids"] = group_ids_for(
            fn.granular.granularity,
            data["token_mask"] > 0,
            entropy=data["prev_entropy"],
            entropy_cut_points=fn.granular.entropy_cut_points,
        )
    batch = Recording(data)
    fn(next_token_logprobs=logp, data=batch, global_valid_seqs=gvs, global_valid_toks=gvt)
    assert batch.asked <= set(LOSS_KEYS), sorted(batch.asked - set(LOSS_KEYS))
    assert {"token_mask", "sample_mask", "advantages", "prev_logprobs", *extra} <= batch.asked


def test_the_trainer_and_the_contract_take_their_keys_from_the_schema():
    import contract
    from nemo_granular.embedded.trainer import BATCH_KEYS

    names = [k.name for k in POLICY_BATCH]
    assert len(set(names)) == len(names)
    assert contract.POLICY_KEYS == GUARANTEED_KEYS
    assert set(BATCH_KEYS) <= set(names) and set(GUARANTEED_KEYS) <= set(BATCH_KEYS)
    for key in POLICY_BATCH:
        assert key.shape in ("[B]", "[B, S]", "[B, S-1]") and key.owner in ("NeMo-RL", "ours"), key
        assert not key.guaranteed or key.read_when, f"{key.name}: a guaranteed key the loss never reads"
    assert policy_key("granular_group_ids").dtype == "int32"
    with pytest.raises(KeyError, match="not a key of the policy batch"):
        policy_key("prompt_ids")
