"""Schedule tables, checked without JAX: every action once, dependencies, buffers, memory and bubble
against Megatron's."""

import numpy as np
import pytest

from megajax.parallel.pipeline import schedule as sl, schedule_cli as cli
from megajax.parallel.pipeline.schedule import BWD, FWD

CASES = [("gpipe", p, 1, m) for p in (1, 2, 4) for m in (1, 3, 8)]
CASES += [("1f1b", p, 1, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)]
CASES += [("interleaved", p, v, m) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, p + 1, 2 * p, 4 * p)]
CASES += [("zero_bubble", p, 1, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)]
CASES += [("zero_bubble", p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p + 1)]


def rank_order(name: str, p: int, v: int, m: int, r: int) -> list[tuple[int, int, int]]:
    """Rank r's actions [(FWD|BWD, local chunk, micro batch), ...] in the order the lock step runs them."""
    s = sl.build(name, p, v, m)
    out = []
    for t in range(s.ticks):
        if s.f_chunk[t, r] >= 0:
            out.append((sl.FWD, int(s.f_chunk[t, r]), int(s.f_micro[t, r])))
        if s.b_chunk[t, r] >= 0:
            out.append((sl.BWD, int(s.b_chunk[t, r]), int(s.b_micro[t, r])))
    return out


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
    wg = s.global_chunk(s.w_chunk)
    weights = [(int(wg[t, r]), int(s.w_micro[t, r]), t) for t, r in zip(*np.nonzero(wg >= 0))]
    if name == "zero_bubble":  # each weight gradient once, in the tick after its input gradient
        assert sorted((g, mb) for g, mb, _ in weights) == sorted((g, i) for g in range(chunks) for i in range(m))
        assert all(when[(BWD, g, mb)][0] == t - 1 for g, mb, t in weights)
    else:
        assert not weights
    for (kind, g, mb), (t, k) in when.items():
        if kind == FWD and g > 0:
            assert when[(FWD, g - 1, mb)][0] < t, "an activation arrives one tick after it is sent"
        if kind == BWD:
            assert when[(FWD, g, mb)] < (t, k), "the backward follows its forward (same tick allowed)"
            if g < chunks - 1:
                assert when[(BWD, g + 1, mb)][0] < t


