"""Optimizer ops against torch.optim (AdamW + clip_grad_norm_, SGD) on the same small model."""
import math

import numpy as np
import pytest
import torch

import graphlm as gl
from graphlm import executors
from graphlm import optim
from graphlm.ir import ShapeError

B, D, H, V = 6, 5, 7, 4


def build(opt, params=None):
    """A small classifier: linear -> layer norm -> gelu -> linear -> cross-entropy."""
    g = gl.Graph("mlp")
    x = g.input("x", (B, D))
    y = g.input("y", (B,), np.int64)
    w1 = g.param("w1", (H, D)); b1 = g.param("b1", (H,))
    ln_w = g.param("ln.weight", (H,)); ln_b = g.param("ln.bias", (H,))
    w2 = g.param("w2", (V, H)); b2 = g.param("b2", (V,))
    h = gl.gelu(gl.layer_norm(x @ w1.T + b1, ln_w, ln_b))
    loss = gl.cross_entropy(h @ w2.T + b2, y)
    step = opt.minimize(loss)
    return g, loss, step


def init(seed):
    rng = np.random.default_rng(seed)
    shapes = {"w1": (H, D), "b1": (H,), "ln.weight": (H,), "ln.bias": (H,), "w2": (V, H), "b2": (V,)}
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def torch_loss(tp, x, y):
    h = torch.nn.functional.linear(x, tp["w1"], tp["b1"])
    h = torch.nn.functional.layer_norm(h, (H,), tp["ln.weight"], tp["ln.bias"])
    h = torch.nn.functional.gelu(h, approximate="tanh")
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, tp["w2"], tp["b2"]), y)


def batches(n, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((B, D)).astype(np.float32), rng.integers(0, V, B).astype(np.int64))
            for _ in range(n)]


def run_graphlm(opt, params, data, executor="reference"):
    g, loss, st = build(opt)
    prog = executors.compile(g, [loss, st.grad_norm, st.update], executor=executor)
    state = {k: v.copy() for k, v in params.items()}
    state.update(opt.init_state())
    norms = []
    for s, (x, y) in enumerate(data):
        _, norm, _ = prog.run({"x": x, "y": y, **opt.feeds(s)}, state)
        norms.append(float(norm))
    return state, norms


def assert_params_close(state, tp, rtol=1e-5):
    for k, t in tp.items():
        want = t.detach().numpy()
        err = np.max(np.abs(state[k] - want)) / np.max(np.abs(want))
        assert err <= rtol, f"{k}: relative error {err} (max-norm, float32 rounding is ~1e-7)"


@pytest.mark.parametrize("clip_norm", [0.3, None])
def test_adamw_matches_torch(clip_norm):
    sched = optim.WarmupCosine(0.05, warmup_steps=2, total_steps=6)
    opt = optim.AdamW(lr=sched, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_norm=clip_norm)
    params, data = init(0), batches(6)
    state, norms = run_graphlm(opt, params, data)

    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    decay = [tp[k] for k in tp if tp[k].ndim >= 2]
    no_decay = [tp[k] for k in tp if tp[k].ndim < 2]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=0.05, betas=(0.9, 0.95), eps=1e-8)
    for s, (x, y) in enumerate(data):
        for group in topt.param_groups:
            group["lr"] = sched(s)
        topt.zero_grad()
        loss = torch_loss(tp, torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        tnorm = torch.nn.utils.clip_grad_norm_(list(tp.values()), clip_norm if clip_norm else math.inf)
        assert norms[s] == pytest.approx(float(tnorm), rel=1e-5)
        topt.step()
    if clip_norm:
        assert max(norms) > clip_norm  # clipping really acted
    assert_params_close(state, tp)
    for k in params:  # moments too
        m = topt.state[tp[k]]["exp_avg"].numpy()
        assert np.allclose(state[f"optimizer.m.{k}"], m, rtol=1e-5, atol=1e-7)
        assert not np.array_equal(state[k], params[k])


def test_sgd_momentum_matches_torch():
    opt = optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01, clip_norm=0.5,
                    decay=lambda name, shape: True)
    params, data = init(3), batches(5, seed=4)
    state, _ = run_graphlm(opt, params, data)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    topt = torch.optim.SGD(list(tp.values()), lr=0.1, momentum=0.9, weight_decay=0.01)
    for x, y in data:
        topt.zero_grad()
        torch_loss(tp, torch.from_numpy(x), torch.from_numpy(y)).backward()
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 0.5)
        topt.step()
    assert_params_close(state, tp)


