"""Tests for mpfunc_torch._src.loss_scale: the rule on torch tensors, and cross-framework parity."""

import numpy as np
import pytest
import torch
from anchors import apex_loss_scaler, assert_matches_anchor, megatron_scaler, torch_gradscaler
from hypothesis import given
from hypothesis import strategies as st

import mpfunc_torch
from _mpfunc_common.scale_config import ScaleConfig, resolve_scale_config
from mpfunc_torch import LossScaler

try:  # the JAX side, for the cross-checks only: a torch-only install skips those
    import jax
    import jax.numpy as jnp

    import mpfunc
except ModuleNotFoundError:
    jax = jnp = mpfunc = None
needs_jax = pytest.mark.skipif(mpfunc is None, reason="a cross-check with mpfunc (JAX), "
                               "which is not installed (the `jax` extra)")

MAX_STEPS = 128
seqs = st.lists(st.booleans(), min_size=1, max_size=MAX_STEPS)


def torch_trajectory(scaler, seq):
    out = []
    for finite in seq:
        scaler.update(torch.tensor(0.0 if finite else 1.0))
        out.append(scaler.scale.item())
    return np.asarray(out, np.float32)


def jax_states(opt, seq):
    params = {"a": jnp.ones((2,))}
    seq_arr = jnp.asarray(list(seq) + [True] * (MAX_STEPS - len(seq)))

    @jax.jit
    def run(seq_arr):
        def body(state, finite):
            g = {"a": jnp.where(finite, jnp.ones((2,)), jnp.full((2,), jnp.inf))}
            _, state = opt.update(g, state, params)
            return state, (state.loss_scale, state.growth_tracker, state.hysteresis_left,
                           state.skipped_steps)

        return jax.lax.scan(body, opt.init(params), seq_arr)[1]

    return [np.asarray(x)[: len(seq)] for x in run(seq_arr)]


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


configs = st.one_of(
    st.builds(lambda i: ("torch", dict(growth_interval=i)), st.integers(1, 5)),
    st.builds(lambda i, m: ("apex", dict(growth_interval=i, max_scale=m)), st.integers(1, 5),
              st.sampled_from([2.0**24, 2.0**17])),
    st.builds(lambda i, h: ("naive", dict(growth_interval=i, hysteresis=h)),
              st.integers(1, 5), st.integers(1, 3)),
    st.builds(lambda g, b: ("torch", dict(growth_factor=g, backoff_factor=b, growth_interval=2,
                                          init_scale=3.0)),
              st.sampled_from([1.5, 3.0, 1.1]), st.sampled_from([0.3, 0.75])),
)


@needs_jax
@given(configs, seqs)
def test_torch_and_jax_trajectories_are_bit_identical(cfg, seq):
    preset, kw = cfg
    scaler = LossScaler("dynamic", resolve_scale_config(preset, **kw))
    states_t = []
    for finite in seq:
        scaler.update(torch.tensor(0.0 if finite else 1.0))
        sd = scaler.state_dict()
        states_t.append((sd["loss_scale"].item(), sd["growth_tracker"].item(),
                         sd["hysteresis_left"].item(), sd["skipped_steps"].item()))
    scale_j, tracker_j, hyst_j, skipped_j = jax_states(mpfunc.dynamic_scale(preset=preset, **kw), seq)
    np.testing.assert_array_equal(bits([s[0] for s in states_t]), bits(scale_j))
    np.testing.assert_array_equal([s[1] for s in states_t], tracker_j)
    np.testing.assert_array_equal([s[2] for s in states_t], hyst_j)
    np.testing.assert_array_equal([s[3] for s in states_t], skipped_j)