def megatron_in_flight(name, p, v, m, r):
    """Megatron's peak in-flight micro batches on rank r: warm-up forwards + 1 (schedules.py)."""
    if name == "gpipe":
        return m
    if name == "1f1b" or (name == "zero_bubble" and v == 1):
        return min(p - r, m)
    return min((p - r - 1) * 2 + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("name,p,v,m", [c for c in CASES if c[0] != "gpipe"])
def test_memory_and_bubble_against_megatron(name, p, v, m):
    """In flight: 1F1B (and zero_bubble) holds p - r on rank r as Megatron, interleaved no more than Megatron.
    Bubble (F 1, R 1, B 2, split into B 1 and W 1; the last chunk needs no recompute; ranks wait for the ranks
    they exchange with): 1F1B at most (p - 1) / m; zero_bubble Qi et al.'s (p - 1) / (2 m) or better;
    interleaved the paper's (p - 1) / (v m) or better with whole micro batch groups (m a multiple of p), else
    at most 1F1B's. The global lock step (every tick as long as its slowest rank) is never faster."""
    s = sl.build(name, p, v, m)
    in_flight = s.in_flight().tolist()
    assert all(got <= megatron_in_flight(name, p, v, m, r) for r, got in enumerate(in_flight)), in_flight
    if name == "1f1b" or (name == "zero_bubble" and v == 1):
        assert in_flight == [min(p - r, m) for r in range(p)]
    bubble = s.bubble_fraction()
    assert bubble <= s.bubble_fraction(sync="ticks") + 1e-9
    if name == "zero_bubble" and v > 1:  # see test_interleaved_zero_bubble_against_interleaved
        return
    assert bubble <= (p - 1) / m + 1e-9
    if name == "zero_bubble":
        assert bubble <= (p - 1) / (2 * m) + 1e-9 and sl.formula(name, p, v, m) == (p - 1) / (2 * m)
    if name == "interleaved" and m % p == 0:
        assert bubble <= (p - 1) / (v * m) + 1e-9


def test_interleaved_meets_the_paper_over_megatron_layouts():
    """Every layout Megatron's interleaved schedule accepts (m a multiple of p) over p 2-8, v 2-4, m p-4p:
    the bubble at most the paper's (p - 1) / (v m), holding exactly Megatron's in-flight micro batches
    ((p - r - 1) 2 + (v - 1) p warm-up forwards plus one, at most m v)."""
    for p in range(2, 9):
        for v in range(2, 5):
            for m in (p, 2 * p, 3 * p, 4 * p):
                s = sl.build("interleaved", p, v, m)
                assert s.bubble_fraction() <= (p - 1) / (v * m) + 1e-9, (p, v, m, s.bubble_fraction())
                assert s.in_flight().tolist() == [megatron_in_flight("interleaved", p, v, m, r) for r in range(p)]


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_buffers_hold_the_right_message(name, p, v, m):
    """Replays the table with real buffers: every read finds the message it needs, live slots are never
    overwritten, messages never go to the trash slot, a backward finds the residuals of the tick before
    (zero_bubble: its weight gradient, first in the next tick, those residuals and the backward's output)."""
    s = sl.build(name, p, v, m)
    last = p * v - 1
    fg, rg, bg = s.global_chunk(s.f_chunk), s.global_chunk(s.r_chunk), s.global_chunk(s.b_chunk)
    act = [[None] * s.act_slots for _ in range(p)]
    grad = [[None] * s.grad_slots for _ in range(p)]
    residuals = [None] * p  # made in the previous tick
    alive = [None] * p  # the residual set a rank holds (the last one made)
    output_grads = [None] * p  # zero_bubble: what the last backward hands its weight gradient
    wg = s.global_chunk(s.w_chunk)
    for t in range(s.ticks):
        sends_f, sends_b = {}, {}
        made = [None] * p
        for r in range(p):
            if wg[t, r] >= 0:  # W first: the residuals and output gradients of the backward just before
                c, mb = wg[t, r], s.w_micro[t, r]
                assert alive[r] == (c, mb) and output_grads[r] == (c, mb), "W finds its matmul inputs and grads"
                output_grads[r] = None
            if bg[t, r] >= 0:  # B reads the residuals the previous tick made, and its gradient
                c, mb = bg[t, r], s.b_micro[t, r]
                assert residuals[r] == (c, mb), "the backward finds its residuals"
                assert grad[r][s.b_grad_slot[t, r]] == ("grad", c, mb)
                grad[r][s.b_grad_slot[t, r]] = None
                output_grads[r] = (c, mb)
                if c > 0:
                    sends_b[(r - 1) % p] = ("grad", c - 1, mb)
            if rg[t, r] >= 0:  # R reads its stash (before a forward may reuse the slot) and frees it
                c, mb, slot = rg[t, r], s.r_micro[t, r], s.r_slot[t, r]
                assert act[r][slot] == ("act", c, mb), "the recompute finds its stash"
                act[r][slot] = None
                made[r] = (c, mb)
            if fg[t, r] >= 0:
                c, mb, slot = fg[t, r], s.f_micro[t, r], s.f_slot[t, r]
                assert slot != s.act_slots - 1, "a forward stashes into a real slot"
                if c > 0:
                    assert act[r][slot] == ("act", c, mb), "the forward finds its input"
                else:
                    assert act[r][slot] is None, "the first chunk stashes into a free slot"
                act[r][slot] = ("act", c, mb)
                if c < last:
                    sends_f[(r + 1) % p] = ("act", c + 1, mb)
                else:  # the head's backward writes the output gradient
                    assert grad[r][s.f_grad_slot[t, r]] is None
                    grad[r][s.f_grad_slot[t, r]] = ("grad", c, mb)
                if s.f_keep[t, r]:
                    assert rg[t, r] < 0 and c == last, "only the last chunk keeps its own residuals"
                    act[r][slot] = None
                    made[r] = (c, mb)
            else:
                assert s.f_slot[t, r] == s.act_slots - 1
        residuals = made
        alive = [mine or kept for mine, kept in zip(made, alive)]
        for r in range(p):
            for buf, sends, slot, trash in ((act, sends_f, s.recv_act[t, r], s.act_slots - 1),
                                            (grad, sends_b, s.recv_grad[t, r], s.grad_slots - 1)):
                if r in sends:
                    assert slot != trash and buf[r][slot] is None, "a live slot was overwritten"
                    buf[r][slot] = sends[r]
                else:
                    assert slot == trash


def test_buffers_do_not_grow_with_micro_batches():
    for m in (8, 16, 64):
        for name, v in (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("zero_bubble", 2)):
            assert sl.build(name, 4, v, m).act_slots == sl.build(name, 4, v, 8).act_slots
        assert sl.build("gpipe", 4, 1, m).in_flight().tolist() == [m] * 4


def test_staggered_roles_in_the_steady_state():
    """1F1B: rank r runs forwards and recomputes on ticks where t + r is even, backwards on odd ticks.
    Interleaved (messages both ways in every tick): a steady tick holds a forward, a backward and the next
    backward's recompute, Megatron's step of one forward and one backward."""
    s = sl.build("1f1b", 4, 1, 16)
    ticks, ranks = np.nonzero(s.b_chunk >= 0)
    assert np.all((ticks + ranks) % 2 == 1)
    ticks, ranks = np.nonzero(s.r_chunk >= 0)
    assert np.all((ticks + ranks) % 2 == 0)
    ticks, ranks = np.nonzero(s.f_chunk[s.free_ticks:] >= 0)
    assert np.all((ticks + s.free_ticks + ranks) % 2 == 0)
    assert (s.f_keep[:, 3] > 0).sum() == 16 and (s.r_chunk[:, 3] < 0).all(), "the last stage never recomputes"
    s = sl.build("interleaved", 4, 2, 16)
    steady = (s.f_chunk >= 0) & ((s.r_chunk >= 0) | (s.f_keep > 0)) & (s.b_chunk >= 0)
    assert steady.sum(axis=0).tolist() == [32 - megatron_in_flight("interleaved", 4, 2, 16, r) for r in range(4)]
    assert sl.perm_pairs(4, 2, True, 0) == [[(0, 1), (1, 2), (2, 3), (3, 0)], [(0, 3), (1, 0), (2, 1), (3, 2)]]


def test_megatron_orders():
    assert [a[0] for a in rank_order("1f1b", 4, 1, 8, 0)] == [FWD] * 4 + [BWD, FWD] * 4 + [BWD] * 4
    inter = rank_order("interleaved", 2, 2, 4, 0)
    assert inter[:4] == [(FWD, 0, 0), (FWD, 0, 1), (FWD, 1, 0), (FWD, 1, 1)]
    assert (BWD, 1, 0) in inter and inter.index((BWD, 1, 0)) < inter.index((BWD, 0, 0))
    # Megatron's groups of p micro batches, the last one taking the rest (m = 5 over p = 2)
    assert sl.interleaved_table(2, 2, 5) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1), (4, 0),
                                             (4, 1)]


