"""Integration: real HuggingFace models (tiny configs, random init, nothing downloaded)
in every torch mode: train, attribute access, `generate`, `save_pretrained` round trip."""

import logging

import pytest
import torch
from torch_task import ALL_MODES, ids, is_o3

import mpfunc_torch

transformers = pytest.importorskip("transformers")
from transformers import modeling_outputs as mo  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)  # tiny-vocab config notices

VOCAB, BATCH, SEQ = 100, 4, 16


def build(name, seed=0):
    torch.manual_seed(seed)
    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                 num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                       **small)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.BertConfig(num_labels=3, pad_token_id=0, **small)
    return transformers.BertForSequenceClassification(cfg)


def data(name):
    g = torch.Generator().manual_seed(1)
    ids_ = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids_ if name != "bert" else torch.randint(0, 3, (BATCH,), generator=g)
    return ids_, labels


def convert(net, mode, cfg):
    opt = (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if is_o3(cfg)
           else torch.optim.Adam(net.parameters(), lr=1e-2))
    return mpfunc_torch.convert_to_amp(net, opt, mode=mode, **cfg)


def half_model(mode, cfg):
    return mode == "naive" or cfg.get("opt_level") in ("O2", "O3")


def compute_dtype(mode, cfg):
    """The dtype a Linear computes in under the mode."""
    if mode in ("bf16", "fp8") or cfg.get("dtype") == "bfloat16":
        return torch.bfloat16
    if cfg.get("opt_level") == "O0":
        return torch.float32
    return torch.float16


MODELS = ["gpt2", "llama", "bert"]
OUTPUT_TYPES = {"gpt2": mo.CausalLMOutputWithCrossAttentions, "llama": mo.CausalLMOutputWithPast,
                "bert": mo.SequenceClassifierOutput}
CASES = [(m, mode, cfg) for m in MODELS for mode, cfg in ALL_MODES]
CASE_IDS = [f"{m}-{i}" for m in MODELS for i in ids]


@pytest.mark.parametrize("name, mode, cfg", CASES, ids=CASE_IDS)
def test_trains_and_keeps_model_output(name, mode, cfg):
    net = build(name)
    before = {k: v.detach().float().clone() for k, v in net.state_dict().items()}
    model, opt, _ = convert(net, mode, cfg)
    x, y = data(name)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        out = model(input_ids=x, labels=y)
        # The container survives the output cast (it used to become a plain dict).
        assert type(out) is OUTPUT_TYPES[name], type(out)
        assert out[0] is out.loss and out["logits"] is out.logits
        if half_model(mode, cfg):
            assert out.logits.dtype == torch.float32  # outputs are cast back to float32
        opt.backward(out.loss)
        opt.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert min(losses[1:]) < losses[0], losses
    moved = [k for k, v in net.state_dict().items() if not torch.equal(v.float(), before[k])]
    assert moved, "no parameter changed"


def norm_weights(net):
    return {n: m.weight.dtype for n, m in net.named_modules()
            if type(m).__name__.endswith("Norm") and getattr(m, "weight", None) is not None}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_custom_norm_classes_stay_float32_in_o2(name, level):
    net = build(name)
    model, _, _ = convert(net, "apex", {"opt_level": level, "verbosity": 0})
    weights = norm_weights(net)
    assert weights, "no norm layers found"
    want = torch.float32 if level == "O2" else torch.float16
    assert set(weights.values()) == {want}, weights  # LlamaRMSNorm included
    x, y = data(name)
    assert torch.isfinite(model(input_ids=x, labels=y).loss)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=ids)
def test_generate_runs_in_the_modes_precision(name, mode, cfg):
    net = build(name).eval()
    model, _, _ = convert(net, mode, cfg)
    seen = []
    first_linear = next(m for m in net.modules()
                        if type(m).__name__ in ("Linear", "Conv1D", "Fp8Linear"))
    first_linear.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    prompt = data(name)[0][:2, :5]
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], prompt)
    assert seen and set(seen) == {compute_dtype(mode, cfg)}, seen
    # Greedy decoding's first token is the argmax of the wrapped model's own forward.
    logits = model(input_ids=prompt).logits
    assert torch.equal(out[:, 5], logits[:, -1].argmax(-1))


@pytest.mark.parametrize("name, mode, cfg", CASES, ids=CASE_IDS)
def test_attributes_and_save_pretrained_round_trip(name, mode, cfg, tmp_path):
    net = build(name)
    model, opt, _ = convert(net, mode, cfg)
    # Attributes the wrapper lacks are the wrapped model's.
    assert model.config is net.config
    assert model.device == torch.device("cpu")
    assert model.dtype == (torch.float16 if half_model(mode, cfg) else torch.float32)
    assert model.can_generate() == (name != "bert")
    assert model.get_input_embeddings() is net.get_input_embeddings()
    model.main_input_name = "input_ids"  # one the wrapped model has is set there
    assert "main_input_name" not in vars(model) and vars(net)["main_input_name"] == "input_ids"
    with pytest.raises(AttributeError, match="no_such_attribute"):
        model.no_such_attribute  # noqa: B018
    x, y = data(name)
    opt.zero_grad()
    opt.backward(model(input_ids=x, labels=y).loss)
    opt.step()
    model.save_pretrained(tmp_path)
    cls = type(net)
    # What is saved: the params as the model holds them (half for naive / O2 / O3).
    default = cls.from_pretrained(tmp_path)
    assert default.dtype == (torch.float16 if half_model(mode, cfg) else torch.float32)
    # To train on: load in float32 and convert again; the same mode gives the same model.
    loaded = cls.from_pretrained(tmp_path, dtype=torch.float32)
    model2, _, _ = convert(loaded, mode, cfg)
    for (k, a), (k2, b) in zip(net.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    model.eval(), model2.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, model2(input_ids=x).logits)


