"""Colossal-AI's mixed-precision API as the seed tutorials document it, as test data.

Written from `shared/seeds/000_*.txt` (the Booster tutorial) and `001_*.txt` (the
`AMP_TYPE` tutorial), independently of mpfunc's own table, so tests can check that
mpfunc's spellings mean what Colossal-AI's mean. `interpret` evaluates a line of
Colossal-AI code against stand-ins that record which mode and keys it asks for.
"""

import enum

# The Booster's `mixed_precision` names, as the seed lists them, with the mpfunc mode
# each one is (`available_booster_names` keeps those whose mode mpfunc has).
SEED_BOOSTER_NAMES = {"fp16": "torch", "fp16_apex": "apex", "bf16": "bf16", "fp8": "fp8",
                      "fp16_naive": "naive"}


def available_booster_names():
    """The seed's names whose mode mpfunc has."""
    from _mpfunc_common.amp_config import MODES
    return {n: m for n, m in SEED_BOOSTER_NAMES.items() if m in MODES}

# The config classes' signatures as the seed prints them: (field, default), with
# REQUIRED where the seed gives none.
REQUIRED = object()
SEED_SIGNATURES = {
    "FP16TorchMixedPrecision": [("init_scale", 65536.0), ("growth_factor", 2.0),
                                ("backoff_factor", 0.5), ("growth_interval", 2000)],
    "FP16ApexMixedPrecision": [
        ("opt_level", "O1"), ("cast_model_type", None), ("patch_torch_functions", None),
        ("keep_batchnorm_fp32", None), ("master_weights", None), ("loss_scale", None),
        ("cast_model_outputs", None), ("num_losses", 1), ("verbosity", 1),
        ("min_loss_scale", None), ("max_loss_scale", 16777216.0)],
    "FP16NaiveMixedPrecision": [
        ("log_num_zeros_in_grad", REQUIRED), ("initial_scale", REQUIRED),
        ("growth_factor", REQUIRED), ("backoff_factor", REQUIRED), ("hysteresis", REQUIRED),
        ("max_scale", REQUIRED), ("verbose", None)],
    "BF16MixedPrecision": [],
}
SEED_CLASS_MODES = {"FP16TorchMixedPrecision": "torch", "FP16ApexMixedPrecision": "apex",
                    "FP16NaiveMixedPrecision": "naive", "BF16MixedPrecision": "bf16"}

# Where the Booster seed gives no default, the AMP_TYPE seed's naive config does:
# log_num_zeros_in_grad=False, initial_scale=2**32, growth_factor=2, backoff_factor=0.5,
# hysteresis=2 (its max_scale is not listed; 2**32 is Colossal-AI's code). Colossal-AI
# treats the Booster seed's `verbose=None` as False.
SEED_001_NAIVE = dict(log_num_zeros_in_grad=False, initial_scale=2**32, growth_factor=2,
                      backoff_factor=0.5, hysteresis=2, max_scale=2**32, verbose=False)


class AMP_TYPE(enum.Enum):  # noqa: N801 - colossalai.amp.AMP_TYPE, a plain Enum there
    APEX = "apex"
    TORCH = "torch"
    NAIVE = "naive"


def seed_defaults(class_name):
    out = {}
    for name, default in SEED_SIGNATURES[class_name]:
        out[name] = SEED_001_NAIVE[name] if default is REQUIRED or (
            class_name == "FP16NaiveMixedPrecision" and name == "verbose") else default
    return out


def _seed_class(class_name):
    names = [n for n, _ in SEED_SIGNATURES[class_name]]

    def make(*args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{class_name} takes {len(names)} arguments")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names or key in bound:
                raise TypeError(f"{class_name}() got an unexpected or repeated {key!r}")
            bound[key] = value
        missing = [n for n, d in SEED_SIGNATURES[class_name] if d is REQUIRED and n not in bound]
        if missing:
            raise TypeError(f"{class_name}() missing required arguments {missing}")
        config = {**seed_defaults(class_name), **bound}
        if config.get("verbose", False) is None:
            config["verbose"] = False
        return (SEED_CLASS_MODES[class_name], config)

    return make


class Booster:
    def __init__(self, mixed_precision=None, plugin=None):
        if isinstance(mixed_precision, str):
            mode = SEED_BOOSTER_NAMES[mixed_precision]
            cls = {v: k for k, v in SEED_CLASS_MODES.items()}.get(mode)
            # "fp8" has no config class in the seed: it asks for the mode, no keys.
            self.spec = (mode, seed_defaults(cls) if cls else {})
        else:
            self.spec = mixed_precision

    def boost(self, model, optimizer, criterion=None, dataloader=None, lr_scheduler=None):
        return self.spec


class _Amp:
    AMP_TYPE = AMP_TYPE

    @staticmethod
    def convert_to_amp(model, optimizer, criterion, mode, amp_config=None):
        return (mode.value, dict(amp_config or {}))


class _Colossalai:
    amp = _Amp


def namespace():
    ns = {"Booster": Booster, "AMP_TYPE": AMP_TYPE, "colossalai": _Colossalai,
          "model": object(), "optimizer": object(), "criterion": object(),
          "dataloader": object(), "lr_scheduler": object()}
    ns.update({name: _seed_class(name) for name in SEED_SIGNATURES})
    return ns


def interpret(code):
    """(mode, config) that a line of Colossal-AI code asks for, and its namespace (a
    ``CONFIG = dict(fp16=dict(mode=..., **keys))`` line leaves ``CONFIG`` there)."""
    ns = namespace()
    try:
        spec = eval(compile(code, "<colossal>", "eval"), ns)
    except SyntaxError:
        exec(compile(code, "<colossal>", "exec"), ns)
        fp16 = dict(ns["CONFIG"]["fp16"])
        spec = (fp16.pop("mode").value, fp16)
    return spec, ns