@pytest.mark.parametrize("args", [("interleaved", 4, 2, 3), ("zero_bubble", 4, 2, 3), ("1f1b", 2, 2, 4),
                                  ("bogus", 2, 1, 2)])
def test_bad_layouts(args):
    with pytest.raises(ValueError):
        sl.build(*args)


def test_cli_prints_timeline_and_summary(capsys, tmp_path):
    png = tmp_path / "t.png"
    assert cli.main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0:") and '"bubble_fraction": 0.140625' in out
    assert png.stat().st_size > 1000
    assert cli.timeline(sl.build("1f1b", 2, 1, 2)).splitlines() == ["rank 0: F0 F1 R0 B0 R1 B1",
                                                                   "rank 1:  . F0 B0 F1 B1  ."]


def test_zero_bubble_at_measured_costs():
    """With the costs measured on an H100 (scripts/bench_split_backward.py, Llama 4096 wide: the input
    gradient 1.86 forwards, the weight gradient 0.94, the fused backward 2.61 at micro batch 4; 1.91, 0.86
    and 2.76 at micro batch 1) zero_bubble's bubble is below 1F1B's at p 4 m 8 and p 8 m 16; where the split
    backward costs 7% more than the fused one (micro batch 4) and m is large against p, 1F1B wins. In a global
    lock step the W in the forward's tick would stretch every tick: that accounting is only a bound."""
    h100 = {"mb4": sl.Costs(1, 1, 2.61, 0.94, b_input=1.86), "mb1": sl.Costs(1, 1, 2.76, 0.86, b_input=1.91)}
    for p, m in ((4, 8), (8, 16)):
        zb, one = sl.build("zero_bubble", p, 1, m), sl.build("1f1b", p, 1, m)
        for costs in (None, *h100.values()):
            assert zb.bubble_fraction(costs) < one.bubble_fraction(costs) - 0.01
    zb, one = sl.build("zero_bubble", 4, 1, 16), sl.build("1f1b", 4, 1, 16)
    assert zb.bubble_fraction(h100["mb4"]) > one.bubble_fraction(h100["mb4"])
    assert zb.bubble_fraction(h100["mb1"]) < one.bubble_fraction(h100["mb1"])
    assert zb.bubble_fraction(sync="ticks") > one.bubble_fraction(sync="ticks")
    assert sl.Costs(b=3, w=1).b_input == 2
    assert cli.main(["--schedule", "1f1b", "-p", "2", "-m", "2", "--costs", "1,2"]) == 2
    with pytest.raises(ValueError, match="unknown sync"):
        zb.step_time(sync="global")


