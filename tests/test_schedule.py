"""Schedule tables, checked without JAX: every action once, dependencies, buffers, bubble = formula."""

import pytest

from megajax.pipeline import schedule as sl
from megajax.pipeline.schedule import BWD, FWD

CASES = [("gpipe", p, 1, m) for p in (1, 2, 4) for m in (1, 3, 8)]
CASES += [("1f1b", p, 1, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)]
CASES += [("interleaved", p, v, m) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


def events(s):
    """(tick, order within the tick, rank, kind, global chunk, micro) for every action."""
    fg, bg = s.global_chunk(s.f_chunk), s.global_chunk(s.b_chunk)
    for t in range(s.ticks):
        for r in range(s.p):
            if fg[t, r] >= 0:
                yield t, 0, r, FWD, int(fg[t, r]), int(s.f_micro[t, r])
            if bg[t, r] >= 0:
                yield t, 1, r, BWD, int(bg[t, r]), int(s.b_micro[t, r])


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_each_forward_and_backward_once_in_dependency_order(name, p, v, m):
    s = sl.build(name, p, v, m)
    when = {}
    for t, k, r, kind, g, mb in events(s):
        assert (kind, g, mb) not in when, f"{kind, g, mb} ran twice"
        assert g % p == r, "chunk c lives on rank c mod p"
        when[(kind, g, mb)] = (t, k)
    chunks = p * v
    assert set(when) == {(k, g, i) for k in (FWD, BWD) for g in range(chunks) for i in range(m)}
    for (kind, g, mb), (t, k) in when.items():
        if kind == FWD and g > 0:
            assert when[(FWD, g - 1, mb)][0] < t, "an activation arrives one tick after it is sent"
        if kind == BWD:
            assert when[(FWD, g, mb)] < (t, k), "the backward follows its forward (same tick allowed)"
            if g < chunks - 1:
                assert when[(BWD, g + 1, mb)][0] < t


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_bubble_equals_the_papers_formula(name, p, v, m):
    """With a backward twice a forward (the paper's assumption), and for any other ratio."""
    s = sl.build(name, p, v, m)
    for bwd_cost in (2.0, 3.0, 1.0):
        assert s.bubble_fraction(bwd_cost) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_buffers_hold_the_right_message(name, p, v, m):
    """Replays the table with real buffers: every read finds the message it needs, live slots are never
    overwritten, and messages never go to the trash slot."""
    s = sl.build(name, p, v, m)
    fg, bg = s.global_chunk(s.f_chunk), s.global_chunk(s.b_chunk)
    act = [[None] * s.act_slots for _ in range(p)]
    grad = [[None] * s.grad_slots for _ in range(p)]
    for t in range(s.ticks):
        sends_f, sends_b = {}, {}
        for r in range(p):
            if fg[t, r] >= 0:
                c, mb, slot = fg[t, r], s.f_micro[t, r], s.f_slot[t, r]
                assert slot != s.act_slots - 1, "a forward stashes into a real slot"
                if c > 0:
                    assert act[r][slot] == ("act", c, mb), "the forward finds its input"
                else:
                    assert act[r][slot] is None, "the first chunk stashes into a free slot"
                act[r][slot] = ("act", c, mb)
                if c < p * v - 1:
                    sends_f[(r + 1) % p] = ("act", c + 1, mb)
            else:
                assert s.f_slot[t, r] == s.act_slots - 1
            if bg[t, r] >= 0:
                c, mb = bg[t, r], s.b_micro[t, r]
                assert act[r][s.b_act_slot[t, r]] == ("act", c, mb), "the backward finds its stash"
                act[r][s.b_act_slot[t, r]] = None  # freed by the backward
                if c < p * v - 1:
                    assert grad[r][s.b_grad_slot[t, r]] == ("grad", c, mb)
                    grad[r][s.b_grad_slot[t, r]] = None
                if c > 0:
                    sends_b[(r - 1) % p] = ("grad", c - 1, mb)
        for r in range(p):
            for buf, sends, slot, trash in ((act, sends_f, s.recv_act[t, r], s.act_slots - 1),
                                            (grad, sends_b, s.recv_grad[t, r], s.grad_slots - 1)):
                if r in sends:
                    assert slot != trash and buf[r][slot] is None, "a live slot was overwritten"
                    buf[r][slot] = sends[r]
                else:
                    assert slot == trash


def test_in_flight_is_bounded_by_depth_not_micro_batches():
    for m in (8, 16, 64):
        one = sl.build("1f1b", 4, 1, m)
        assert one.in_flight().tolist() == [7, 5, 3, 1]  # 2 (p - r - 1) + 1
        assert one.act_slots == sl.build("1f1b", 4, 1, 8).act_slots
        inter = sl.build("interleaved", 4, 2, m)
        assert inter.in_flight().max() <= (4 - 1) * 2 + (2 - 1) * 4 + 1
        assert inter.act_slots == sl.build("interleaved", 4, 2, 8).act_slots
        assert sl.build("gpipe", 4, 1, m).in_flight().tolist() == [m] * 4


def test_steady_state_is_one_forward_and_one_backward_per_tick():
    s = sl.build("1f1b", 4, 1, 16)
    both = (s.f_chunk >= 0) & (s.b_chunk >= 0)
    assert both[:, 3].sum() == 16, "the last stage runs F and B of each micro batch in one tick"
    assert both.all(axis=1).sum() == 16 - 2 * 3, "all ranks busy with both in the steady state"


def test_megatron_orders():
    assert [a[0] for a in sl.rank_order("1f1b", 4, 1, 8, 0)] == [FWD] * 6 + [FWD, BWD] * 2 + [BWD] * 6
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
    assert sl.timeline(sl.build("1f1b", 2, 1, 2)).splitlines()[1].split()[3:5] == ["F0B0", "F1B1"]