@pytest.mark.parametrize("name, converted, left", [
    ("gpt2", 1, 8),   # only the tied lm_head is an nn.Linear; GPT-2's Conv1D stays bf16
    ("llama", 15, 0),
    ("bert", 14, 0),
])
def test_fp8_converts_the_linear_layers(name, converted, left):
    net = build(name)
    lm_head = getattr(net, "lm_head", None)
    convert(net, "fp8", {})
    kinds = [type(m).__name__ for m in net.modules()]
    assert (kinds.count("Fp8Linear"), kinds.count("Conv1D") + kinds.count("Linear")) == (
        converted, left)
    if name == "gpt2":  # converted in place: still tied to the embedding
        assert net.lm_head is lm_head and lm_head.weight is net.get_input_embeddings().weight


@pytest.mark.parametrize("mode, cfg", [("naive", {"initial_scale": 2.0**10, "clip_grad": 0.5}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0})],
                         ids=["naive-clip", "O2"])
@pytest.mark.parametrize("name", MODELS)
def test_step_chunks_trains_a_real_model_bit_for_bit(name, mode, cfg):
    # step_chunks on a real model's params (tied GPT-2 embedding, Llama's RMSNorm, BERT's
    # pooler): the chunked step ends where one step over all params does.
    out = []
    for k in (1, 3):
        net = build(name)
        model, opt, _ = mpfunc_torch.convert_to_amp(
            net, torch.optim.AdamW(net.parameters(), lr=1e-2), mode=mode, step_chunks=k,
            **cfg)
        x, y = data(name)
        flags = []
        for _ in range(3):
            opt.zero_grad()
            opt.backward(model(input_ids=x, labels=y).loss)
            flags.append(bool(opt.step()))
        out.append((flags, {n: p.detach().clone() for n, p in net.named_parameters()},
                    opt.state_dict()["master_weights"]))
    (flags1, params1, masters1), (flags3, params3, masters3) = out
    assert flags1 == flags3 and any(flags3)
    assert all(torch.equal(params1[n], params3[n]) for n in params1)
    assert all(torch.equal(a, b) for a, b in zip(masters1, masters3))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode, cfg", [("naive", {}), ("torch", {})])
def test_load_state_dict_is_all_or_nothing_on_a_real_model(name, mode, cfg):
    # torch copies what fits and raises after; the converted model refuses first.
    net = build(name)
    model, opt, _ = convert(net, mode, cfg)
    before = ([t.clone() for t in net.state_dict().values()]
              + [m.clone() for _, m in opt._pairs])
    other = build(name, seed=1).state_dict()
    key = next(k for k in other if k.endswith("embed_tokens.weight") or k.endswith("wte.weight")
               or k.endswith("word_embeddings.weight"))
    wrong = {**other, key: other[key][:-1]}  # another vocabulary size
    with pytest.raises(ValueError, match=f"nothing was loaded.*size mismatch for {key}"):
        model.load_state_dict(wrong)
    with pytest.raises(RuntimeError, match="missing keys"):  # torch's type too
        net.load_state_dict({k: v for k, v in other.items() if k != key})
    after = [t for t in net.state_dict().values()] + [m for _, m in opt._pairs]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # what fits loads as before: the whole checkpoint, or a part with strict=False
    net.load_state_dict({k: v for k, v in other.items() if k != key}, strict=False)
    model.load_state_dict(other)
    for k, v in net.state_dict().items():
        assert torch.equal(v, other[k].to(v.dtype)), k
    name_of = {id(p): n for n, p in net.named_parameters()}
    for p, m in opt._pairs:  # the masters took the float32 values exactly
        assert torch.equal(m, other[name_of[id(p)]]), name_of[id(p)]


@pytest.mark.parametrize("mode, cfg", [("apex", {"opt_level": "O1", "verbosity": 0}),
                                       ("naive", {"initial_scale": 2.0**12}), ("torch", {})])
def test_activation_checkpointing_trains_bit_for_bit(mode, cfg):
    # torch's checkpoint restores autocast for the recompute, not apex O1's fp32 list:
    # without checkpoint_context_fn GPT-2's gelu (pow, tanh) recomputed in float16.
    def run(checkpointing, context=True):
        net = build("gpt2")
        model, opt, _ = convert(net, mode, cfg)
        if checkpointing:
            kw = {"use_reentrant": False}
            if context:
                kw["context_fn"] = mpfunc_torch.checkpoint_context_fn(model)
            if hasattr(net, "activation_checkpointing_enable"):  # transformers >= 5
                net.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        model.train()
        x, y = data("gpt2")
        losses = []
        for step in range(3):
            opt.zero_grad()
            loss = model(input_ids=x, labels=y).loss
            opt.backward(loss * (float("inf") if step == 1 else 1.0))
            losses.append((loss.item(), bool(opt.step())))
        return losses, [p.detach().clone() for p in net.parameters()]

    plain, checkpointed = run(False), run(True)
    assert [s for _, s in plain[0]] == [True, False, True]
    assert plain[0] == checkpointed[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], checkpointed[1], strict=True))
    if cfg.get("opt_level") == "O1":  # torch's own checkpoint, no context: what it fixes
        with pytest.raises(torch.utils.checkpoint.CheckpointError, match="dtype"):
            run(True, context=False)


def test_checkpoint_context_fn_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="`model` must be a model from convert_to_amp"):
        mpfunc_torch.checkpoint_context_fn(lambda x: x)
    with pytest.raises(TypeError, match="got an unconverted Linear"):  # it returned a no-op
        mpfunc_torch.checkpoint_context_fn(torch.nn.Linear(2, 2))