def test_pairwise_clock_by_hand():
    """p 2, m 1, 1F1B (F 1, R 1, B 2): rank 0 forwards (t 0), rank 1 forwards and runs the head (t 1), then
    rank 1's backward (2) while rank 0 recomputes (1) and waits for the gradient, then rank 0's backward:
    1 + 1 + 2 + 2 = 6 against an ideal of 4. Rank 1 is done at 4: nothing waits for it in the last tick."""
    s = sl.build("1f1b", 2, 1, 1)
    assert cli.timeline(s).splitlines() == ["rank 0: F0  . R0 B0", "rank 1:  . F0 B0  ."]
    clock = s.clock()
    assert clock[:, 0].tolist() == [0, 1, 2, 4, 6] and clock[:, 1].tolist() == [0, 1, 2, 4, 4]
    assert s.step_time() == 6 and s.bubble_fraction() == 0.5
    assert s.step_time(sync="ticks") == 6


def test_interleaved_zero_bubble_against_interleaved():
    """zero_bubble with v = 2 holds interleaved's in-flight micro batches, but its weight gradient must run in
    the tick after the input gradient, before the next recompute replaces the residuals it reads: a rank runs
    a backward every other tick, where interleaved runs one (with the next recompute) every tick. So it loses
    to interleaved with the papers' unit costs and with the H100's (the input gradient near two forwards, W
    under one)."""
    zb, il = sl.build("zero_bubble", 4, 2, 8), sl.build("interleaved", 4, 2, 8)
    assert zb.in_flight().tolist() == il.in_flight().tolist() == [11, 9, 7, 5]
    h100 = sl.Costs(1, 1, 2.61, 0.94, b_input=1.86)
    assert zb.bubble_fraction() > il.bubble_fraction()
    assert zb.bubble_fraction(h100) > il.bubble_fraction(h100)


@pytest.mark.parametrize("name,p,v,m", [("gpipe", 2, 1, 3), ("1f1b", 4, 1, 8), ("interleaved", 3, 2, 6),
                                        ("zero_bubble", 4, 1, 8), ("zero_bubble", 2, 2, 4)])
def test_per_chunk_costs_with_equal_layers_equal_the_default(name, p, v, m):
    """Per-layer costs with every chunk alike give the default accounting (work, ideal, bubble in both
    syncs), at unit costs and at the H100's."""
    s = sl.build(name, p, v, m)
    for base in ({}, {"b": 2.61, "w": 0.94, "b_input": 1.86}):
        flat, chunks = sl.Costs(**base), sl.Costs(**base, layers=[3] * (p * v))
        np.testing.assert_allclose(s.work(chunks), s.work(flat), rtol=1e-12, atol=1e-12)
        assert s.ideal(chunks) == pytest.approx(s.ideal(flat), rel=1e-12)
        for sync in sl.SYNCS:
            assert s.bubble_fraction(chunks, sync) == pytest.approx(s.bubble_fraction(flat, sync), rel=1e-9)


