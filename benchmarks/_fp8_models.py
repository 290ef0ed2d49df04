"""The models of ``benchmarks/fp8.py``.

* ``linear``: 4 x ``Linear(d, d, bias=False)`` + GELU, MSE loss, AdamW.
* ``gpt``: the demo's GPT-style decoder (``examples/compare_modes.py``'s `torch_model`
  and `jax_apply`, the JAX run starting from the torch init), trained on the demo's
  corpus (Python's standard library, character level), AdamW. Every variant trains
  from the same init on the same batches, so their losses at the same step compare.
* ``dot``: one ``jax.value_and_grad`` of a d x d x d matmul with bfloat16 inputs: fp8
  as ``mpfunc.fp8_dot(x, w).astype(float32).sum()``, against
  ``jnp.dot(x, w).astype(float32).sum()``: both backward GEMMs then take a bfloat16
  cotangent, as the fp8 path's do (with ``preferred_element_type=float32`` instead,
  bf16's backward GEMMs would read a float32 cotangent).

Each ``*_variant`` returns ``(step, sync, extra)``: ``step(i)`` runs training step ``i``
(its loss, or None), ``sync()`` waits for the device, ``extra`` has ``compile_s`` for
JAX (lowering and compiling the step, timed on its own).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from types import SimpleNamespace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAYERS = 4  # the linear model's


def linear_flops(d: int, batch: int) -> float:
    return LAYERS * 3 * 2.0 * batch * d * d


def torch_linear(d, batch, recipe, compiled, device, backend):
    """A step of the linear model in ``mode="bf16"`` (recipe None) or ``"fp8"``."""
    import torch

    import mpfunc_torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(d, d, bias=False), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device.type == "cuda")
    mode, cfg = ("bf16", {}) if recipe is None else ("fp8", {"recipe": recipe})
    model, aopt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                                    **cfg)
    if compiled:
        model = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(batch, d, device=device)
    target = torch.zeros(batch, d, device=device)

    def step(i):
        aopt.zero_grad()
        aopt.backward(crit(model(x), target))
        aopt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return step, sync, {}


def jax_linear(d, batch, recipe, device):
    """A jitted step of the linear model through ``mpfunc.convert_to_amp``."""
    import jax
    import jax.numpy as jnp
    import optax

    import mpfunc

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    params = {f"w{i}": jax.random.normal(keys[i], (d, d), jnp.float32) / d**0.5
              for i in range(LAYERS)}

    def apply(p, x):
        for i in range(LAYERS):
            x = jax.nn.gelu(x @ p[f"w{i}"])
        return x

    mode, cfg = ("bf16", {}) if recipe is None else ("fp8", {"recipe": recipe})
    amp = mpfunc.convert_to_amp(apply, optax.adamw(1e-4), mode=mode, **cfg)
    x = jax.device_put(jax.random.normal(keys[-1], (batch, d), jnp.float32), dev)
    params = jax.device_put(amp.cast_params(params), dev)
    delayed = recipe == "delayed"
    # Committed to the device like the step's outputs: one compile serves every step.
    carry = jax.device_put([params, amp.optimizer.init(params),
                            amp.apply_fn.init(params, x) if delayed else None], dev)

    def loss_fn(p, s, x):
        out = amp.apply_fn(p, x, fp8_state=s) if delayed else amp.apply_fn(p, x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    def train(p, o, s, x):
        if delayed:
            g, s = jax.grad(loss_fn, argnums=(0, 1))(p, s, x)
        else:
            g = jax.grad(loss_fn)(p, s, x)
        updates, o = amp.optimizer.update(g, o, p)
        return optax.apply_updates(p, updates), o, s

    t0 = time.perf_counter()
    compiled = jax.jit(train, donate_argnums=(0, 1, 2)).lower(*carry, x).compile()
    compile_s = time.perf_counter() - t0

    def step(i):
        carry[:] = compiled(*carry, x)

    return step, lambda: jax.block_until_ready(carry), {"compile_s": compile_s}




def gpt_config(width: int, layers: int, context: int, batch: int, steps: int,
               heads: int | None = None) -> SimpleNamespace:
    """The demo's config fields (its `torch_model` / `jax_apply` read them)."""
    return SimpleNamespace(width=width, layers=layers, context=context, batch=batch,
                           heads=heads or max(1, width // 128), seed=0, lr=3e-4, steps=steps)


def gpt_flops(cfg) -> float:
    """Matmul flops of one training step (forward + backward = 3x forward): the
    Linears (12 d² per layer, d x vocab for the head) for every token, and attention's
    two products over the whole t x t square (as the model computes them)."""
    _, data = _demo()
    tokens = cfg.batch * cfg.context
    linear = 2.0 * tokens * (12 * cfg.layers * cfg.width**2 + cfg.width * data.VOCAB)
    attention = 2.0 * 2 * cfg.batch * cfg.layers * cfg.context**2 * cfg.width
    return 3 * (linear + attention)


def _demo():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import compare_modes
    import data

    return compare_modes, data


@functools.cache
def _batches(context: int, batch: int, n: int):
    _, data = _demo()
    train, _ = data.split(data.load_corpus())
    it = data.windows(train, context, batch, seed=0)
    return [next(it) for _ in range(n)]


def _mode(recipe):
    return ("bf16", {}) if recipe is None else ("fp8", {"recipe": recipe})


def torch_gpt(cfg, recipe, compiled, device, backend):
    import torch

    import mpfunc_torch

    compare_modes, _ = _demo()
    with torch.device(device):  # initialised on the device: fast at 0.8B parameters
        net = compare_modes.torch_model(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, fused=device.type == "cuda")
    mode, kw = _mode(recipe)
    model, aopt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                    mode=mode, **kw)
    if compiled:
        model = torch.compile(model, backend=backend)
    batches = [(torch.from_numpy(x).long().to(device), torch.from_numpy(y).long().to(device))
               for x, y in _batches(cfg.context, cfg.batch, cfg.steps)]

    def step(i):
        x, y = batches[i % len(batches)]
        aopt.zero_grad()
        loss = crit(model(x).flatten(0, 1), y.flatten())
        aopt.backward(loss)
        aopt.step()
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return step, sync, {}


@functools.cache
def _jax_init(width, layers, context, heads, torch_device):
    """The torch init as JAX params (once per shape: every JAX variant starts from it)."""
    import torch

    compare_modes, _ = _demo()
    cfg = SimpleNamespace(width=width, layers=layers, context=context, heads=heads, seed=0)
    with torch.device(torch_device):
        return compare_modes.torch_to_jax_params(compare_modes.torch_model(cfg))


def jax_gpt(cfg, recipe, device):
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    import mpfunc

    compare_modes, _ = _demo()
    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    init = _jax_init(cfg.width, cfg.layers, cfg.context, cfg.heads,
                     "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu")
    mode, kw = _mode(recipe)
    amp = mpfunc.convert_to_amp(compare_modes.jax_apply(cfg), optax.adamw(cfg.lr), mode=mode,
                                **kw)
    batches = jax.device_put(_batches(cfg.context, cfg.batch, cfg.steps), dev)
    params = jax.device_put(amp.cast_params(jax.tree.map(jnp.asarray, init)), dev)
    delayed = recipe == "delayed"
    carry = jax.device_put([params, amp.optimizer.init(params),
                            amp.apply_fn.init(params, batches[0][0]) if delayed else None], dev)

    def loss_fn(p, s, x, y):
        logits = amp.apply_fn(p, x, fp8_state=s) if delayed else amp.apply_fn(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y).mean()

    def train(p, o, s, x, y):
        if delayed:
            loss, (g, s) = jax.value_and_grad(loss_fn, argnums=(0, 1))(p, s, x, y)
        else:
            loss, g = jax.value_and_grad(loss_fn)(p, s, x, y)
        updates, o = amp.optimizer.update(g, o, p)
        return optax.apply_updates(p, updates), o, s, loss

    t0 = time.perf_counter()
    compiled = jax.jit(train, donate_argnums=(0, 1, 2)).lower(*carry, *batches[0]).compile()
    compile_s = time.perf_counter() - t0

    def step(i):
        carry[0], carry[1], carry[2], loss = compiled(*carry, *batches[i % len(batches)])
        return loss

    return step, lambda: jax.block_until_ready(carry), {"compile_s": compile_s}


def dot_loss(recipe):
    """``loss(x, w, state)`` of the dot model: the product's float32 sum, so that its
    cotangent (ones) reaches the product in the product's dtype, bfloat16 or fp8's."""
    import jax.numpy as jnp

    import mpfunc

    def loss(x, w, s):
        y = jnp.dot(x, w) if recipe is None else mpfunc.fp8_dot(x, w, recipe, s)
        return y.astype(jnp.float32).sum()

    return loss


def jax_dot(d, recipe, device):
    import jax
    import jax.numpy as jnp

    import mpfunc

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (d, d), jnp.bfloat16), dev)
    w = jax.device_put((jax.random.normal(kw, (d, d), jnp.float32) / d**0.5)
                       .astype(jnp.bfloat16), dev)
    delayed = recipe == "delayed"
    state = [jax.device_put(mpfunc.fp8_dot_state(recipe), dev) if delayed else None]
    fn = jax.value_and_grad(dot_loss(recipe), argnums=(0, 1, 2) if delayed else (0, 1))
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(x, w, state[0]).compile()
    compile_s = time.perf_counter() - t0
    out = [None]

    def step(i):
        out[0] = compiled(x, w, state[0])
        if delayed:
            state[0] = out[0][1][2]
        return None

    return step, lambda: jax.block_until_ready(out), {"compile_s": compile_s}