@given(seqs, st.integers(1, 4))
def test_matches_real_torch_gradscaler(seq, interval):
    # The anchor itself: torch.amp.GradScaler on CPU, fed the same overflows.
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    gs = torch.amp.GradScaler("cpu", growth_interval=interval)
    ours = LossScaler("dynamic", resolve_scale_config("torch", growth_interval=interval))
    ref, mine = [], []
    for finite in seq:
        gs.scale(torch.ones(()))  # as in a real loop; creates the scale lazily
        param.grad = torch.full((3,), 1.0 if finite else float("inf"))
        gs.step(opt)
        gs.update()
        ref.append(gs.get_scale())
        ours.update(torch.tensor(0.0 if finite else 1.0))
        mine.append(ours.scale.item())
    assert_matches_anchor(mine, ref)
    np.testing.assert_array_equal(bits(ref), bits(torch_gradscaler(seq, interval=interval)))


@given(seqs)
def test_presets_match_plain_references(seq):
    for preset, ref in (("apex", apex_loss_scaler(seq)), ("naive", megatron_scaler(seq))):
        s = LossScaler("dynamic", resolve_scale_config(preset))
        assert_matches_anchor(torch_trajectory(s, seq), ref)


def test_torch_kernel_path_only_where_it_is_the_same_rule():
    assert LossScaler("dynamic", resolve_scale_config("torch"))._use_torch_kernel
    assert not LossScaler("dynamic", resolve_scale_config("apex"))._use_torch_kernel
    assert not LossScaler("dynamic", resolve_scale_config("naive"))._use_torch_kernel
    assert not LossScaler("dynamic", resolve_scale_config("torch", growth_factor=3.0))._use_torch_kernel


def test_static_and_none():
    s = LossScaler("static", static_scale=128.0)
    s.update(torch.tensor(1.0))
    assert s.metrics(as_python=True) == {"loss_scale": 128.0, "skipped_steps": 1,
                                         "consecutive_skips": 1, "last_finite": False}
    n = LossScaler("none")
    n.update(torch.tensor(0.0))
    assert n.metrics(as_python=True) == {"loss_scale": 1.0, "skipped_steps": 0,
                                         "consecutive_skips": 0, "last_finite": True}


def test_metrics_are_device_tensors_without_as_python():
    m = LossScaler().metrics()
    assert all(isinstance(v, torch.Tensor) for v in m.values())
    assert m["loss_scale"].dtype == torch.float32 and m["skipped_steps"].dtype == torch.int32


def test_state_dict_round_trip_continues_exactly(tmp_path):
    cfg = resolve_scale_config("naive", growth_interval=3, init_scale=2.0**10)
    a = LossScaler("dynamic", cfg)
    for f in (1.0, 0.0, 0.0):
        a.update(torch.tensor(f))
    path = tmp_path / "scaler.pt"
    torch.save(a.state_dict(), path)
    b = LossScaler("dynamic", cfg)
    b.load_state_dict(torch.load(path, weights_only=True))
    for f in (0.0, 1.0, 1.0, 0.0, 0.0, 0.0):
        a.update(torch.tensor(f))
        b.update(torch.tensor(f))
        assert a.state_dict()["loss_scale"].item() == b.state_dict()["loss_scale"].item()
    for k in ("growth_tracker", "hysteresis_left", "skipped_steps", "consecutive_skips",
              "last_finite"):
        assert torch.equal(a.state_dict()[k], b.state_dict()[k]), k


def test_load_state_dict_mismatches():
    a = LossScaler("dynamic", resolve_scale_config("naive"))
    with pytest.raises(ValueError, match="`state\\['kind'\\]`: saved 'none'"):
        LossScaler("static", static_scale=2.0).load_state_dict(LossScaler("none").state_dict())
    with pytest.raises(ValueError, match="missing keys"):
        a.load_state_dict({"kind": "dynamic"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="bogus"), "`kind`"),
    (dict(kind="static", static_scale=0.0), "`static_scale`"),
    (dict(kind="none", config=resolve_scale_config("torch")), "`config` only applies"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)


