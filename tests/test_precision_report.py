"""Tests for mpfunc._src.precision_report (and the skip record in the loss-scale state)."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lenient import adam

import mpfunc
from _mpfunc_common.precision_report import FORMATS

# --- a plain NumPy reference of the per-leaf rule (LEAF_RULE) ---------------------------


def reference_row(name, g, scale, dtype):
    fmt = FORMATS[dtype]
    a = np.abs(np.asarray(g, np.float32)).reshape(-1)
    finite = np.isfinite(a)
    amax = float(a[finite].max()) if finite.any() else 0.0
    zeros = int(np.sum(a.view(np.int32) == 0))
    nonzero = a.size - zeros
    threshold = np.float32(np.float32(fmt.tiny / 2) / np.float32(scale))
    under = int(np.sum((a.view(np.int32) != 0) & (a <= threshold)))
    top = amax * float(np.float32(scale))
    return {
        "name": name,
        "nonfinite": bool((~finite).any()),
        "amax": amax,
        "zero_fraction": zeros / a.size if a.size else 0.0,
        "underflow_fraction": under / nonzero if nonzero else 0.0,
        "headroom_bits": math.inf if top == 0 else math.log2(fmt.max / top),
    }


elements = st.one_of(
    st.floats(-1e6, 1e6, width=32, allow_subnormal=False),
    st.sampled_from([0.0, -0.0, 1e-30, -3e-8, 2.0**-25, 2.0**-24, 6e-8, 1e-12, 65504.0,
                     np.inf, -np.inf, np.nan]),
)


@given(values=st.lists(elements, min_size=0, max_size=40),
       scale=st.sampled_from([1.0, 2.0**-3, 2.0, 1024.0, 2.0**16, 2.0**24]),
       dtype=st.sampled_from(sorted(FORMATS)))
def test_rows_match_a_numpy_reference(values, scale, dtype):
    g = np.asarray(values, np.float32)
    report = mpfunc.precision_report({"g": jnp.asarray(g)}, loss_scale=scale, dtype=dtype)
    assert report.rows() == [reference_row("['g']", g, scale, dtype)]


@given(values=st.lists(elements, min_size=1, max_size=30))
def test_a_half_precision_leaf_is_read_as_its_float32_values(values):
    with np.errstate(over="ignore"):  # values past float16's range become inf, as planned
        g16 = np.asarray(values, np.float32).astype(np.float16)
    got = mpfunc.precision_report([jnp.asarray(g16)], loss_scale=8.0).rows()
    assert got == [reference_row("[0]", g16.astype(np.float32), 8.0, "float16")]


# --- fault injection -----------------------------------------------------------------

def model_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"embed": jax.random.normal(k[0], (16, 8)),
            "layers": [{"w": jax.random.normal(k[1], (8, 8)), "b": jnp.zeros(8)},
                       {"w": jax.random.normal(k[2], (8, 8)), "b": jnp.zeros(8)}],
            "step": jnp.int32(3)}


def floats(f, tree):
    return jax.tree.map(lambda x: f(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def plant(tree, path, value):
    def f(p, x):
        if jax.tree_util.keystr(p) != path:
            return x
        return x.at[(0,) * x.ndim].set(jnp.asarray(value, x.dtype))
    return jax.tree_util.tree_map_with_path(f, tree)


PATHS = ["['embed']", "['layers'][0]['w']", "['layers'][1]['b']"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_planted_inf_or_nan_is_named_exactly_under_jit(path, bad):
    grads = plant(floats(jnp.ones_like, model_params()), path, bad)
    report = jax.jit(lambda g: mpfunc.precision_report(g, loss_scale=2.0**15))(grads)
    assert report.nonfinite_paths() == [path]
    assert [r["name"] for r in report.rows()] == ["['embed']", "['layers'][0]['b']",
                                                 "['layers'][0]['w']", "['layers'][1]['b']",
                                                 "['layers'][1]['w']"]
    assert str(report).splitlines()[2].startswith(path)  # worst first


def test_the_report_survives_a_jit_round_trip_bit_for_bit():
    grads = floats(lambda x: x * 1e-6, model_params())
    eager = mpfunc.precision_report(grads, loss_scale=2.0**10)
    jitted = jax.jit(lambda g: mpfunc.precision_report(g, loss_scale=2.0**10))(grads)
    assert jax.tree_util.tree_structure(eager) == jax.tree_util.tree_structure(jitted)
    assert eager.rows() == jitted.rows() and eager.paths == jitted.paths
    assert repr(jitted) == "PrecisionReport(5 leaves, dtype=float16)"


@pytest.mark.parametrize("mode, config", [
    ("torch", {}), ("apex", {"opt_level": "O1"}), ("apex", {"opt_level": "O2"}),
    ("apex", {"opt_level": "O3"}), ("naive", {}), ("bf16", {})])
@pytest.mark.parametrize("path", PATHS)
def test_every_mode_records_which_leaf_made_it_skip(mode, config, path):
    amp = mpfunc.convert_to_amp(lambda p, x: x, adam(1e-3), mode=mode,
                                record_skip_leaves=True, **config)
    params = model_params()
    del params["step"]  # (Adam steps floating params only)
    params = amp.cast_params(params)
    state = amp.optimizer.init(params)
    update = jax.jit(amp.optimizer.update)
    grads = floats(jnp.ones_like, params)
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == []
    _, state = update(plant(grads, path, jnp.nan), state, params)
    assert not state.last_finite
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == [path]
    # A finite step keeps the record of the last skip.
    _, state = update(grads, state, params)
    assert state.last_finite
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == [path]
    report = mpfunc.precision_report(plant(grads, path, jnp.inf), loss_scale=state,
                                     params=params)
    assert report.nonfinite_paths() == [path]


def test_the_skip_record_is_opt_in_and_then_one_reduction_per_leaf():
    # Without the record the update reduces as the finite check alone: one reduction per
    # group of alike leaves (embed, the two w, the two b) and the sum of the flags. With
    # it, one per leaf (so that every non-finite leaf is flagged) and the sum.
    params = model_params()
    del params["step"]
    check = jax.jit(mpfunc.all_finite).lower(params).as_text()
    assert check.count("stablehlo.reduce") == 4
    for record, reductions in ((False, 4), (True, 6)):
        opt = mpfunc.dynamic_scale(optax.sgd(0.1), record_skip_leaves=record)
        state = opt.init(params)
        assert (state.skip_leaves is not None) is record
        hlo = jax.jit(opt.update).lower(params, state, params).as_text()
        assert hlo.count("stablehlo.reduce") == reductions
    default = mpfunc.dynamic_scale(optax.sgd(0.1)).init(params)
    assert len(jax.tree.leaves(default)) == 6  # the fields' leaves before the record


@pytest.mark.parametrize("paths", [["['layers'][0]['w']", "['layers'][1]['w']"],
                                   ["['embed']", "['layers'][0]['b']", "['layers'][1]['b']"]])
@pytest.mark.parametrize("form", ["wrapper", "chain", "static", "none"])
def test_the_record_names_every_non_finite_leaf_even_among_alike_ones(paths, form):
    # The two w (and the two b) are reduced together by the default finite check; the
    # record must still name both when both overflow.
    params = floats(jnp.ones_like, model_params())
    del params["step"]
    opt = {"wrapper": lambda: mpfunc.dynamic_scale(optax.sgd(0.1), record_skip_leaves=True),
           "chain": lambda: mpfunc.chain(mpfunc.dynamic_scale(record_skip_leaves=True),
                                         optax.sgd(0.1)),
           "static": lambda: mpfunc.static_scale(8.0, optax.sgd(0.1), record_skip_leaves=True),
           "none": lambda: mpfunc.no_scale(optax.sgd(0.1), record_skip_leaves=True)}[form]()
    state = opt.init(params)
    grads = params
    for i, path in enumerate(paths):
        grads = plant(grads, path, [jnp.inf, jnp.nan, -jnp.inf][i])
    _, state = jax.jit(opt.update)(grads, state, params)
    assert not state.last_finite
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == paths
    assert mpfunc.precision_report(grads).nonfinite_paths() == paths


def test_a_state_without_the_record_says_how_to_keep_one():
    params = {"w": jnp.ones(2)}
    opt = mpfunc.dynamic_scale(optax.sgd(0.1))
    state = opt.init(params)
    _, state = opt.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    assert not state.last_finite and state.skip_leaves is None
    with pytest.raises(ValueError, match="record_skip_leaves=True"):
        mpfunc.scale_metrics(state, skip_leaves=params)
    assert "skip_leaves" not in mpfunc.scale_metrics(state)
    with pytest.raises(TypeError, match="`record_skip_leaves` must be a bool"):
        mpfunc.dynamic_scale(record_skip_leaves="yes")
    # A transformation without the record leaves a recording state's record as it was.
    rec = mpfunc.dynamic_scale(optax.sgd(0.1), record_skip_leaves=True)
    state = rec.init(params)
    _, state = rec.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    _, state = opt.update({"w": jnp.ones(2)}, state, params)
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == ["['w']"]


def mesh():
    return jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("path", ["['layers'][0]['w']", "['embed']"])
def test_shard_map_one_bad_shard_is_named_on_every_shard(path):
    m = mesh()
    params = floats(jnp.ones_like, model_params())
    del params["step"]
    specs = {"embed": P("data", None), "layers": [{"w": P(None, "model"), "b": P()}] * 2}
    opt = mpfunc.dynamic_scale(optax.sgd(0.1), axis_name=("data", "model"),
                               record_skip_leaves=True)
    state = opt.init(params)

    def step(grads, state):
        # The inf goes into one shard of the leaf (index 1 along the axis it is split
        # over), so that the leaf varies over the same axes as before.
        axis = {"['embed']": "data", "['layers'][0]['w']": "model"}[path]
        grads = jax.tree_util.tree_map_with_path(
            lambda p, g: jnp.where(jax.lax.axis_index(axis) == 1,
                                   g.at[(0,) * g.ndim].set(jnp.inf), g)
            if jax.tree_util.keystr(p) == path else g, grads)
        report = mpfunc.precision_report(grads, loss_scale=state,
                                         axis_name=("data", "model"))
        _, state = opt.update(grads, state)
        return report, state

    f = jax.jit(jax.shard_map(step, mesh=m, in_specs=(specs, P()), out_specs=(P(), P())))
    report, state = f(jax.device_put(params, jax.tree.map(lambda s: NamedSharding(m, s),
                                                          specs)), state)
    assert report.nonfinite_paths() == [path]
    sizes = {r: s for r, s in zip(report.paths, np.asarray(report.sizes))}
    assert sizes["['embed']"] == 16 * 8 and sizes["['layers'][0]['w']"] == 64
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == [path]


def test_under_plain_jit_sharded_leaves_need_no_axis_name():
    m = mesh()
    g = jax.device_put(jnp.ones((16, 8)).at[15, 7].set(jnp.nan),
                       NamedSharding(m, P("data", "model")))
    report = jax.jit(lambda g: mpfunc.precision_report({"w": g}))(g)
    assert report.nonfinite_paths() == ["['w']"] and int(report.sizes[0]) == 128


def test_one_pass_per_leaf_and_no_gradient_moves_under_plain_jit():
    # One variadic reduction per leaf where the leaf is whole on each device; four plain
    # ones where XLA partitions it (it would all-gather a variadic reduction's operand).
    grads = {"a": jnp.ones((8, 4)), "b": jnp.ones(4)}
    assert jax.jit(mpfunc.precision_report).lower(grads).as_text().count(
        "stablehlo.reduce") == 2
    m = mesh()
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(m, P("data", "model")))
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(m, P()))

    def f(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w.T)))(w)
        return mpfunc.precision_report({"w": g.at[0, 0].set(jnp.inf)})

    compiled = jax.jit(f).lower(w, x).compile()
    assert "all-gather" not in compiled.as_text()
    report = compiled(w, x)
    assert report.nonfinite_paths() == ["['w']"] and int(report.sizes[0]) == 128


def test_shard_map_without_axis_name_is_an_error():
    m = mesh()

    def f(g):
        return mpfunc.precision_report({"w": g}).amax

    with pytest.raises(ValueError, match="axis_name"):
        jax.jit(jax.shard_map(f, mesh=m, in_specs=P("data"), out_specs=P()))(jnp.ones(8))


# --- no host sync ----------------------------------------------------------------------

class HostRead(Exception):
    pass


@contextlib.contextmanager
def no_device_reads():
    """Makes reading a jax array's value on the host through Python raise:
    ``jax.device_get``, ``float``/``int``/``bool``, ``.item()``, ``.tolist()``. On CPU
    ``jax.transfer_guard_device_to_host`` lets all of these through, and NumPy's
    ``np.asarray`` reads a CPU array zero-copy through the buffer protocol, which no
    patch reaches; the report reads through ``jax.device_get`` only."""
    impl = type(jnp.ones(1))

    def refuse(*args, **kwargs):
        raise HostRead("a device value was read on the host")

    names = ["__array__", "tolist", "item", "__bool__", "__float__", "__int__", "__index__"]
    saved = {n: getattr(impl, n) for n in names}
    saved_value, saved_get = impl.__dict__["_value"], jax.device_get
    for n in names:
        setattr(impl, n, refuse)
    impl._value = property(refuse)
    jax.device_get = refuse
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            yield
    finally:
        for n, f in saved.items():
            setattr(impl, n, f)
        impl._value, jax.device_get = saved_value, saved_get


def test_the_guard_catches_a_read():
    x = jnp.ones(2) + 1
    reads = (lambda v: jax.device_get(v), lambda v: float(v[0]), lambda v: v.tolist(),
             lambda v: v[0].item(), lambda v: bool(v[0]))
    for read in reads:
        with pytest.raises(HostRead), no_device_reads():
            read(x)


def test_building_the_report_reads_no_device_value():
    grads = jax.device_put(floats(lambda x: x * 1e-3, model_params()))
    state = mpfunc.dynamic_scale(optax.sgd(0.1)).init(grads)
    step = jax.jit(lambda g, s: mpfunc.precision_report(g, loss_scale=s))
    step(grads, state)  # compiled outside the guard
    with no_device_reads():
        report = mpfunc.precision_report(grads, loss_scale=state)  # eagerly
        jitted = step(grads, state)
        repr(report)
        with pytest.raises(HostRead):
            report.rows()  # reading is what transfers
    assert jitted.rows() == report.rows()
    assert report.rows()[0]["name"] == "['embed']"


# --- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, err", [(jnp.int32, TypeError), ("bool", TypeError),
                                        (object(), TypeError), (jnp.float64, ValueError)])
def test_a_non_float_dtype_is_refused(dtype, err):
    with pytest.raises(err, match="`dtype`"):
        mpfunc.precision_report({"w": jnp.ones(2)}, dtype=dtype)


@pytest.mark.parametrize("scale, err", [(0.0, ValueError), (-2.0, ValueError),
                                        (np.float32(-1), ValueError), (math.nan, ValueError),
                                        (math.inf, ValueError), (True, TypeError),
                                        ("8", TypeError), (jnp.ones(2), TypeError)])
def test_a_bad_scale_is_refused(scale, err):
    with pytest.raises(err, match="`loss_scale`"):
        mpfunc.precision_report({"w": jnp.ones(2)}, loss_scale=scale)


def test_grads_that_do_not_match_the_params_are_refused():
    params = model_params()
    with pytest.raises(ValueError, match=r"`grads` do not match `params`.*\['embed'\]"):
        mpfunc.precision_report({**params, "embed": jnp.ones((2, 2))}, params=params)
    with pytest.raises(ValueError, match="`grads` do not match `params`"):
        mpfunc.precision_report({"w": jnp.ones(2)}, params=params)
    state = mpfunc.dynamic_scale(optax.sgd(0.1), record_skip_leaves=True).init(params)
    with pytest.raises(ValueError, match="`skip_leaves` must be the params"):
        mpfunc.scale_metrics(state, skip_leaves={"w": jnp.ones(2)})


def test_reading_inside_jit_is_a_clear_error():
    with pytest.raises(TypeError, match="outside `jit`"):
        jax.jit(lambda g: mpfunc.precision_report(g).rows())({"w": jnp.ones(2)})


# --- forward attribution ---------------------------------------------------------------

def test_linen_names_the_first_module_whose_output_went_nonfinite():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="out")(nn.relu(nn.Dense(4, name="hidden")(x)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, name="head")(Block(name="block")(x))

    x = jnp.ones((2, 3))
    variables = Net().init(jax.random.key(0), x)
    variables["params"]["block"]["out"]["kernel"] = jnp.full((4, 4), 1e37)  # overflows

    def loss(v):
        with mpfunc.watch_nonfinite() as watch:
            y = Net().apply(v, x * 300)
        return jnp.sum(y), watch.flags

    (_, flags), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables)
    assert flags.names == ("block/hidden", "block/out", "block", "head", "(root)")
    report = mpfunc.precision_report(grads, forward=flags)
    assert report.first_nonfinite_module == "block/out"
    assert "first non-finite module in the forward: block/out" in str(report)
    # Off by default: no forward flags, nothing named.
    assert mpfunc.precision_report(grads).first_nonfinite_module is None


def test_an_eager_watched_forward_compiles_one_flag_program_per_output_signature():
    # Eagerly, each module output's flag compiled isfinite, all and not for its shape.
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(4):  # four Dense outputs of one signature
                x = nn.Dense(6, name=f"d{i}")(x)
            return x

    x = jnp.ones((3, 6))
    variables = Net().init(jax.random.key(0), x)
    variables["params"]["d2"]["kernel"] = jnp.full((6, 6), jnp.nan)
    compiles = []

    def count(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(str(kw.get("fun_name")))

    def forward(v):
        with mpfunc.watch_nonfinite() as watch:
            Net().apply(v, x)
        return watch.flags

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        eager = forward(variables)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    flag_programs = [n for n in compiles if "any_nonfinite" in n]
    assert len(flag_programs) == 1, compiles  # the (3, 6) outputs: one program for all
    assert not {"jit(isfinite)", "jit(_reduce_all)"} & set(compiles), compiles  # op by op
    assert "eager_" not in str(jax.make_jaxpr(forward)(variables))
    traced = jax.jit(forward)(variables)
    assert eager.names == traced.names == ("d0", "d1", "d2", "d3", "(root)")
    assert eager.set_names() == traced.set_names() == ["d2", "d3", "(root)"]


def test_nnx_names_the_first_module_and_restores_the_classes():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 4, rngs=rngs)
            self.b = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    model = Net(nnx.Rngs(0))
    calls = Net.__dict__["__call__"], nnx.Linear.__dict__["__call__"]
    model.a.kernel[...] = model.a.kernel[...].at[0, 0].set(jnp.nan)

    def loss(m, x):
        with mpfunc.watch_nonfinite(m) as watch:
            y = m(x)
        return jnp.sum(y), watch.flags

    (_, flags), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, jnp.ones((2, 3)))
    assert flags.names == ("a", "b", "(root)")
    assert flags.set_names() == ["a", "b", "(root)"]
    assert mpfunc.precision_report(grads, forward=flags).first_nonfinite_module == "a"
    assert (Net.__dict__["__call__"], nnx.Linear.__dict__["__call__"]) == calls  # restored
    with pytest.raises(TypeError, match="NNX modules"), mpfunc.watch_nonfinite(object()):
        pass


def test_empty_and_integer_leaves_are_never_named():
    tree = {"e": jnp.ones((0, 2)), "i": jnp.arange(3), "w": jnp.ones(2)}
    opt = mpfunc.dynamic_scale(record_skip_leaves=True)  # chain form: integers pass through
    state = opt.init(tree)
    _, state = opt.update(tree, state, tree)
    assert bool(state.last_finite)
    assert mpfunc.scale_metrics(state, skip_leaves=tree)["skip_leaves"] == []
    _, state = opt.update({**tree, "w": jnp.array([1.0, jnp.inf])}, state, tree)
    assert mpfunc.scale_metrics(state, skip_leaves=tree)["skip_leaves"] == ["['w']"]
    rows = mpfunc.precision_report(tree).rows()
    assert [r["name"] for r in rows] == ["['e']", "['w']"]
    assert rows[0] == {"name": "['e']", "nonfinite": False, "amax": 0.0, "zero_fraction": 0.0,
                       "underflow_fraction": 0.0, "headroom_bits": math.inf}


def test_nnx_optimizer_state_is_read_as_values_not_live_variables():
    # nnx.Optimizer keeps its optax state in mutable NNX variables. The report and the
    # metrics held those variables, so after `update` (a skip here: the scale halves)
    # they showed the new scale, and headroom_bits was one bit off the step's.
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, mpfunc.dynamic_scale(adam(1e-3)), wrt=nnx.Param)
    x = jnp.ones((4, 3))

    def loss(m):  # the bias gradient is inf, the kernel's finite
        return mpfunc.scale_loss(jnp.sum(m(x)) + jnp.sum(m.bias[...]) * jnp.inf,
                                 opt.opt_state)

    scaled = nnx.grad(loss)(model)
    scale = float(mpfunc.loss_scale(opt.opt_state))
    grads = jax.tree.map(lambda g: g / scale, scaled)
    report = mpfunc.precision_report(grads, loss_scale=opt.opt_state)
    metrics = mpfunc.scale_metrics(opt.opt_state)
    before = report.rows()
    want = mpfunc.precision_report(grads, loss_scale=scale).rows()
    assert before == want and before[0]["nonfinite"] and not before[1]["nonfinite"]
    opt.update(model, scaled)  # skipped: the scale halves
    assert float(mpfunc.loss_scale(opt.opt_state)) == scale / 2
    assert report.rows() == want  # the kernel's headroom_bits still the step's
    assert float(report.loss_scale) == scale
    assert float(metrics["loss_scale"]) == scale and int(metrics["skipped_steps"]) == 0
    assert int(mpfunc.scale_metrics(opt.opt_state)["skipped_steps"]) == 1


# --- the update-cancelled column (CANCEL_RULE) ------------------------------------------


def reference_cancelled(p, u):
    """CANCEL_RULE in NumPy (ml_dtypes rounds float32 to bfloat16 to nearest even)."""
    v = np.asarray(u, np.float32).reshape(-1)
    p = np.asarray(p).reshape(-1)
    new = (p.astype(np.float32) + v).astype(p.dtype)
    nonzero = (v.view(np.int32) & 0x7FFFFFFF) != 0
    updated = int(nonzero.sum())
    return int((nonzero & (new == p)).sum()) / updated if updated else 0.0


# Normal float32 values only, whose sums are never subnormal (XLA on CPU flushes those).
normal = st.floats(-1e4, 1e4, width=32).filter(lambda x: x == 0 or abs(x) > 1e-20)
steps = st.one_of(normal, st.sampled_from([0.0, -0.0, 1e-4, -1e-4, 2.0**-8, 2.0**-9, 1e-2,
                                           3e-3, np.inf, np.nan]))


@given(pairs=st.lists(st.tuples(normal, steps), min_size=0, max_size=24),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_update_cancelled_matches_a_numpy_reference(pairs, dtype):
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.asarray([a for a, _ in pairs], np.float32).astype(jnp.dtype(dtype))
        u = np.asarray([b for _, b in pairs], np.float32)
        want = reference_cancelled(p, u)
    report = mpfunc.precision_report({"w": jnp.zeros(len(pairs))},
                                     params={"w": jnp.asarray(p)},
                                     updates={"w": jnp.asarray(u)})
    assert report.rows()[0]["update_cancelled"] == want


def test_an_update_below_half_a_bfloat16_ulp_is_cancelled():
    ones = jnp.ones(8, jnp.bfloat16)
    mixed = jnp.array([1e-4] * 3 + [1e-2] * 4 + [0.0], jnp.float32)  # zeros do not count
    params = {"small": ones, "large": ones, "mixed": ones}
    updates = {"small": jnp.full(8, 1e-4), "large": jnp.full(8, -1e-2), "mixed": mixed}
    grads = jax.tree.map(jnp.ones_like, params)
    report = jax.jit(lambda g, p, u: mpfunc.precision_report(g, params=p, updates=u))(
        grads, params, updates)
    got = {r["name"]: r["update_cancelled"] for r in report.rows()}
    assert got == {"['large']": 0.0, "['mixed']": 3 / 7, "['small']": 1.0}
    lines = str(report).splitlines()
    assert lines[1].split()[-2:] == ["update", "cancelled"]
    assert lines[2].endswith("0.0%") and "42.9%" in str(report) and "100.0%" in str(report)
    assert "update_cancelled" not in mpfunc.precision_report(grads).rows()[0]
    assert "cancelled" not in str(mpfunc.precision_report(grads))


def test_plain_bfloat16_sgd_stalls_where_every_master_storage_loses_nothing():
    params = {"w": jnp.ones(64, jnp.bfloat16)}
    grads = {"w": jnp.linspace(0.5, 1.5, 64).astype(jnp.bfloat16)}
    plain = optax.sgd(1e-4)
    updates, _ = plain.update(grads, plain.init(params), params)
    report = mpfunc.precision_report(grads, params=params, updates=updates)
    assert report.rows()[0]["update_cancelled"] == 1.0
    assert bool(jnp.all(optax.apply_updates(params, updates)["w"] == params["w"]))
    for storage in ["float32", "remainder", "kahan", "stochastic"]:
        opt = mpfunc.master_weights(optax.sgd(1e-4), storage=storage,
                                    seed=int(storage == "stochastic"))
        state, p = opt.init(params), params

        @jax.jit
        def step(state, p, opt=opt):
            updates, state = opt.update(grads, state, p)
            report = mpfunc.precision_report(grads, params=p, updates=updates)
            return state, optax.apply_updates(p, updates), report.update_counts

        moved = 0
        for _ in range(40):
            state, new, counts = step(state, p)
            assert int(counts[0, 1]) == 0, storage  # no update is cancelled: each lands
            moved += int(jnp.sum(new["w"] != p["w"]))
            p = new
        assert moved > 0, storage  # the storage did carry the small steps
    # What float32 masters lose of the same step: nothing.
    masters = {"w": jnp.ones(64, jnp.float32)}
    inner = {"w": -1e-4 * grads["w"].astype(jnp.float32)}
    row = mpfunc.precision_report(grads, params=masters, updates=inner).rows()[0]
    assert row["update_cancelled"] == 0.0


def test_update_counts_are_summed_over_shards():
    m = mesh()
    spec = {"w": P("data", "model")}
    grads = {"w": jnp.ones((16, 8))}
    params = {"w": jnp.ones((16, 8), jnp.bfloat16)}
    updates = {"w": jnp.where(jnp.arange(16)[:, None] < 5, 1e-4, 1e-2)
               * jnp.ones((16, 8))}

    def report_of(g, p, u):
        return mpfunc.precision_report(g, params=p, updates=u, axis_name=("data", "model"))

    f = jax.jit(jax.shard_map(report_of, mesh=m, in_specs=(spec, spec, spec), out_specs=P()))
    put = lambda t: jax.device_put(t, {"w": NamedSharding(m, spec["w"])})  # noqa: E731
    sharded = f(put(grads), put(params), put(updates))
    assert sharded.rows()[0]["update_cancelled"] == 5 / 16
    assert np.asarray(sharded.update_counts).tolist() == [[128, 40]]
    whole = mpfunc.precision_report(grads, params=params, updates=updates)
    assert sharded.rows() == whole.rows()


def test_updates_need_params_of_their_structure():
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"`updates` need `params`"):
        mpfunc.precision_report(params, updates=params)
    with pytest.raises(ValueError, match=r"`updates` do not match `params`.*\['v'\]"):
        mpfunc.precision_report(params, params=params, updates={"v": jnp.ones(2)})


def test_an_eager_report_is_one_program_and_a_traced_one_inlines():
    # Outside jit, every op on every leaf compiled a program of its own: 138 compiles and
    # 5.2 s for the first report of 8 leaves of new shapes (measured, with `updates=`).
    # Now the device work is one program for the columns and one for the updates.
    compiles = []

    def count(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    shapes = [(3, 9), (5, 9), (7, 9), (11, 9), (13, 9), (17, 9)]  # new to this test file
    grads = {f"l{i}": jnp.linspace(-1e-7, 2.0, math.prod(s), dtype=jnp.float32).reshape(s)
             for i, s in enumerate(shapes)}
    grads["l0"] = grads["l0"].at[0, 0].set(jnp.inf)
    params = {k: jnp.ones(v.shape, jnp.bfloat16) for k, v in grads.items()}
    updates = jax.tree.map(lambda g: g * 1e-3, grads)
    jax.block_until_ready((grads, params, updates))
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        eager = mpfunc.precision_report(grads, loss_scale=1024.0, params=params,
                                        updates=updates)
        jax.block_until_ready(eager)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    ours = [n for n in compiles if "eager_" in str(n)]
    assert len(ours) == 2 and len(compiles) <= 4, compiles

    def report(g, p, u):
        return mpfunc.precision_report(g, loss_scale=1024.0, params=p, updates=u)

    jaxpr = jax.make_jaxpr(report)(grads, params, updates)
    assert "eager_" not in str(jaxpr)
    traced = jax.jit(report)(grads, params, updates)
    assert eager.rows() == traced.rows()
    assert eager.rows()[0]["nonfinite"] and not eager.rows()[1]["nonfinite"]
    for row, (name, g) in zip(eager.rows(), grads.items()):
        ref = reference_row(f"['{name}']", g, 1024.0, "float16")
        assert {k: row[k] for k in ref} == pytest.approx(ref), name
