"""Collectives that the ranks of one group may reach by different paths: a check of the traced train step.

A collective inside a conditional runs only on the ranks that take its branch. If the ranks of the collective's
group can disagree on the predicate, some of them wait in it while the others do not come: on GPUs the step hangs
with no timeout, on CPU devices XLA aborts it after its rendezvous timeout. `check(jaxpr)` finds every such place
in a traced program without running it: a collective inside a conditional (or a loop whose trip count is data)
whose group spans a mesh axis the predicate may differ over, unless every branch runs the same collectives in
the same order.

Which axes a value may differ over is a forward dataflow over the jaxpr ("taint"):
- `axis_index(a)` differs over a; an argument of a shard_map region, over the manual axes its spec splits it over;
- a collective over axes A leaves its result the same over A where it sums or gathers (psum, pmax, pmin,
  all_gather, pbroadcast) and makes it differ over A where it hands each rank its own part (ppermute,
  reduce_scatter, all_to_all, ragged_all_to_all);
- a conditional's results differ wherever its predicate or a branch's result does; loops iterate to a fixed
  point; values it can prove constant are the same everywhere (`sharding.CollectiveOrder`'s gate selects x
  by `last < -inf`, false whatever last is);
- everything else: the union of its operands.
Collectives over axes that GSPMD partitions ('tensor' outside a nested shard_map) are not in the jaxpr, and need
no check: GSPMD makes every predicate the same on the ranks of such an axis.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax.extend import core as jcore

# collective primitive -> (its axes parameter, what it leaves: "same" over its axes, or "own" part per rank)
COLLECTIVES = {
    "psum": ("axes", "same"), "psum_invariant": ("axes", "same"), "pmax": ("axes", "same"),
    "pmin": ("axes", "same"), "all_gather": ("axis_name", "same"), "all_gather_invariant": ("axis_name", "same"),
    "pbroadcast": ("axis_name", "same"), "ppermute": ("axis_name", "own"), "reduce_scatter": ("axis_name", "own"),
    "all_to_all": ("axis_name", "own"), "ragged_all_to_all": ("axis_name", "own"),
}


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A collective the ranks of its group may reach by different paths."""

    where: str  # the name scope of the conditional or loop (e.g. pipeline_s1t0_h1)
    predicate_axes: tuple[str, ...]  # the axes its predicate may differ over
    collective: str  # primitive name
    axes: tuple[str, ...]  # its group's axes

    def __str__(self) -> str:
        return (f"{self.collective} over {', '.join(self.axes)} inside {self.where or 'a conditional'}, whose "
                f"predicate may differ over {', '.join(self.predicate_axes)}")


def _axes(eqn) -> frozenset:
    value = eqn.params[COLLECTIVES[eqn.primitive.name][0]]
    return frozenset(a for a in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(a, str))


def _inner(value):
    """A (Closed)Jaxpr parameter's Jaxpr, or None."""
    inner = getattr(value, "jaxpr", value)
    return inner if isinstance(inner, jcore.Jaxpr) else None


def _spec_axes(spec, manual) -> frozenset:
    out = set()
    for entry in spec if spec is not None else ():
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a in manual:
                out.add(a)
    return frozenset(out)