@needs_jax
@pytest.mark.parametrize("preset, kw", [
    ("torch", {}),
    ("apex", {}),
    ("naive", {"growth_interval": 3}),
    ("torch", {"init_scale": 2.0**-100, "min_scale": 2.0**-126, "growth_interval": 3}),
    ("torch", {"growth_factor": 3.0, "backoff_factor": 0.3, "init_scale": 3.0,
               "min_scale": 2.0**-126, "growth_interval": 2}),
])
def test_long_overflow_runs_stay_bit_identical_to_jax_and_never_leave_the_floor(preset, kw):
    # 200 overflows (far past the floor: 2**16 reaches 2**-126 after 142), then clean
    # steps back up. Without a floor torch reached 2**-127 and JAX 0 here.
    seq = [False] * 200 + [True] * 40 + [False] * 5 + [True] * 20
    cfg = resolve_scale_config(preset, **kw)
    scaler = LossScaler("dynamic", cfg)
    rows = []
    for finite in seq:
        scaler.update(torch.tensor(0.0 if finite else 1.0))
        sd = scaler.state_dict()
        rows.append([sd[k].item() for k in ("loss_scale", "growth_tracker", "hysteresis_left",
                                             "skipped_steps", "consecutive_skips")])
    rows = np.asarray(rows, np.float64)
    opt = mpfunc.dynamic_scale(preset=preset, **kw)
    params = {"a": jnp.ones((2,))}

    @jax.jit
    def run(seq_arr):
        def body(state, finite):
            g = {"a": jnp.where(finite, jnp.ones((2,)), jnp.full((2,), jnp.inf))}
            _, state = opt.update(g, state, params)
            return state, (state.loss_scale, state.growth_tracker, state.hysteresis_left,
                           state.skipped_steps)

        return jax.lax.scan(body, opt.init(params), seq_arr)[1]

    jax_rows = [np.asarray(x) for x in run(jnp.asarray(seq))]
    np.testing.assert_array_equal(bits(rows[:, 0]), bits(jax_rows[0]))
    for col in range(1, 4):
        np.testing.assert_array_equal(rows[:, col], jax_rows[col])
    scales = rows[:, 0]
    assert scales.min() == cfg.min_scale and np.all(scales <= cfg.max_scale)
    assert np.all(np.isfinite(scales)) and np.all(scales >= 2.0**-126)
    # consecutive_skips: the length of the current run of overflows
    expected, run_len = [], 0
    for finite in seq:
        run_len = 0 if finite else run_len + 1
        expected.append(run_len)
    np.testing.assert_array_equal(rows[:, 4], expected)


def _saved(**changes):
    s = LossScaler("dynamic", resolve_scale_config("naive", init_scale=2.0**10))
    s.update(torch.tensor(1.0))
    sd = s.state_dict()
    sd.update(changes)
    return sd


@pytest.mark.parametrize("key, value", [
    ("loss_scale", torch.tensor(float("nan"))), ("loss_scale", torch.tensor(0.0)),
    ("loss_scale", torch.tensor(-8.0)), ("loss_scale", torch.tensor(float("inf"))),
    ("loss_scale", torch.tensor(2.0**40)),  # above the saved config's max_scale (2**32)
    ("loss_scale", torch.ones(2)),
    ("growth_tracker", torch.tensor(-5)), ("growth_tracker", torch.tensor(1000)),
    ("growth_tracker", torch.tensor(2.5)),
    ("hysteresis_left", torch.tensor(99)), ("skipped_steps", torch.tensor(-1)),
    ("consecutive_skips", torch.tensor(2)), ("last_finite", torch.tensor(True)),
    ("last_finite", "yes"), ("config", None), ("config", {"hysteresis": 2}),
])
def test_corrupt_state_is_rejected_naming_the_key_and_changes_nothing(key, value):
    s = LossScaler("dynamic", resolve_scale_config("naive", init_scale=2.0**8))
    before = s.state_dict()
    with pytest.raises(ValueError, match=f"`state\\['{key}'\\]`"):
        s.load_state_dict(_saved(**{key: value}))
    after = s.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k not in ("kind", "config"))


