"""Every torch mode under ``torch.compile``: one graph, the mode's dtypes, same training.

The ``aot_eager`` backend keeps these quick on CPU: dynamo captures the graph and AOT
autograd traces forward and backward, without generating kernels.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch_task import ALL_MODES, CharMLP, batches, ids, is_o3, make_model, make_opt

import mpfunc_torch

pytestmark = [
    pytest.mark.filterwarnings(
        # dynamo's own notice when a test process compiles more than its cache limit.
        "ignore:.*torch._dynamo hit config.*:UserWarning"),
    pytest.mark.filterwarnings(
        # dynamo traces an autograd.Function (the fp8 mode's Fp8Linear) by instantiating
        # the base Function under catch_warnings(record=True), which does not reset an
        # "error" filter (torch/_dynamo/side_effects.py, track_object_new).
        "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
        ":DeprecationWarning"),
]


def probe(net):
    """Records the dtype each Linear / LayerNorm returns (hooks run in compiled code too).
    The dict has its keys from the start: dynamo then guards on nothing that changes."""
    layers = {n: m for n, m in net.named_modules()
              if isinstance(m, torch.nn.Linear | torch.nn.LayerNorm)}
    seen = dict.fromkeys(layers)
    for name, m in layers.items():
        m.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, out.dtype))
    return seen


def convert(net, mode, cfg):
    opt = make_opt(net.parameters(), "sgd" if is_o3(cfg) else "adam", fused=False)
    return mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(), mode=mode, **cfg)


def run(model, opt, crit, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = crit(model(x), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=ids)
def test_every_mode_compiles_to_one_graph_and_trains_like_eager(mode, cfg):
    data = batches(3, batch=32)
    eager_net = make_model()
    eager_seen = probe(eager_net)
    eager_losses = run(*convert(eager_net, mode, cfg), data)

    net = make_model()
    seen = probe(net)
    model, opt, crit = convert(net, mode, cfg)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    losses = run(compiled, opt, crit, data)
    assert counter.frame_count == 1  # one graph, compiled once, reused every step
    # The compiled model computes each layer in the dtype the eager one does.
    assert seen == eager_seen and None not in seen.values()
    tol = 1e-5 if mode == "apex" and cfg["opt_level"] == "O0" else 2e-2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=tol,
                               atol=tol)
    if cfg.get("opt_level") == "O1":  # apex's fp32 list holds inside the graph
        assert seen == {"fc1": torch.float16, "norm": torch.float32,
                              "fc2": torch.float16}


def test_o1_when_the_inner_module_is_compiled():
    # convert_to_amp(torch.compile(net)): the conversion goes inside the compiled module,
    # so the casts and the fp32 list are part of its graph.
    x, _ = batches(1, batch=8)[0]
    net = make_model()
    seen = probe(net)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, backend=counter, fullgraph=True)
    model, _, _ = convert(compiled, "apex", {"opt_level": "O1", "verbosity": 0})
    out = model(x)
    assert counter.frame_count == 1 and out.dtype == torch.float16
    assert seen == {"fc1": torch.float16, "norm": torch.float32, "fc2": torch.float16}


@pytest.mark.filterwarnings(  # dynamo probes `.grad` of its non-leaf input (and hides it)
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_o1_calls_a_compiled_submodule_inside_its_fp32_mode():
    # The fp32-list mode is active when the compiled frame starts; torch 2.13's dynamo
    # used to fail building its guards (NameError: ___get_torch_function_mode_stack_at).
    class Net(CharMLP):
        def __init__(self):
            super().__init__()
            self.block = torch.compile(torch.nn.Sequential(self.fc1, self.norm),
                                       backend="aot_eager", fullgraph=True)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.block(self.embed(x).flatten(1)))
            return self.fc2(h)

    torch.manual_seed(0)
    net = Net()
    seen = probe(net)
    model, opt, crit = convert(net, "apex", {"opt_level": "O1", "verbosity": 0})
    losses = run(model, opt, crit, batches(2, batch=8))
    assert all(l == l for l in losses)  # noqa: E741 - finite (not NaN)
    assert seen == {"fc1": torch.float16, "norm": torch.float32, "fc2": torch.float16}


def test_o1_compiles_a_huggingface_llama_in_one_graph():
    # The model from the report: a real transformer, apex O1, fullgraph.
    hf = pytest.importorskip("test_hf_transformers")
    data = [hf.data("llama")] * 2
    losses = {}
    for compiled in (False, True):
        net = hf.build("llama")
        model, opt, _ = hf.convert(net, "apex", {"opt_level": "O1", "verbosity": 0})
        counter = CompileCounterWithBackend("aot_eager")
        run_model = torch.compile(model, backend=counter, fullgraph=True) if compiled else model
        losses[compiled] = []
        for x, y in data:
            opt.zero_grad()
            out = run_model(input_ids=x, labels=y)
            opt.backward(out.loss)
            opt.step()
            losses[compiled].append(out.loss.item())
    assert counter.frame_count == 1 and type(out).__name__ == "CausalLMOutputWithPast"
    torch.testing.assert_close(losses[True], losses[False], rtol=2e-2, atol=2e-2)


def test_fp8_delayed_compiles_to_one_graph_and_keeps_the_same_histories():
    # Delayed scaling updates its amax histories and scales in place inside the graph;
    # the compiled model records exactly what the eager one does.
    data = batches(3, batch=32)
    runs = {}
    for compiled in (False, True):
        net = make_model()
        model, opt, crit = convert(net, "fp8", {"recipe": "delayed"})
        counter = CompileCounterWithBackend("aot_eager")
        run_model = torch.compile(model, backend=counter, fullgraph=True) if compiled else model
        losses = run(run_model, opt, crit, data)
        buffers = {k: v.clone() for k, v in net.state_dict().items() if ".fp8_" in k}
        runs[compiled] = losses, buffers
    assert counter.frame_count == 1
    (eager_losses, eager_buf), (losses, buf) = runs[False], runs[True]
    assert eager_buf.keys() == buf.keys() and len(buf) == 12  # 2 linears x 3 roles x 2
    for k in buf:
        assert torch.equal(buf[k], eager_buf[k]), k
    assert (buf["fc1.fp8_amax_history_input"][:3] > 0).all()  # three steps recorded
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses))



def test_o1_activation_checkpointing_under_compile_takes_the_context_fn():
    # Under torch.compile torch takes only selective-checkpoint contexts as context_fn;
    # checkpoint_context_fn hands it ones that recompute everything, which compiles to
    # the same training as no context_fn, bit for bit (eager: test_hf_transformers).
    # torch 2.13's dynamo traces the checkpointed region without the fp32-list mode, so
    # there O1's list computes at autocast's precision (pinned below; README).
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
            self.context_fn = None  # None: no context_fn passed

        def block(self, i, x):
            h = self.fc[i](x)
            return x + 0.5 * h * (1 + torch.tanh(0.79 * (h + 0.044 * torch.pow(h, 3.0))))

        def forward(self, x):
            for i in range(3):
                kw = {} if self.context_fn is None else {"context_fn": self.context_fn}
                x = checkpoint(self.block, i, x, use_reentrant=False, **kw)
            return x.float().square().mean()

    def train(context):
        torch.manual_seed(0)
        net = Net()
        model, opt, _ = mpfunc_torch.convert_to_amp(
            net, torch.optim.SGD(net.parameters(), lr=0.01), mode="apex", opt_level="O1",
            verbosity=0)
        if context:
            net.context_fn = mpfunc_torch.checkpoint_context_fn(model)
        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(model, backend=counter, fullgraph=True)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            opt.zero_grad()
            opt.backward(step(torch.randn(4, 16, generator=g)))
            opt.step()
        assert counter.frame_count == 1
        return [p.detach().clone() for p in net.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False), strict=True))

    class Pow(torch.nn.Linear):  # the limit: pow is float32 in eager O1
        def forward(self, x):
            return checkpoint(torch.pow, super().forward(x), 3.0, use_reentrant=False)

    net = Pow(4, 4)
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode="apex", opt_level="O1", verbosity=0)
    x = torch.randn(2, 4)
    assert model(x).dtype == torch.float32
    assert torch.compile(model, backend="aot_eager")(x).dtype == torch.float16


# Issue 30: the whole train step under torch.compile, as users write it. dynamo drops
# attribute writes on torch.optim.Optimizer subclasses (its OptimizerVariable), so the
# optimizer's step state machine must run outside the traced frame.
FAULTS = [1.0, 1.0, float("inf"), 1.0, float("nan"), 1.0]


def _whole_step_run(mode, cfg, backend, fused=False, kind=None):
    net = make_model()
    kind = kind or ("sgd" if is_o3(cfg) else "adam")
    opt = make_opt(net.parameters(), kind, fused=fused, eps=1e-4 if is_o3(cfg) else 1e-8)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **cfg)

    def train_step(x, y, fault):
        opt.zero_grad()
        loss = crit(model(x), y) * fault  # an inf/NaN loss: every gradient overflows
        opt.backward(loss)
        return opt.step()

    if backend is not None:
        train_step = torch.compile(train_step, backend=backend)
    stepped, scales = [], []
    for (x, y), fault in zip(batches(len(FAULTS), batch=16), FAULTS, strict=True):
        stepped.append(bool(train_step(x, y, torch.tensor(fault))))
        scales.append(float(opt.loss_scale))
    return stepped, scales, [p.detach().clone() for p in net.parameters()], opt


@pytest.mark.filterwarnings(  # the fp8 mode's autograd.Function under dynamo (see above)
    "ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=ids)
def test_a_compiled_whole_train_step_matches_eager(mode, cfg, backend):
    stepped, scales, params, _ = _whole_step_run(mode, cfg, None)
    c_stepped, c_scales, c_params, opt = _whole_step_run(mode, cfg, backend)
    assert stepped == [f == 1.0 for f in FAULTS]  # the faults were skips, eagerly
    assert c_stepped == stepped
    assert c_scales == scales
    for a, b in zip(c_params, params, strict=True):  # bit for bit
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                           b.view(torch.uint8) if b.dtype != torch.bool else b)
    assert int(opt.skipped_steps) == 2


@pytest.mark.filterwarnings(  # torch's own import path when inductor loads (torch 2.13)
    "ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("mode, cfg", [
    # Slow: inductor's C++ build takes 17 s cold. The default suite holds every mode's
    # compiled step bit for bit against eager under aot_eager above; the slow suite runs
    # both through inductor.
    pytest.param("torch", {}, id="torch", marks=pytest.mark.slow),
    pytest.param("naive", {"initial_scale": 2.0**16}, id="naive", marks=pytest.mark.slow),
])
def test_a_compiled_whole_train_step_with_inductor(mode, cfg):
    # Inductor generates C++ kernels for the forward and backward: the same skips and
    # scales exactly, the params to float rounding of the fused kernels (with SGD, which
    # does not turn a rounding difference in a near-zero gradient into a full step).
    stepped, scales, params, _ = _whole_step_run(mode, cfg, None, kind="sgd")
    c_stepped, c_scales, c_params, _ = _whole_step_run(mode, cfg, "inductor", kind="sgd")
    assert c_stepped == stepped == [f == 1.0 for f in FAULTS]
    assert c_scales == scales
    for a, b in zip(c_params, params, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("mode, cfg", [m for m in ALL_MODES if not is_o3(m[1])],
                         ids=[i for i, m in zip(ids, ALL_MODES) if not is_o3(m[1])])
def test_a_compiled_whole_train_step_with_a_fused_optimizer(mode, cfg):
    # Fused Adam: in torch mode its kernel unscales and skips (found_inf on the device).
    stepped, scales, params, _ = _whole_step_run(mode, cfg, None, fused=True)
    c_stepped, c_scales, c_params, _ = _whole_step_run(mode, cfg, "aot_eager", fused=True)
    assert c_stepped == stepped == [f == 1.0 for f in FAULTS]
    assert c_scales == scales
    for a, b in zip(c_params, params, strict=True):
        assert torch.equal(a, b)


def test_import_leaves_dynamo_onnx_and_dtensor_unloaded():
    # Issue 36: `import mpfunc_torch` cost ~1.95x `import torch` when torch.compiler.disable
    # at class definition loaded torch._dynamo (and torch.onnx), and the DTensor check
    # loaded torch.distributed.tensor (and sympy). They load at first use instead; the
    # step methods still run outside dynamo (the compiled-step tests above and below).
    import subprocess
    import sys

    heavy = ["torch._dynamo", "torch.onnx", "torch.distributed.tensor", "sympy"]
    code = ("import sys, mpfunc_torch; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    # The methods carry torch's lazy marker, which dynamo treats as disabled.
    from mpfunc_torch._src.optimizer import AmpOptimizer

    for name in ("step", "backward", "unscale_", "zero_grad", "state_dict"):
        method = getattr(AmpOptimizer, name)
        assert method.__code__.co_filename.endswith("_compile.py"), name


def test_a_compiled_whole_step_still_refuses_step_before_backward():
    _, opt, _ = convert(make_model(), "torch", {})

    @torch.compile(backend="aot_eager")
    def bad_step():
        opt.zero_grad()
        return opt.step()

    with pytest.raises(RuntimeError, match="before backward"):
        bad_step()


# Issue 29: Fp8Linear under torch.compile. A user who compiles the model gets inductor's
# fused quantisation kernels (the amax in one reduction, then one cast writing the fp8
# copy and its transpose); the numbers are the eager ones.
def _fp8_net_run(recipe, backend):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    mpfunc_torch.convert_to_fp8(net, recipe, gemm="emulate")
    counter = CompileCounterWithBackend(backend) if backend else None
    model = torch.compile(net, backend=counter, fullgraph=True) if backend else net
    outs = []
    for i in range(3):
        x = torch.randn(48, 64, generator=torch.Generator().manual_seed(i), requires_grad=True)
        y = model(x)
        y.square().sum().backward()
        outs += [y.detach(), x.grad]
    return outs, net.state_dict(), [p.grad for p in net.parameters()], counter


def _assert_same_run(recipe, backend, tol=None):
    outs, state, grads, counter = _fp8_net_run(recipe, backend)
    e_outs, e_state, e_grads, _ = _fp8_net_run(recipe, None)
    assert counter.frame_count == 1  # fullgraph: no graph break, compiled once
    assert state.keys() == e_state.keys()
    for a, b in zip([*outs, *grads, *state.values()],
                    [*e_outs, *e_grads, *e_state.values()], strict=True):
        if tol is None:  # delayed: the histories and scales too, bit for bit
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise"])
def test_fp8_linear_compiles_fullgraph_with_aot_eager(recipe):
    _assert_same_run(recipe, "aot_eager")


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
@pytest.mark.slow  # 16-19 s each with inductor's cache cold; the default suite has the
# same runs under aot_eager (every recipe, bit for bit) and inductor's fused fp8 cast
# (bit for bit, below).
@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_fp8_linear_compiles_fullgraph_with_inductor(recipe):
    # Inductor's generated (C++ on CPU) kernels (~30 s of compiling each): its float32
    # GEMM and GELU round a little differently (pytest's thread count), which can move
    # an element across an fp8 rounding boundary; the cast itself is exact (below).
    _assert_same_run(recipe, "inductor", tol=1e-3)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_the_fused_cast_keeps_the_rule_bit_for_bit(name):
    # The cast as inductor fuses it (one kernel writing the fp8 copy and its transpose)
    # gives the rule's bits: saturation, inf/NaN encodings, subnormals, ties.
    import numpy as np
    from fp8_reference import ref_cast

    from mpfunc_torch._src.fp8.rule import cast_pair

    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3e38, -3e38, 448.0, 464.0,
                57344.0, 61440.0, 1.0625, 1.1875, 2.0**-10, 2.0**-17, 1.5 * 2.0**-9]
    x = np.random.default_rng(0).standard_normal((32, 48)).astype(np.float32) * 100
    x.reshape(-1)[:len(specials)] = specials
    xt = torch.from_numpy(x).to(torch.bfloat16)  # the fp8 mode's activations
    scale = torch.tensor(1.5)
    fused = torch.compile(lambda x, s: cast_pair(x, s, name, True), backend="inductor",
                          fullgraph=True)
    q, q_t = fused(xt, scale)
    with np.errstate(over="ignore"):  # 3e38 * 1.5 is inf in float32: the rule's inf
        want = ref_cast(xt.float().numpy() * np.float32(1.5), name).view(np.uint8)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want)
    np.testing.assert_array_equal(q_t.view(torch.uint8).numpy(), want.T)
    assert q_t.is_contiguous() and q.dtype == q_t.dtype == getattr(torch, name)


def test_delayed_scaling_casts_without_waiting_for_this_steps_amax():
    # In the traced forward, the fp8 cast of x does not depend on the reduction that
    # takes x's amax (delayed: it only feeds the history), so the compiler may do both
    # in one pass over x; current scaling (tensorwise) must wait for its amax.
    from torch.fx.experimental.proxy_tensor import make_fx

    def cast_waits_for_amax(recipe):
        layer = mpfunc_torch.Fp8Linear(64, 32, bias=False, recipe=recipe, gemm="emulate")
        x = torch.randn(48, 64)
        graph = make_fx(lambda x: layer(x))(x).graph
        nodes = list(graph.nodes)

        def ancestors(node):
            seen, todo = set(), [node]
            while todo:
                for a in todo.pop().all_input_nodes:
                    if a not in seen:
                        seen.add(a)
                        todo.append(a)
            return seen

        def val(n):
            return n.meta.get("val")

        # The cast of x: the fp8 tensor of x's shape; x's amax: a 0-dim value computed
        # from x (the reduction and what follows it).
        casts = [n for n in nodes if isinstance(val(n), torch.Tensor)
                 and val(n).dtype == torch.float8_e4m3fn and tuple(val(n).shape) == (48, 64)]
        from_x = [n for n in nodes if isinstance(val(n), torch.Tensor) and val(n).dim() == 0
                  and nodes[0] in ancestors(n)]
        assert from_x and casts  # both recipes take x's amax
        return any(n in ancestors(c) for c in casts for n in from_x)

    assert not cast_waits_for_amax("delayed")
    assert cast_waits_for_amax("tensorwise")