def test_schedule_changes_lr_without_recompiling():
    sched = optim.WarmupCosine(1.0, warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert [sched(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert sched(4) == pytest.approx(1.0)
    assert sched(12) == pytest.approx(0.55)
    assert sched(20) == pytest.approx(0.1) and sched(100) == pytest.approx(0.1)
    lrs = [sched(s) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # a zero learning rate fed at run time leaves params (without decay) unchanged
    opt = optim.AdamW(lr=lambda s: 0.0 if s == 0 else 0.1, weight_decay=0.0)
    g, loss, st = build(opt)
    prog = executors.compile(g, [st.update])
    state = init(0); state.update(opt.init_state())
    before = {k: v.copy() for k, v in state.items() if not k.startswith("optimizer")}
    x, y = batches(1)[0]
    prog.run({"x": x, "y": y, **opt.feeds(0)}, state)
    assert all(np.array_equal(state[k], v) for k, v in before.items())
    prog.run({"x": x, "y": y, **opt.feeds(1)}, state)
    assert not np.array_equal(state["w1"], before["w1"])


def test_moments_are_views_of_one_flat_buffer():
    opt = optim.AdamW()
    build(opt)
    st = opt.init_state()
    assert sorted(st) == sorted(opt.state_names())
    bases = {id(a.base) for k, a in st.items() if k.startswith("optimizer.m.")}
    assert len(bases) == 1
    assert all(a.flags.c_contiguous and a.flags.writeable for a in st.values())


def test_bad_optimizer_arguments_and_step():
    with pytest.raises(ValueError, match="betas"):
        optim.AdamW(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="clip_norm"):
        optim.AdamW(clip_norm=-1.0)
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(lr=float("nan"))
    opt = optim.AdamW()
    g, loss, st = build(opt)
    prog = executors.compile(g, [st.update])
    state = init(0); state.update(opt.init_state())
    x, y = batches(1)[0]
    feeds = {"x": x, "y": y, **opt.feeds(0)}
    feeds["optimizer.step"] = np.asarray(0, np.int64)
    with pytest.raises(ValueError, match="step count must be >= 1"):
        prog.run(feeds, state)
    g2 = gl.Graph()
    p = g2.param("p", (3,))
    with pytest.raises(ShapeError, match="does not match param"):
        gl.ops.adamw_update(g2.input("lr", ()), g2.input("t", (), np.int64), g2.input("c", ()),
                            [(p, g2.input("gp", (4,)), g2.state("m", (3,)), g2.state("v", (3,)))])


def test_global_norm_and_update_order():
    g = gl.Graph()
    a = g.input("a", (3, 4)); b = g.input("b", (5,))
    n = gl.ops.global_norm([a, b])
    rng = np.random.default_rng(0)
    av, bv = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    (out,) = executors.compile(g, [n]).run({"a": av, "b": bv})
    assert out.dtype == np.float32
    assert out == pytest.approx(math.sqrt(float(np.sum(av.astype(np.float64) ** 2) + np.sum(bv.astype(np.float64) ** 2))), rel=1e-6)
    # the update runs after every reader of the weight: the loss reported is the pre-update loss
    opt = optim.SGD(lr=0.5)
    g, loss, st = build(opt)
    prog = executors.compile(g, [loss, st.update])
    state = init(1)
    x, y = batches(1)[0]
    fresh = executors.compile(g, [loss]).run({"x": x, "y": y}, {k: v.copy() for k, v in state.items()})[0]
    first = prog.run({"x": x, "y": y, **opt.feeds(0)}, state)[0]
    assert first == fresh
    second = prog.run({"x": x, "y": y, **opt.feeds(1)}, state)[0]
    assert second < first


def test_numpy_executor_update_is_bit_identical_to_reference():
    opt_args = dict(lr=optim.WarmupCosine(0.05, 2, 6), betas=(0.9, 0.95), weight_decay=0.1, clip_norm=0.3)
    params, data = init(5), batches(4, seed=9)
    ref, ref_norms = run_graphlm(optim.AdamW(**opt_args), params, data, executor="reference")
    fast, fast_norms = run_graphlm(optim.AdamW(**opt_args), params, data, executor="numpy")
    assert fast_norms == ref_norms
    for k in ref:
        assert fast[k].tobytes() == ref[k].tobytes(), k
