"""Pipeline stages under ``shard_map``: the finite check and the clipping norm reduce over
the stage axis, so all stages skip together and clip by one factor.

Two residual blocks, one per stage of a ("data", "stage") = (4, 2) mesh; each data shard
runs 4 micro-batches through a GPipe schedule (``ppermute`` between stages) and autodiff
gives the backward pass. The result must equal the same two blocks applied in sequence
on one device, with clipping active and an overflow injected into stage 1's gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from lenient import lenient

import mpfunc

W, S, M, MB = 16, 2, 4, 4          # width, stages, micro-batches, micro-batch size
DATA = 4                           # data-parallel shards
SPECS = {"w": P("stage"), "b": P("stage")}
MAX_NORM, STEPS, POISON_AT = 0.05, 6, 3


def init_params():
    rng = np.random.default_rng(0)
    return {"w": (rng.normal(size=(S, W, W)) / np.sqrt(W)).astype(np.float32),
            "b": (rng.normal(size=(S, W)) * 0.1).astype(np.float32)}


def block(w, b, h):
    return h + jnp.tanh(h @ w + b)


def batches():
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        x = rng.normal(size=(DATA * M * MB, W)).astype(np.float32)
        yield x, np.sin(2 * x[:, ::-1]).astype(np.float32)


def optimizer(axis_name=None):
    clip = (mpfunc.clip_by_global_norm(MAX_NORM, axis_name=axis_name) if axis_name
            else optax.clip_by_global_norm(MAX_NORM))
    return mpfunc.dynamic_scale(optax.chain(clip, lenient(optax.adam(1e-2))),
                                axis_name=axis_name)


def train_sequential():
    """Both stages in sequence on one device: the reference."""
    opt = optimizer()
    params = init_params()
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y, poison):
        def loss_fn(p):
            h = block(p["w"][0], p["b"][0], x)
            loss = jnp.mean(jnp.square(block(p["w"][1], p["b"][1], h) - y))
            return mpfunc.scale_loss(loss, state), loss

        g, loss = jax.grad(loss_fn, has_aux=True)(params)
        norm = optax.tree.norm(jax.tree.map(lambda a: a / state.loss_scale, g))
        g["w"] = jnp.where(poison, g["w"].at[1, 0, 0].set(jnp.inf), g["w"])
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss, norm

    losses, norms, scales = [], [], []
    for i, (x, y) in enumerate(batches()):
        params, state, loss, norm = step(params, state, x, y, jnp.bool_(i == POISON_AT))
        losses.append(float(loss))
        norms.append(float(norm))
        scales.append(float(state.loss_scale))
    return params, losses, norms, scales


def pipelined_step(opt):
    def step(params, state, x, y, poison):
        stage = jax.lax.axis_index("stage")
        xs, ys = x.reshape(M, MB, W), y.reshape(M, MB, W)

        def loss_fn(p):
            w, b = p["w"][0], p["b"][0]
            carry, outs = jnp.zeros((MB, W), jnp.float32), []
            for t in range(M + S - 1):  # GPipe forward; stage s works on micro-batch t - s
                inp = jnp.where(stage == 0, xs[min(t, M - 1)], carry)
                out = block(w, b, inp)
                if t >= S - 1:
                    outs.append(out)  # on the last stage: micro-batch t - (S - 1)
                carry = jax.lax.ppermute(out, "stage", [(i, i + 1) for i in range(S - 1)])
            local = jnp.mean(jnp.square(jnp.stack(outs) - ys))
            loss = jax.lax.psum(jnp.where(stage == S - 1, local, 0.0), "stage")
            loss = jax.lax.pmean(loss, "data")
            return mpfunc.scale_loss(loss, state), loss

        g, loss = jax.grad(loss_fn, has_aux=True)(params)
        # The overflow lives in stage 1's gradients only; stage 0's are finite.
        g["w"] = jnp.where(poison & (stage == 1), g["w"].at[0, 0, 0].set(jnp.inf), g["w"])
        u, state = opt.update(g, state, params)
        decision = jnp.broadcast_to(state.last_finite, (1, 1))
        return optax.apply_updates(params, u), state, loss, decision

    return step


def train_pipelined(axis_name=("data", "stage")):
    mesh = jax.make_mesh((DATA, S), ("data", "stage"), axis_types=(AxisType.Auto,) * 2)
    opt = optimizer(axis_name)
    state_specs = mpfunc.state_sharding(opt, SPECS)
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
              for k, v in init_params().items()}
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(SPECS,),
                                  out_specs=state_specs))(params)
    step = jax.jit(jax.shard_map(
        pipelined_step(opt), mesh=mesh,
        in_specs=(SPECS, state_specs, P("data"), P("data"), P()),
        out_specs=(SPECS, state_specs, P(), P("data", "stage"))))
    history = []
    for i, (x, y) in enumerate(batches()):
        before = jax.device_get((params, state.inner_state))
        params, state, loss, decision = step(params, state, x, y, jnp.bool_(i == POISON_AT))
        after = jax.device_get((params, state.inner_state))
        unchanged = all(np.array_equal(a, b) for a, b in
                        zip(jax.tree.leaves(after), jax.tree.leaves(before)))
        history.append(dict(loss=float(loss), decision=np.asarray(decision),
                            scale=float(state.loss_scale), unchanged=unchanged))
    return jax.device_get(params), history


def test_pipeline_skips_together_clips_globally_and_equals_sequential():
    ref_params, ref_losses, ref_norms, ref_scales = train_sequential()
    params, history = train_pipelined()
    assert all(n > 2 * MAX_NORM for n in ref_norms), ref_norms  # clipping active
    poisoned = history[POISON_AT]
    assert not poisoned["decision"].any(), "a stage stepped on the overflow step"
    assert poisoned["unchanged"]  # params, Adam moments and counts on both stages
    assert all(h["decision"].all() and not h["unchanged"]
               for i, h in enumerate(history) if i != POISON_AT)
    assert [h["scale"] for h in history] == ref_scales
    assert ref_scales[POISON_AT] == ref_scales[POISON_AT - 1] / 2
    # Tolerance: the pipelined run sums the same float32 products in another order
    # (micro-batches, psums over data and stage); rtol 1e-5 over 6 Adam steps.
    np.testing.assert_allclose([h["loss"] for h in history], ref_losses, rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(params[k], np.asarray(ref_params[k]), rtol=1e-5, atol=1e-6)


def test_forgetting_the_stage_axis_is_a_trace_time_error():
    # With axis_name="data" only, stage 1 would skip and stage 0 would step; shard_map's
    # varying-axes typing sees the scale differ across "stage" and refuses the out_specs.
    with pytest.raises(ValueError, match=r"varying over \{stage\}"):
        train_pipelined(axis_name="data")
