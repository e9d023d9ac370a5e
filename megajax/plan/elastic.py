"""A layout for the devices a run has now (train.elastic): after a lost host the run restarts on fewer devices than
its layout names, and takes the planner's best layout for them at the same global batch.

Every process makes the same choice from the same inputs (the config, the device count and kind), so the mesh
agrees without a collective. The checkpoint restores onto any layout and the batches depend only on the samples
consumed, so the run goes on as it would have.
"""

from __future__ import annotations

from megajax.config import Config, ConfigError

TARGETS = {"H100": "h100", "H200": "h200", "A100": "a100"}  # device_kind's GPU name -> planner target


def target_for(device_kind: str) -> tuple[str, str]:
    """(planner target, a note) for a device kind; CPU devices and unknown GPUs are planned as H100s."""
    for name, target in TARGETS.items():
        if name in device_kind.upper():
            return target, ""
    return "h100", f" (planned as H100s: the {device_kind} devices have no target)"


def fits(cfg: Config, num_devices: int) -> bool:
    try:
        cfg.for_devices(num_devices)
        return True
    except ConfigError:
        return False


def refit(cfg: Config, num_devices: int, per_node: int, device_kind: str) -> tuple[Config, str]:
    """`cfg` on the planner's best layout for `num_devices` (per_node a node) at its global batch, and one line
    that says so; ConfigError where none fits."""
    from megajax.plan.hardware import hardware
    from megajax.plan.search import search

    p = cfg.parallel
    target, note = target_for(device_kind)
    result = search(cfg, hardware(target), num_devices, per_node, fixed={})
    if not result["ranked"]:
        raise ConfigError(f"train.elastic: no layout of the model fits {num_devices} devices at global batch "
                          f"{cfg.train.global_batch_size}; add devices or lower train.global_batch_size")
    best = result["ranked"][0].cfg
    b = best.parallel
    was = f"data={p.data} pipeline={p.pipeline} context={p.context} tensor={p.tensor}"
    now = (f"data={b.data} pipeline={b.pipeline} context={b.context} tensor={b.tensor}"
           f"{' sp' if b.sequence_parallel else ''} {b.data_parallel_sharding_strategy}, micro batch "
           f"{best.train.micro_batch_size}, recompute {best.model.recompute}")
    line = (f"train.elastic: {num_devices} devices where the layout ({was}) needs another count: training on the "
            f"planner's best for {num_devices} at global batch {cfg.train.global_batch_size}: {now}{note}")
    return best, line
