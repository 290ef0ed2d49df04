"""mpfunc_torch._src.sharding and the FSDP2 / pipeline hooks of convert_to_amp and
AmpOptimizer, in one process (a 1-rank gloo world). The multi-rank behaviour is in
test_torch_fsdp.py, test_torch_tensor_parallel.py and test_torch_pipeline.py."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import mpfunc_torch
from mpfunc_torch._src.sharding import is_dtensor, local, local_bytes, mesh_groups


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def step(model, opt, x=None):
    x = torch.randn(4, 8) if x is None else x
    opt.zero_grad()
    opt.backward(model(x).float().square().mean())
    return opt.step()


@pytest.mark.parametrize("mode, cfg", [("naive", {"initial_scale": 2.0**8}),
                                       ("apex", {"opt_level": "O3", "verbosity": 0}),
                                       ("torch", {})])
def test_fully_shard_then_convert_casts_the_shards_and_keeps_dtensor_masters(gloo_world, mode, cfg):
    net = mlp()
    for m in net:
        fully_shard(m)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode=mode, **cfg)
    half = mode != "torch"
    for p in net.parameters():
        assert is_dtensor(p)
        # The DTensor and its local shard agree (setting .data would change only one).
        assert p.dtype == local(p).dtype == (torch.float16 if half else torch.float32)
    masters = [m for _, m in opt._pairs]
    assert len(masters) == (6 if mode == "naive" else 0)
    assert all(is_dtensor(m) and local(m).dtype == torch.float32 for m in masters)
    assert local_bytes(masters) == 2 * local_bytes([p for p, _ in opt._pairs])
    assert len(opt._groups) == 1 and opt._groups == mesh_groups(net.parameters())
    before = [local(p).clone() for p in net.parameters()]
    assert bool(step(model, opt))
    assert any(not torch.equal(a, local(p)) for a, p in zip(before, net.parameters()))


def test_convert_then_fully_shard_is_refused_at_the_first_forward(gloo_world):
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="naive")
    fully_shard(net)  # replaces the params the optimizer holds
    with pytest.raises(ValueError, match=r"Shard first, then build the optimizer"):
        model(torch.randn(2, 8))


def test_fsdp_units_the_cast_would_break_are_refused(gloo_world):
    net = mlp()
    fully_shard(net)  # one unit holding the Linears and the LayerNorm
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fully_shard\(norm\)"):  # O2 keeps norms float32
        mpfunc_torch.convert_to_amp(net, opt, mode="apex", opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in net.parameters())  # nothing was cast
    net(torch.randn(2, 8)).sum().backward()  # FSDP2's lazy init fixes the dtypes
    with pytest.raises(ValueError, match="before the first forward"):
        mpfunc_torch.convert_to_amp(net, opt, mode="naive")


def test_backward_done_for_a_backward_run_elsewhere():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(),
                                                   mode="naive", initial_scale=2.0**8)
    ref = torch.nn.Linear(4, 1)
    ref.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    opt.zero_grad()
    opt.scale_loss(crit(model(x), y)).backward()  # as a pipeline schedule does
    opt.backward_done()  # a stage that never called scale_loss
    assert bool(opt.step())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    master = opt.param_groups[0]["params"][0]
    torch.testing.assert_close(master, ref.weight.detach() - 0.1 * ref.weight.grad,
                               rtol=1e-3, atol=1e-3)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="before backward"):
        opt.step()  # zero_grad then step: backward_done was not called
    opt.scale_loss(crit(model(x), y)).backward()
    opt.unscale_()
    with pytest.raises(RuntimeError, match="backward_done"):
        opt.backward_done()


def test_clip_grad_norm_bad_max_norm():
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="torch")
    opt.backward(model(torch.randn(2, 4)).float().sum())
    with pytest.raises(ValueError, match="`max_norm`"):
        opt.clip_grad_norm(0.0)


def test_group_arguments_say_what_is_wrong(gloo_world):
    # A rank outside a group gets new_group's NON_GROUP_MEMBER (-100), which was reported
    # as "must be a ProcessGroup ... got int: -100"; a module passed as params was
    # torch's "not iterable"; an empty list was reported as None.
    outside = dist.GroupMember.NON_GROUP_MEMBER
    net = mlp()
    with pytest.raises(ValueError, match="`process_group` holds a group this rank \\(0\\) "
                                         "is not a member of"):
        mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    mode="naive", process_group=[dist.group.WORLD, outside])
    assert all(p.dtype == torch.float32 for p in net.parameters())
    with pytest.raises(ValueError, match="not a member of"):
        mpfunc_torch.mark_replicated(net.parameters(), outside)
    with pytest.raises(TypeError, match="`params` must be tensors, got a LayerNorm module; "
                                        "pass its .parameters\\(\\)"):
        mpfunc_torch.mark_replicated(torch.nn.LayerNorm(4), dist.group.WORLD)
    with pytest.raises(ValueError, match="non-empty sequence of them, got \\[\\]"):
        mpfunc_torch.mark_replicated(net.parameters(), [])


def test_fp8_amax_group_is_checked(gloo_world):
    group = dist.group.WORLD
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    with pytest.raises(TypeError, match="`fp8_amax_group` must be a torch.distributed"):
        net = mlp()
        mpfunc_torch.convert_to_amp(net, sgd(net), mode="fp8", fp8_amax_group="data")
    with pytest.raises(ValueError, match="`fp8_amax_group` applies to mode='fp8' only"):
        net = mlp()
        mpfunc_torch.convert_to_amp(net, sgd(net), mode="bf16", fp8_amax_group=group)
    with pytest.raises(ValueError, match="`fp8_amax_group` applies to per-tensor"):
        net = mlp()
        mpfunc_torch.convert_to_amp(net, sgd(net), mode="fp8", recipe="rowwise",
                                    fp8_amax_group=group)
    net = mlp()
    model, _, _ = mpfunc_torch.convert_to_amp(net, sgd(net), mode="fp8", fp8_amax_group=group)
    fp8 = [m for m in net.modules() if isinstance(m, mpfunc_torch.Fp8Linear)]
    assert fp8 and all(m._groups == (group,) for m in fp8)
    # process_group (the inf check's) may be pipeline stages: the amax groups are named.
    with pytest.raises(ValueError, match="name the groups to MAX-reduce the fp8 amaxes over "
                                         "in `fp8_amax_group`.*fp8_amax_group=\\(\\)"):
        net = mlp()
        mpfunc_torch.convert_to_amp(net, sgd(net), mode="fp8", process_group=group)
    assert all(p.dtype == torch.float32 and type(m) is torch.nn.Linear
               for m in net.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    net = mlp()
    mpfunc_torch.convert_to_amp(net, sgd(net), mode="fp8", process_group=group,
                                fp8_amax_group=())
    fp8 = [m for m in net.modules() if isinstance(m, mpfunc_torch.Fp8Linear)]
    assert fp8 and all(m._groups == () for m in fp8)
    net = mlp()  # the Booster spelling takes it too
    mpfunc_torch.boost(net, sgd(net), mixed_precision="fp8", fp8_amax_group=group)
    assert all(m._groups == (group,) for m in net.modules()
               if isinstance(m, mpfunc_torch.Fp8Linear))
    with pytest.raises(ValueError, match="`fp8_amax_group` applies to mode='fp8' only"):
        net = mlp()
        mpfunc_torch.boost(net, sgd(net), mixed_precision="bf16", fp8_amax_group=group)


@pytest.mark.parametrize("order", ["shard-then-convert", "fp8-then-shard"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_fp8_mode_under_fully_shard_trains_like_the_unsharded_model(gloo_world, recipe, order):
    # Before: convert_to_amp(mode="fp8") replaced FSDP2's FSDPLinear by a new module,
    # whose weight stayed the sharded DTensor (FSDP unshards into the old object): the
    # first forward failed ("got mixed torch.Tensor and DTensor").
    def build(sharded):
        net = mlp()
        if sharded and order == "fp8-then-shard":
            mpfunc_torch.convert_to_fp8(net, recipe)
        if sharded:
            for m in net:
                fully_shard(m)
            fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="fp8", recipe=recipe)
        return net, model, opt

    (net, model, opt), (ref, ref_model, ref_opt) = build(True), build(False)
    assert [type(m).__name__ for m in net] == ["FSDPFp8Linear", "FSDPLayerNorm",
                                              "FSDPFp8Linear"]
    assert all(isinstance(m, mpfunc_torch.Fp8Linear) for m in (net[0], net[2]))
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        assert bool(step(model, opt, x)) and bool(step(ref_model, ref_opt, x))
    for p, q in zip(net.parameters(), ref.parameters()):
        assert is_dtensor(p) and torch.equal(p.full_tensor(), q)
    for (k, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        if "fp8_" in k:  # delayed histories and scales: the same, bit for bit
            assert torch.equal(a, b), k


def test_fp8_mode_on_a_huggingface_llama_under_fully_shard(gloo_world):
    # A real model as users shard it: each decoder layer and the root are FSDP2 units
    # (the Linears inside stay plain nn.Linear and change class in place).
    transformers = pytest.importorskip("transformers")

    def build(sharded):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                       intermediate_size=64, num_attention_heads=2,
                                       num_key_value_heads=2, vocab_size=64,
                                       max_position_embeddings=32, bos_token_id=0,
                                       eos_token_id=0)
        net = transformers.LlamaForCausalLM(cfg)
        if sharded:
            for layer in net.model.layers:
                fully_shard(layer)
            fully_shard(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="fp8", recipe="delayed")
        return net, model, opt

    (net, model, opt), (ref, ref_model, ref_opt) = build(True), build(False)
    fp8 = [m for m in net.modules() if isinstance(m, mpfunc_torch.Fp8Linear)]
    assert len(fp8) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    ids_ = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    for mo, op in ((model, opt), (ref_model, ref_opt)):
        for _ in range(2):
            op.zero_grad()
            op.backward(mo(input_ids=ids_, labels=ids_).loss)
            assert bool(op.step())
    for (k, p), q in zip(net.named_parameters(), ref.parameters()):
        assert is_dtensor(p) and torch.equal(p.full_tensor(), q), k
    for (k, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        if "fp8_" in k:
            assert torch.equal(a, b), k