def test_uneven_stages_by_hand():
    """p 2, m 2, 1F1B, layers (1, 3): the unit is an average stage's forward (2 layers), so rank 0's F and R
    cost 0.5 and its B 1, rank 1's F 1.5 and B 3 (it keeps its residuals: no recompute). Rank 0 forwards
    twice (0.5 each; rank 1 waits for the first), rank 1's F0 ends at 2, its B0 at 5 (rank 0's R0 waits for
    it), rank 0's B0 (to 6) overlaps rank 1's F1 (to 6.5), rank 1's B1 ends at 9.5 and rank 0's B1 at 10.5.
    The busiest rank (1) works 2 x 4.5 = 9: bubble 10.5 / 9 - 1. The embedding and the head add to the first
    chunk's F and B and to the last chunk's F (the head's forward and backward)."""
    s = sl.build("1f1b", 2, 1, 2)
    c = sl.Costs(layers=(1, 3))
    clock = s.clock(c)
    assert clock[:, 0].tolist() == [0, 0.5, 2, 5, 6, 9.5, 10.5]
    assert clock[:, 1].tolist() == [0, 0.5, 2, 5, 6.5, 9.5, 9.5]
    assert s.work(c).sum(axis=0).tolist() == [4, 9] and s.ideal(c) == 9
    assert s.bubble_fraction(c) == pytest.approx(10.5 / 9 - 1)
    per = sl.Costs(layers=(1, 3), embed=0.5, head=1).per_chunk(2)
    assert per["f"].tolist() == [0.75, 3] and per["r"].tolist() == [0.5, 1.5] and per["b"].tolist() == [1.5, 3]
    assert per["b_input"].tolist() == [1, 1.5] and per["w"].tolist() == [0.5, 1.5]
    with pytest.raises(ValueError, match="layers"):
        sl.Costs(head=1)
    with pytest.raises(ValueError, match="chunks"):
        s.work(sl.Costs(layers=(1, 2, 3)))


def test_cli_uneven_stages(capsys):
    """--layers and Megatron's split flags go through config.pipeline_split; the head's cost is estimated
    from the model's shape (Llama 3.1 405B: the output layer is about 0.55 of a layer, GQA left out)."""
    assert cli.head_cost(16384, 53248, 128256, 8192) == pytest.approx(0.5493, abs=1e-4)
    argv = ["--schedule", "1f1b", "-p", "4", "-m", "8", "--layers", "16", "--first-stage-layers", "3",
            "--last-stage-layers", "3", "--head-cost", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "work per rank: 24.000 40.000 40.000 24.000; busiest 40.000" in out and '"layers_per_chunk"' in out
    assert cli.main(["-p", "16", "-m", "32", "--model", "llama3.1-405b", "--account-for-embedding",
                    "--account-for-loss"]) == 0
    assert '"layers_per_chunk": [\n    7,\n    8' in capsys.readouterr().out
    assert cli.main(["-p", "4", "-m", "8", "--layers", "15"]) == 2  # 15 layers do not split over 4 stages


def test_cli_reads_a_config(capsys):
    """--config takes the schedule, p, v, micro batches, the split (DeepSeek-V3's dense layers on the first stage)
    and the head's cost from a preset, with no JAX; flags beside it win; a config without parallel.data says to
    set it."""
    import subprocess
    import sys

    from megajax.config import io as config_io

    # DeepSeek's own layout of DeepSeek-V3 (the preset's header): pipeline 16 with the dense layers on the first stage
    own = ["parallel.data=64", "parallel.expert=64", "parallel.pipeline=16", "parallel.tensor=1",
           "parallel.expert_tensor=null", "parallel.sequence_parallel=false", "parallel.tp_comm_overlap=false",
           "parallel.data_parallel_sharding_strategy=optim", "parallel.decoder_first_pipeline_num_layers=4",
           "parallel.decoder_last_pipeline_num_layers=1", "train.micro_batch_size=1"]
    flags = cli.config_costs(config_io.load("configs/deepseek-v3.yaml", own))
    assert (flags["schedule"], flags["p"], flags["v"], flags["m"], flags["first_dense"]) == ("1f1b", 16, 1, 48, 3)
    assert 1.3 < flags["head_cost"] < 1.5  # 7168 x 129280 over MLA and 8 + 1 experts of 2048
    assert cli.main(["--config", "configs/deepseek-v3.yaml", "--set", *own, "-m", "32"]) == 0
    out = capsys.readouterr().out
    assert '"layers_per_chunk": [\n    4,' in out and '"m": 32' in out
    assert cli.main(["--config", "configs/tiny.yaml"]) == 2 and "set parallel.data" in capsys.readouterr().err
    code = ("import sys; from megajax.parallel.pipeline import schedule_cli as s; s.main(['--config', 'configs/llama3.1-405b.yaml']);"
            " sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0, "the CLI imported JAX"
