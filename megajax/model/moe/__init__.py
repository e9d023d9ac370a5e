"""Mixture of experts: a router sends each token to k of E expert MLPs (Mixtral / DeepSeek style).

Dimension letters as in megajax/model/layers.py, plus t tokens (b x s flattened), e experts, a routed assignments
(t k).

One concept per module, each importing only those above it:

- routing.py: `Routing` and `route` (fp32 logits -> each token's k experts and weights), the load-balancing and
  z losses and `attach_loss`, which adds them to the gradient where they are computed; the statistics channel
  (`STATS`, `report`, `step_stats`) and DeepSeek-V3's routing bias (`ROUTER_BIAS`, `update_router_bias`).
- exchange.py: the assignments sorted by expert and back (`dispatch`, `combine`), the capacity buffers
  (`capacity`, `to_buffers`, `from_buffers`), and the rows' exchanges across the expert ranks: padded all-to-all
  (`exchange_capacity`, `exchange_dropless`), folded over 'expert' x 'tensor' (`exchange_folded`,
  `exchange_folded_dropless`) and ragged (`ragged_move`, `ragged_plan`, `receive_rows`), as the step plan in force
  sets them (`Exchange`, `folds`, `expert_parallel_size`).
- layer.py: the expert MLPs (`expert_mlps`), the routed tokens through them and back (`run_experts`) and the flax
  layer `MoE`.

The public names are re-exported here, so callers write `from megajax.model import moe` and `moe.route(...)`.
"""

from megajax.model.moe.routing import (ROUTER_BIAS, STATS, Routing, attach_loss, load_balancing_loss, report, route,
                                       step_stats, update_router_bias, z_loss)
from megajax.model.moe.exchange import (Exchange, buffer_rows, capacity, combine, dispatch, dropless_bound,
                                        exchange_capacity, exchange_dropless, exchange_folded,
                                        exchange_folded_dropless, expert_parallel_size, folded_all_to_all, folds,
                                        from_buffers, ragged_move, ragged_plan, receive_rows, to_buffers)
from megajax.model.moe.layer import MoE, expert_mlps, run_experts

__all__ = ["ROUTER_BIAS", "STATS", "Routing", "attach_loss", "load_balancing_loss", "report", "route", "step_stats",
           "update_router_bias", "z_loss",
           "Exchange", "buffer_rows", "capacity", "combine", "dispatch", "dropless_bound", "exchange_capacity",
           "exchange_dropless", "exchange_folded", "exchange_folded_dropless", "expert_parallel_size",
           "folded_all_to_all", "folds", "from_buffers", "ragged_move", "ragged_plan", "receive_rows", "to_buffers",
           "MoE", "expert_mlps", "run_experts"]
