"""``nnx-shard plan`` of Mixtral 8x7B under ``fsdp_ep`` on 64 devices: the planner's
per-device state is XLA's, and its formula stays under the compiled total (what lets
``plan --auto`` prune by the formula)."""

import json
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_shard import cli
from nnx_shard.models import get_config
from nnx_shard.models._named import build


@pytest.mark.slow
def test_plan_of_mixtral_under_fsdp_ep_on_64_devices(capsys):
    model = nnx.eval_shape(lambda: build(get_config("mixtral-8x7b"), nnx.Rngs(0)))
    experts = rest = 0
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        if re.search(r"'mlp'\]\['(gate|up|down)'\]", jax.tree_util.keystr(path)):
            experts += nbytes
        else:
            rest += nbytes
    code = cli.main(["plan", "--model", "mixtral-8x7b", "--strategy", "fsdp_ep", "--mesh",
                     "data=8,expert=8", "--batch", "64", "--seq", "256", "--remat", "full",
                     "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)
    per, compiled = plan["bytes_per_device"], plan["compiled"]
    # Every expert matrix over all 64 devices (expert x data), everything else over data.
    assert per["params"] == experts // 64 + rest // 8 == compiled["params"]
    assert plan["replicated_params"] == 0
    # The state the formula counts (parameters, AdamW's two moments) is what XLA's
    # compiled step takes as arguments per device (plus the batch: a few KiB).
    state = per["params"] + per["optimizer"]
    assert abs(state - compiled["argument"]) <= 0.15 * compiled["argument"], (state, compiled)
    assert plan["decided_by"] == "compiled" and plan["bytes_needed"] == compiled["total"]
    # The formula is under the compiled total (it counts the dispatch and combine buffers
    # over the dropless receive rows, not XLA CPU's float32 copies of the bfloat16 weights
    # and block inputs), so the search never prunes a layout that would have fit by it.
    assert per["total"] <= compiled["total"]