def test_state_loads_into_another_config_keeping_its_hyperparameters():
    s = LossScaler("dynamic", resolve_scale_config("naive", init_scale=2.0**4,
                                                   growth_interval=7))
    s.load_state_dict(_saved())
    m = s.metrics(as_python=True)
    assert m == {"loss_scale": 2.0**10, "skipped_steps": 1, "consecutive_skips": 1,
                 "last_finite": False}  # hysteresis 2: the first overflow kept the scale
    assert s.config.growth_interval == 7
    st = LossScaler("static", static_scale=4.0)
    st.load_state_dict(LossScaler("static", static_scale=8.0).state_dict())
    assert st.scale.item() == 4.0  # a static scale is a hyperparameter


def test_loading_keeps_the_hyperparameters_where_gradscaler_takes_the_saved_ones():
    # What LossScaler.load_state_dict's docstring says of GradScaler, checked on the
    # installed torch: its load overwrites the growth factor and interval.
    saved = torch.amp.GradScaler("cpu", growth_interval=5, growth_factor=4.0)
    saved.scale(torch.ones(()))
    gs = torch.amp.GradScaler("cpu", growth_interval=100, growth_factor=2.0)
    gs.load_state_dict(saved.state_dict())
    assert (gs.get_growth_interval(), gs.get_growth_factor()) == (5, 4.0)
    # Ours keeps its own, and the scale follows them from the loaded state on.
    old = LossScaler("dynamic", ScaleConfig.from_preset("torch", growth_interval=5,
                                                        growth_factor=4.0))
    old.update(torch.tensor(1.0))  # an overflow: 2**15
    ours = LossScaler("dynamic", ScaleConfig.from_preset("torch", growth_interval=2))
    ours.load_state_dict(old.state_dict())
    assert ours.config == ScaleConfig.from_preset("torch", growth_interval=2)
    for _ in range(2):
        ours.update(torch.tensor(0.0))
    assert ours.scale.item() == 2.0**16  # grown once, by 2, after 2 clean steps


def test_scale_config_is_exported_and_built_from_a_preset():
    assert mpfunc_torch.ScaleConfig is ScaleConfig
    cfg = mpfunc_torch.ScaleConfig.from_preset("apex", min_scale=0.5)
    assert cfg == resolve_scale_config("apex", min_scale=0.5)
    assert LossScaler(config=cfg).may_go_below_one
    with pytest.raises(ValueError, match="`growth_intervl` is not a loss-scale field.*"
                                         "did you mean `growth_interval`"):
        ScaleConfig.from_preset("torch", growth_intervl=3)
    with pytest.raises(ValueError, match="preset"):
        ScaleConfig.from_preset("tensorflow")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(kind="static", static_scale="2"), TypeError, "`static_scale` must be a real number"),
    (dict(kind="static", static_scale=True), TypeError, "`static_scale` must be a real number"),
    (dict(kind="static", static_scale=1e39), ValueError, "`static_scale` must be a normal"),
    (dict(kind="static", static_scale=1e-40), ValueError, "`static_scale` must be a normal"),
    (dict(config={"init_scale": 2.0}), TypeError,
     r"`config` must be a ScaleConfig \(mpfunc_torch.ScaleConfig.from_preset\(preset, "),
    (dict(config="bogus"), ValueError, "`config` must be a ScaleConfig or one of"),
    (dict(device="gpu"), ValueError, "`device` must be a torch.device"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LossScaler(**kwargs)


def test_config_may_be_a_preset_name_and_static_below_one_is_checked_after_unscaling():
    assert LossScaler(config="apex").config == resolve_scale_config("apex")
    assert not LossScaler(config="apex").may_go_below_one
    assert LossScaler("static", static_scale=0.5).may_go_below_one
    assert LossScaler(config=resolve_scale_config("torch", init_scale=0.5,
                                                  min_scale=0.25)).may_go_below_one