_SAME_VALUE = {"pvary", "broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "copy"}


class _Walk:
    """The dataflow. Each value is (taint, constant): the axes it may differ over, and the scalar every element
    of it holds where the walk can prove one (else None): literals, carried through casts, broadcasts and calls;
    `x < -inf` is false whatever x is (`sharding.CollectiveOrder`'s gate), and a select by a known predicate is
    its case. A constant is the same everywhere."""

    def __init__(self):
        self.found: dict[tuple, Divergence] = {}
        self.guarded: list[tuple[str, frozenset, frozenset]] = []  # (where, predicate axes, collective axes)

    def run(self, jaxpr: jcore.Jaxpr, ins: list[tuple], manual: frozenset) -> list[tuple]:
        env: dict = {}

        def read(v) -> tuple:
            if isinstance(v, jcore.Literal):
                val = np.asarray(v.val)
                return frozenset(), val.item() if val.size == 1 else None
            return env.get(v, (frozenset(), None))

        for v, x in zip(jaxpr.invars, ins):
            env[v] = x
        for eqn in jaxpr.eqns:
            for v, x in zip(eqn.outvars, self.eqn(eqn, [read(v) for v in eqn.invars], manual)):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list[tuple], manual: frozenset) -> list[tuple]:
        name, params = eqn.primitive.name, eqn.params
        taints, vals = [t for t, _ in ins], [c for _, c in ins]
        n = len(eqn.outvars)
        if name in _SAME_VALUE and vals[0] is not None:
            return [(frozenset(), np.asarray(vals[0]).astype(eqn.outvars[0].aval.dtype).item())]
        if name == "lt" and vals[1] == float("-inf"):
            return [(frozenset(), False)]
        if name == "select_n" and vals[0] is not None:
            return [ins[1 + int(vals[0])]]
        if name == "axis_index":
            return [(frozenset({params["axis_name"]}) & manual, None)]
        if name in COLLECTIVES:
            axes = _axes(eqn) & manual
            keep = (lambda t: t - axes) if COLLECTIVES[name][1] == "same" else (lambda t: t | axes)
            if len(ins) == n:
                return [(keep(t), None) for t in taints]
            return [(keep(frozenset().union(*taints)), None)] * n
        if name == "cond":
            return self.cond(eqn, ins, manual)
        if name == "scan":
            return self.scan(eqn, ins, manual)
        if name == "while":
            return self.while_(eqn, ins, manual)
        if name == "shard_map":
            more = manual | frozenset(params.get("newly_manual_axes", ()) or params.get("axis_names", ()))
            out = self.run(_inner(params["jaxpr"]), [(t | _spec_axes(s, more), c) for (t, c), s in
                                                      zip(ins, params["in_specs"])], more)
            return [(t - (more - manual), c) for t, c in out]  # (outside, the region's axes are GSPMD's again)
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            inner = _inner(params.get(key))
            if inner is not None and len(inner.invars) == len(ins) and len(inner.outvars) == n:
                return self.run(inner, ins, manual)
        return [(frozenset().union(*taints), None)] * n

    def cond(self, eqn, ins, manual):
        pred, ops = ins[0], ins[1:]
        branches = [_inner(b) for b in eqn.params["branches"]]
        if pred[1] is not None:  # (a known branch)
            return self.run(branches[min(max(int(pred[1]), 0), len(branches) - 1)], ops, manual)
        outs = [self.run(b, ops, manual) for b in branches]
        self.check(eqn, pred[0], branches)
        return [(pred[0].union(*(t for t, _ in xs)), None) for xs in zip(*outs)]

    def _fixed_point(self, body, head, carry, tail, manual, nk):
        """Runs a loop body until the carry's taints stop growing (they only grow, over the manual axes)."""
        carry = [(t, None) for t, _ in carry]
        for _ in range(len(manual) + 2):
            out = self.run(body, [*head, *carry, *tail], manual)
            grown = [(a | b, None) for (a, _), (b, _) in zip(carry, out[:nk])]
            if grown == carry:
                break
            carry = grown
        return carry, out

    def scan(self, eqn, ins, manual):
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        xs = [(t, None) for t, _ in ins[nc + nk:]]
        carry, out = self._fixed_point(_inner(eqn.params["jaxpr"]), ins[:nc], ins[nc:nc + nk], xs, manual, nk)
        return [*carry, *[(t, None) for t, _ in out[nk:]]]

    def while_(self, eqn, ins, manual):
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        body, test = _inner(eqn.params["body_jaxpr"]), _inner(eqn.params["cond_jaxpr"])
        carry, _ = self._fixed_point(body, ins[cn:cn + bn], ins[cn + bn:], [], manual, len(ins) - cn - bn)
        pred = self.run(test, [*ins[:cn], *carry], manual)[0][0]
        self.check(eqn, pred, [body], loop=True)
        return [(t | pred, None) for t, _ in carry]

    def check(self, eqn, pred: frozenset, bodies, loop: bool = False):
        """Every manual collective under `eqn` whose axes meet the predicate's: a divergence, unless (a
        conditional) every branch runs the same sequence of collectives."""
        seqs = [list(_collectives(b)) for b in bodies]
        where = str(eqn.source_info.name_stack)
        self.guarded.append((where, pred, frozenset().union(*(axes for seq in seqs for _, axes in seq))))
        if not pred or (not loop and all(s == seqs[0] for s in seqs)):
            return
        for seq in seqs:
            for prim, axes in seq:
                if axes & pred:
                    d = Divergence(where, tuple(sorted(pred)), prim, tuple(sorted(axes)))
                    self.found.setdefault((where, prim, d.axes, d.predicate_axes), d)


def eqns(jaxpr: jcore.Jaxpr):
    """Every equation of a jaxpr and of the jaxprs its equations hold (conditional branches, loop bodies, calls),
    each before those inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = _inner(sub)
                if inner is not None:
                    yield from eqns(inner)


def _collectives(jaxpr: jcore.Jaxpr):
    """(primitive, axes) of every collective in a jaxpr and the jaxprs it holds, in order."""
    return ((e.primitive.name, _axes(e)) for e in eqns(jaxpr) if e.primitive.name in COLLECTIVES)


def check(jaxpr, guarded: list | None = None) -> list[Divergence]:
    """The collectives of a traced program (a Jaxpr or ClosedJaxpr, e.g. `jit(step).trace(...).jaxpr`) that
    ranks of their group may reach by different paths. `guarded`, if given, receives (name scope, predicate
    axes, axes of the collectives inside) of every conditional and loop with a data-dependent trip count."""
    inner = _inner(jaxpr)
    walk = _Walk()
    walk.run(inner, [(frozenset(), None)] * len(inner.invars), frozenset())
    if guarded is not None:
        guarded.extend(walk.guarded)
    return list(walk.found.values())
