"""The step plan (megajax/parallel/step_plan.py): every parallel decision resolved once from the config, over the whole
layout space (no compilation: each case builds a config and its plan), and megajax's one context variable."""

import ast
import itertools
import pathlib
import re

import jax
import pytest

from conftest import REPO, small_config
from megajax.config import ConfigError
from megajax.parallel import sharding, step_plan
from megajax.parallel.pipeline import ticks
from megajax.parallel.step_plan import MANUAL, StepPlan

# The layout space: every mesh shape of up to 16 devices below, each with every setting that decides something
# (alone, and the combinations that need each other); a layout the config refuses is skipped.
SIZES = {"parallel.data": [1, 2, 4], "parallel.expert": [1, 2], "parallel.pipeline": [1, 2],
         "parallel.context": [1, 2, 4], "parallel.tensor": [1, 2]}
SETTINGS = [
    {},
    {"parallel.sequence_parallel": True},
    {"parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True},
    {"parallel.sequence_parallel": True, "parallel.expert_tensor": 1},
    {"parallel.sequence_parallel": True, "parallel.expert_tensor": 1, "parallel.expert_all_to_all": "ragged"},
    {"parallel.expert_all_to_all": "ragged"},
    {"parallel.context_comm": "ring"},
    {"parallel.context_comm": "all_gather"},
    {"parallel.context_comm": "a2a"},
    {"parallel.context_comm": "a2a+ring"},
    {"parallel.context_comm": "a2a+all_gather"},
    {"parallel.distributed_optimizer": True},
    {"parallel.overlap_grad_reduce": True},
    {"parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True},
    {"parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True,
     "parallel.overlap_param_gather": True},
    {"parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "parallel.distributed_optimizer": True,
     "parallel.overlap_grad_reduce": True, "parallel.overlap_param_gather": True},
    {"parallel.schedule": "zero_bubble", "parallel.virtual_stages": 2},
    {"parallel.data_parallel_sharding_strategy": "optim_grads"},
    {"parallel.data_parallel_sharding_strategy": "optim_grads", "parallel.overlap_param_gather": True},
    {"parallel.data_parallel_sharding_strategy": "optim_grads_params"},
]
ZERO_STAGE = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _layouts():
    keys = list(SIZES)
    for values, settings in itertools.product(itertools.product(*SIZES.values()), SETTINGS):
        overrides = {**dict(zip(keys, values)), **settings}
        devices = (overrides["parallel.data"] * overrides["parallel.pipeline"] * overrides["parallel.context"]
                   * overrides["parallel.tensor"])
        try:
            cfg = small_config(**overrides, **{"model.num_layers": 4, "model.num_experts": 4,
                                               "model.experts_per_token": 2, "train.global_batch_size": 16})
            cfg = cfg.for_devices(devices)
        except ConfigError:
            continue
        yield cfg, devices


def test_every_layout_resolves_to_one_consistent_plan():
    """Each valid layout of the space: the plan's sizes are the mesh's, its manual axes those with more than one
    device, and each decision follows its rule (the table in docs/design/step-plan.md)."""
    seen = 0
    engines, comms, overlaps = set(), set(), set()
    for cfg, devices in _layouts():
        par, plan = cfg.parallel, StepPlan.resolve(cfg)
        seen += 1
        if devices <= len(jax.devices()):
            mesh = sharding.make_mesh(par, jax.devices()[:devices])
            assert dict(mesh.shape) == {a: getattr(plan, a) for a in step_plan.AXES}
        sizes = {a: getattr(plan, a) for a in MANUAL}
        assert plan.manual == tuple(a for a in MANUAL if sizes[a] > 1)
        assert plan.data * plan.expert == par.data and plan.pipelined == (par.pipeline > 1)
        zero = ZERO_STAGE[par.sharding_strategy] if par.data * par.context > 1 else 0
        assert plan.zero_stage == zero and plan.shard_optimizer == (zero > 0)
        assert plan.engine == ("pipelined" if par.pipeline > 1 else "sharded" if zero >= 2 else "overlapped"
                               if par.overlap_grad_reduce and par.data > 1 else "plain")
        assert plan.context_comm == (par.context_comm if par.context_comm != "auto"
                                     else "all_gather" if par.pipeline > 1 else "ring")
        assert plan.context_a2a == (par.context if plan.context_comm == "a2a" else cfg.context_a2a_size
                                    if plan.context_comm in ("a2a+ring", "a2a+all_gather") else 1)
        assert plan.tp_overlap == (None if not par.tp_comm_overlap else "chunks" if par.pipeline > 1 else "ring")
        assert plan.moe_folds == (par.tensor if par.expert_tensor == 1 else 1)
        assert plan.gather_in_forward <= plan.reduce_in_backward
        assert plan.micro_batches == cfg.num_micro_batches and plan.stage_split == cfg.stage_split
        if plan.pipelined and par.schedule in ("1f1b", "interleaved"):  # the ticks read the same decisions
            assert (ticks.reduce_layers(plan) > 0) == plan.reduce_in_backward
            assert (ticks.gather_layers(plan) > 0) == plan.gather_in_forward
        engines.add(plan.engine)
        comms.add(plan.context_comm)
        overlaps.add(plan.tp_overlap)
    assert seen > 150, seen  # the space is really covered, not refused wholesale
    assert engines == {"plain", "overlapped", "sharded", "pipelined"}
    assert comms == {"ring", "all_gather", "a2a", "a2a+ring", "a2a+all_gather"}
    assert overlaps == {None, "ring", "chunks"}


def test_an_unresolved_config_is_refused():
    with pytest.raises(ValueError, match="Config.for_devices"):
        StepPlan.resolve(small_config())


def test_the_plan_in_force_is_the_innermost_and_outside_a_step_one_device():
    assert step_plan.current() is None and step_plan.in_force() is step_plan.ONE_DEVICE
    outer, inner = StepPlan(tensor=2), StepPlan(context=2)
    with step_plan.use(outer):
        with step_plan.use(inner):
            assert step_plan.current() is inner
        assert step_plan.current() is outer
    assert step_plan.current() is None


def test_megajax_has_one_context_variable_and_the_model_reads_no_mesh():
    """The step plan is megajax's one trace-time context; model code asks the plan, never the mesh, for a
    decision (step_plan.current_manual_axes answers only "is this axis manual in the current region")."""
    sources = {p: p.read_text() for p in (pathlib.Path(REPO) / "megajax").rglob("*.py")}
    holders = [p.name for p, text in sources.items() if re.search(r"ContextVar\(", text)]
    assert holders == ["step_plan.py"]
    readers = [p.name for p, text in sources.items() if "model" in p.parts and "get_abstract_mesh" in text]
    assert readers == []


def _parallel_imports(tree) -> set[str]:
    """The modules of megajax.parallel a module's ast imports (`from megajax.parallel import x` names module x)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megajax.parallel")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megajax.parallel"):
            found |= ({f"{node.module}.{a.name}" for a in node.names} if node.module == "megajax.parallel"
                      else {node.module})
    return found


def test_the_model_and_the_kernels_reach_parallel_only_through_the_plan():
    """model/ and kernels/ import megajax.parallel.step_plan and no other module of parallel/: the mesh, the
    region's reductions and order, the engines and the pipeline sit below the model and call it."""
    root = pathlib.Path(REPO) / "megajax"
    found = {f"{path.relative_to(root)}: {module}"
             for package in ("model", "kernels") for path in sorted((root / package).rglob("*.py"))
             for module in _parallel_imports(ast.parse(path.read_text()))
             if module != "megajax.parallel.step_plan"}
    assert found == set()
    code = ("from megajax.parallel import sharding, step_plan\nfrom megajax.parallel.pipeline.layout import x\n"
            "import megajax.parallel.overlap")
    assert _parallel_imports(ast.parse(code)) == {"megajax.parallel.sharding", "megajax.parallel.step_plan",
                                                  "megajax.parallel.pipeline.layout", "megajax.parallel.overlap"}


# Below the step's build, a parallel decision is read from the plan, never from the config: these read the config's
# parallel section by design (the plan's resolution, the mesh, the schedule CLI's flags from a config).
READS_CONFIG = {("parallel/step_plan.py", "resolve"), ("parallel/pipeline/schedule_cli.py", "config_costs")}
PARALLEL_KEYS = {"parallel", "num_micro_batches", "stage_split"}  # the section, and what the config derives from it
CONFIGS = {"cfg", "config"}  # the names a config goes by (the plan has stage_split and micro_batches too)


def _reads_config(node) -> bool:
    """Whether an ast node reads the config's parallel section, or a value Config derives from it."""
    if not isinstance(node, ast.Attribute) or node.attr not in PARALLEL_KEYS:
        return False
    base = node.value
    return node.attr == "parallel" or getattr(base, "id", getattr(base, "attr", None)) in CONFIGS


def test_nothing_below_the_build_reads_the_parallel_config():
    """megajax/parallel/, megajax/model/ and megajax/kernels/ take every parallel decision from the step plan: an
    attribute read of the config's parallel section (or of what Config derives from it) anywhere else there fails."""
    root = pathlib.Path(REPO) / "megajax"
    found = []
    for package in ("parallel", "model", "kernels"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()

            def walk(node, function=None, rel=rel):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    function = node.name
                if _reads_config(node) and (rel, function) not in READS_CONFIG:
                    found.append(f"{rel}:{node.lineno} ({function}): .{node.attr}")
                for child in ast.iter_child_nodes(node):
                    walk(child, function)

            walk(ast.parse(path.read_text()))
    assert found == []


def test_the_guard_sees_a_read():
    """The walk above finds a read where there is one (it is not vacuous)."""
    reads = lambda code: [n.attr for n in ast.walk(ast.parse(code)) if _reads_config(n)]  # noqa: E731
    assert sorted(reads("def f(cfg):\n    return cfg.parallel.tensor, self.cfg.stage_split, plan.stage_split\n")) == [
        "parallel", "stage_split"]
    assert reads("m = config.num_micro_batches; n = plan.micro_batches") == ["num_micro_batches"]


MODULE_LINES, FUNCTION_LINES = 600, 80  # a module a reader takes in whole, a function one screen


def _oversized(path: pathlib.Path, text: str) -> list[str]:
    """The module itself where it is over MODULE_LINES lines, and each function over FUNCTION_LINES (its
    docstring and nested functions included)."""
    found = [f"{path}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_over_600_lines_and_no_function_over_80():
    """Every module of megajax fits a reader's one sitting and every function one screen: split a module by
    concern, or a function into named steps, rather than raise the limits."""
    root = pathlib.Path(REPO) / "megajax"
    found = [line for path in sorted(root.rglob("*.py"))
             for line in _oversized(path.relative_to(root), path.read_text())]
    assert found == []


def test_the_size_guard_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    assert _oversized(pathlib.Path("m.py"), f"def f():\n{body}\n") == ["m.py:1 f: 81 lines"]
    assert len(_oversized(pathlib.Path("m.py"), "x = 1\n" * (MODULE_LINES + 1))) == 1
