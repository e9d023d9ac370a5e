"""Schedule tables, checked without JAX: every action once, dependencies, buffers, bubble = formula."""

import itertools

import numpy as np
import pytest

from megajax.pipeline import schedule as sl
from megajax.pipeline.schedule import BWD, FWD, IDLE

CASES = [("gpipe", p, 1, m) for p in (1, 2, 4) for m in (1, 3, 8)]
CASES += [("1f1b", p, 1, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)]
CASES += [("interleaved", p, v, m) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


def events(s):
    """(tick, rank, kind, global chunk, micro) for every non-idle cell."""
    g = s.global_chunk()
    for t, r in itertools.product(range(s.ticks), range(s.p)):
        if s.kind[t, r] != IDLE:
            yield t, r, int(s.kind[t, r]), int(g[t, r]), int(s.micro[t, r])


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_each_forward_and_backward_once_in_dependency_order(name, p, v, m):
    s = sl.build(name, p, v, m)
    when = {}
    for t, r, kind, g, mb in events(s):
        assert (kind, g, mb) not in when, f"{kind, g, mb} ran twice"
        assert g % p == r, "chunk c lives on rank c mod p"
        when[(kind, g, mb)] = t
    chunks = p * v
    assert set(when) == {(k, g, i) for k in (FWD, BWD) for g in range(chunks) for i in range(m)}
    for (kind, g, mb), t in when.items():
        if kind == FWD and g > 0:
            assert when[(FWD, g - 1, mb)] < t
        if kind == BWD:
            assert when[(FWD, g, mb)] < t
            if g < chunks - 1:
                assert when[(BWD, g + 1, mb)] < t


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_bubble_equals_the_papers_formula(name, p, v, m):
    s = sl.build(name, p, v, m)
    assert s.bubble_fraction() == pytest.approx((p - 1) / (v * m))
    assert s.ticks == 2 * (m * v + p - 1)


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_buffers_hold_the_right_message(name, p, v, m):
    """Replays the table with real buffers: every read finds the message it needs, none is overwritten."""
    s = sl.build(name, p, v, m)
    g = s.global_chunk()
    act = [[None] * s.act_slots for _ in range(p)]
    grad = [[None] * s.grad_slots for _ in range(p)]
    for t in range(s.ticks):
        sends_f, sends_b = {}, {}
        for r in range(p):
            kind, c, mb = s.kind[t, r], g[t, r], s.micro[t, r]
            if kind == IDLE:
                continue
            if c > 0:
                assert act[r][s.act_slot[t, r]] == ("act", c, mb)
            if kind == BWD and c < p * v - 1:
                assert grad[r][s.grad_slot[t, r]] == ("grad", c, mb)
            if kind == FWD and c < p * v - 1:
                sends_f[(r + 1) % p] = ("act", c + 1, mb)
            if kind == BWD and c > 0:
                sends_b[(r - 1) % p] = ("grad", c - 1, mb)
        for r in range(p):
            slot = s.recv_act[t, r]
            if r in sends_f:
                assert slot < s.act_slots - 1, "a message must not go to the trash slot"
                assert act[r][slot] is None or _consumed(s, r, act[r][slot], t), "live slot overwritten"
                act[r][slot] = sends_f[r]
            else:
                assert slot == s.act_slots - 1
            slot = s.recv_grad[t, r]
            if r in sends_b:
                assert grad[r][slot] is None or _consumed(s, r, grad[r][slot], t, grads=True)
                grad[r][slot] = sends_b[r]
            else:
                assert slot == s.grad_slots - 1


def _consumed(s, r, msg, t, grads=False):
    """True if the message in a slot was already used by its backward (at or before tick t)."""
    _, c, mb = msg
    g = s.global_chunk()
    for u in range(t + 1):
        if s.kind[u, r] == BWD and g[u, r] == c and s.micro[u, r] == mb:
            return True
    return False


def test_in_flight_is_bounded_by_depth_not_micro_batches():
    for m in (8, 16, 64):
        one = sl.build("1f1b", 4, 1, m)
        assert one.in_flight().tolist() == [4, 3, 2, 1]
        assert one.act_slots <= 4 + 2
        inter = sl.build("interleaved", 4, 2, m)
        assert inter.in_flight().max() <= (4 - 1) * 2 + (2 - 1) * 4 + 1
        assert inter.act_slots == sl.build("interleaved", 4, 2, 8).act_slots
        assert sl.build("gpipe", 4, 1, m).in_flight().tolist() == [m] * 4


def test_megatron_orders():
    # rank 0 of 1F1B p=4: 3 warm-up forwards then alternate
    assert [a[0] for a in sl.rank_order("1f1b", 4, 1, 6, 0)] == [FWD] * 3 + [FWD, BWD] * 3 + [BWD] * 3
    inter = sl.rank_order("interleaved", 2, 2, 4, 0)
    assert inter[:4] == [(FWD, 0, 0), (FWD, 0, 1), (FWD, 1, 0), (FWD, 1, 1)]
    assert (BWD, 1, 0) in inter and inter.index((BWD, 1, 0)) < inter.index((BWD, 0, 0))


@pytest.mark.parametrize("args", [("interleaved", 4, 2, 6), ("1f1b", 2, 2, 4), ("bogus", 2, 1, 2)])
def test_bad_layouts(args):
    with pytest.raises(ValueError):
        sl.build(*args)


def test_cli_prints_timeline_and_summary(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert sl.main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0:") and '"bubble_fraction": 0.1875' in out
    assert png.stat().st_size > 1000
    assert np.all(sl.build("1f1b", 2, 1, 2).kind[0] == [FWD, IDLE])
