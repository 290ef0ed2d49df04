"""Tests for mpfunc._src.policy (Policy, get_policy, cast_floating)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from doc_cells import cell_code
from hypothesis import given
from hypothesis import strategies as st

import mpfunc
from mpfunc._src.policy import DTYPE_ALIASES, POLICY_PRESETS

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def mixed_tree():
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "w16": jnp.ones((2,), jnp.float16),
        "np": np.ones((3,), np.float32),
        "ints": jnp.arange(3, dtype=jnp.int32),
        "np_ints": np.arange(2, dtype=np.int64),
        "mask": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
        "none": None,
        "scalar": 0.5,
        "int_scalar": 3,
        "nested": [jnp.zeros(2, jnp.bfloat16), (jnp.zeros((), jnp.float32),)],
    }


def check_cast(out, src, dtype):
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(src)
    assert out["w"].dtype == dtype
    assert out["w16"].dtype == dtype
    assert out["np"].dtype == dtype
    assert out["nested"][0].dtype == dtype
    assert out["nested"][1][0].dtype == dtype
    assert out["ints"].dtype == jnp.int32
    assert out["mask"].dtype == jnp.bool_
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    assert out["raw_key"].dtype == jnp.uint32
    assert out["none"] is None
    assert out["scalar"] == 0.5 and isinstance(out["scalar"], float)
    assert out["int_scalar"] == 3


class TestPolicy:
    def test_fields_are_normalised_dtypes(self):
        p = mpfunc.Policy("float32", jnp.bfloat16, "half")
        assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, BF16, F16)

    def test_immutable_and_hashable(self):
        p = mpfunc.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.param_dtype = jnp.float16
        assert hash(p) == hash(mpfunc.Policy("f32", "bf16", "f32"))
        assert p == mpfunc.get_policy("p=f32,c=bf16,o=f32")
        assert len({p, mpfunc.get_policy("mixed_bf16")}) == 1

    @pytest.mark.parametrize("method, dtype", [
        ("cast_to_param", F32), ("cast_to_compute", BF16), ("cast_to_output", F16)])
    def test_cast_mixed_leaves(self, method, dtype):
        p = mpfunc.Policy(jnp.float32, jnp.bfloat16, jnp.float16)
        tree = mixed_tree()
        check_cast(getattr(p, method)(tree), tree, dtype)

    def test_cast_under_jit(self):
        p = mpfunc.get_policy("p=f32,c=f16,o=bf16")

        @jax.jit
        def f(tree):
            out = p.cast_to_compute(tree)
            return out, p.cast_to_output(out)

        tree = {k: v for k, v in mixed_tree().items() if k not in ("np",)}
        compute, output = f(tree)
        assert compute["w"].dtype == F16 and output["w"].dtype == BF16
        assert compute["ints"].dtype == jnp.int32 and output["mask"].dtype == jnp.bool_
        assert jax.dtypes.issubdtype(output["key"].dtype, jax.dtypes.prng_key)
        assert output["none"] is None

    def test_cast_keeps_values(self):
        x = jnp.array([1.5, -2.25, 3.0], jnp.float32)
        p = mpfunc.get_policy("p=f32,c=bf16")
        chex.assert_trees_all_equal(p.cast_to_param(p.cast_to_compute(x)), x)

    def test_cast_same_dtype_returns_same_object(self):
        x = jnp.ones(3)
        assert mpfunc.get_policy("f32").cast_to_compute(x) is x

    def test_static_argument_no_retrace(self):
        traces = []

        def apply(policy, x):
            traces.append(policy)
            return policy.cast_to_compute(x) * 2

        apply = jax.jit(apply, static_argnums=0)
        x = jnp.ones(4)
        for _ in range(3):
            out = apply(mpfunc.get_policy("mixed_bf16"), x)
        apply(mpfunc.Policy("f32", "bf16", "f32"), x)  # an equal policy hits the cache
        assert out.dtype == BF16
        assert len(traces) == 1
        apply(mpfunc.get_policy("mixed_f16"), x)
        assert len(traces) == 2

    def test_with_output_dtype(self):
        p = mpfunc.get_policy("mixed_bf16")
        q = p.with_output_dtype("bf16")
        assert q.output_dtype == BF16 and q.param_dtype == F32 and q.compute_dtype == BF16
        assert p.output_dtype == F32  # the original is unchanged

    @pytest.mark.parametrize("role", ["param_dtype", "compute_dtype", "output_dtype"])
    def test_non_floating_dtype_rejected(self, role):
        kwargs = dict(param_dtype="f32", compute_dtype="f32", output_dtype="f32")
        kwargs[role] = jnp.int8
        with pytest.raises(ValueError, match=f"`{role}` must be a floating dtype, got int8"):
            mpfunc.Policy(**kwargs)

    def test_non_dtype_object_rejected(self):
        with pytest.raises(TypeError, match="`param_dtype` must be a floating dtype"):
            mpfunc.Policy(object(), "f32", "f32")


class TestGetPolicy:
    def test_long_and_short_keys(self):
        a = mpfunc.get_policy("params=float32,compute=bfloat16,output=float16")
        b = mpfunc.get_policy("p=f32,c=bf16,o=f16")
        assert a == b == mpfunc.Policy(F32, BF16, F16)

    def test_mixed_key_styles_and_whitespace(self):
        assert mpfunc.get_policy(" p = f32 , compute=half ") == mpfunc.Policy(F32, F16, F16)

    @pytest.mark.parametrize("alias, dtype", sorted(DTYPE_ALIASES.items()))
    def test_every_alias(self, alias, dtype):
        assert mpfunc.get_policy(alias) == mpfunc.Policy(dtype, dtype, dtype)
        assert mpfunc.get_policy(f"p={alias}").param_dtype == np.dtype(dtype)

    def test_half_is_float16_not_bfloat16(self):
        assert mpfunc.get_policy("half").compute_dtype == F16

    def test_defaults_chain(self):
        p = mpfunc.get_policy("p=f32")
        assert p.compute_dtype == F32 and p.output_dtype == F32
        p = mpfunc.get_policy("p=f32,c=bf16")
        assert p.output_dtype == BF16
        p = mpfunc.get_policy("p=f32,o=f16")
        assert p.compute_dtype == F32 and p.output_dtype == F16

    def test_presets(self):
        assert mpfunc.get_policy("mixed_bf16") == mpfunc.Policy(F32, BF16, F32)
        assert mpfunc.get_policy("mixed_f16") == mpfunc.Policy(F32, F16, F32)
        for name in POLICY_PRESETS:
            mpfunc.get_policy(name)

    def test_policy_passes_through(self):
        p = mpfunc.Policy(F32, F16, F32)
        assert mpfunc.get_policy(p) is p

    @given(st.tuples(*[st.sampled_from(sorted(DTYPE_ALIASES))] * 3))
    def test_str_round_trips(self, names):
        p = mpfunc.Policy(*names)
        assert mpfunc.get_policy(str(p)) == p
        assert mpfunc.get_policy(str(p)).__str__() == str(p)

    @pytest.mark.parametrize("spec, match", [
        ("", "`spec` is empty"),
        ("   ", "`spec` is empty"),
        ("p=f32,x=bf16", r"unknown key 'x'; valid keys are \['c', 'compute'"),
        ("p=f32,params=bf16", "key 'params' sets 'params' twice"),
        ("p=f32,p=f32", "key 'p' sets 'params' twice"),
        ("p=f33", r"`params`: unknown dtype 'f33'. Valid names: \["),
        ("float33", "`spec`: unknown dtype 'float33'"),
        ("p=int8", "`params` must be a floating dtype, got int8"),
        ("p=f32,c=int32", "`compute` must be a floating dtype, got int32"),
        ("p=f32,o=bool", "`output` must be a floating dtype, got bool"),
        ("int8", "`spec` must be a floating dtype, got int8"),
        ("p=f32,c", "malformed part 'c'"),
        ("p=f32,,c=bf16", "malformed part ''"),
        ("p=", "malformed part 'p='"),
        ("=f32", "malformed part '=f32'"),
        ("compute_float16", "`spec`: unknown dtype 'compute_float16'"),  # jmp's almost-dtype
    ])
    def test_bad_specs(self, spec, match):
        with pytest.raises(ValueError, match=match):
            mpfunc.get_policy(spec)

    @pytest.mark.parametrize("spec", [None, 3, jnp.float32, ["p=f32"]])
    def test_non_string_is_type_error(self, spec):
        with pytest.raises(TypeError, match="`spec` must be a policy string or a Policy"):
            mpfunc.get_policy(spec)


def test_cast_floating_bad_dtype():
    with pytest.raises(ValueError, match="`dtype` must be a floating dtype, got int32"):
        mpfunc.cast_floating({"a": jnp.ones(2)}, jnp.int32)


# -- jmp's grammar and helpers, checked against jmp itself ----------------------------------


@pytest.fixture(scope="module")
def jmp():
    return pytest.importorskip("jmp")

# jmp's "half" is half_dtype() (bfloat16 on TPU); ours is always float16. They agree on
# CPU/GPU, which is where these tests run; the difference is documented in the README.
JMP_NAMES = ["f32", "full", "float32", "bf16", "bfloat16", "f16", "float16", "f64", "float64",
             "half"]


def jmp_specs():
    out = list(JMP_NAMES)
    for keys in [("p",), ("c",), ("o",), ("p", "c"), ("c", "o"), ("p", "o"), ("p", "c", "o")]:
        for names in __import__("itertools").product(["f32", "bf16", "f16", "full"],
                                                     repeat=len(keys)):
            out.append(",".join(f"{k}={n}" for k, n in zip(keys, names)))
    out += ["params=float32,compute=float16", "compute=bfloat16,output=full", "output=f16",
            "c=f64", "p=f64,c=f32"]
    return out


@pytest.mark.parametrize("spec", jmp_specs())
def test_get_policy_agrees_with_jmp(spec, jmp):
    if jax.default_backend() == "tpu" and "half" in spec:
        pytest.skip("jmp's 'half' is bfloat16 on TPU; ours is float16")
    ours, theirs = mpfunc.get_policy(spec), jmp.get_policy(spec)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype))
    # both str forms parse back to the same policy in both libraries
    assert mpfunc.get_policy(str(ours)) == ours
    assert mpfunc.get_policy(str(theirs)) == ours
    assert mpfunc.get_policy(theirs) == ours  # a jmp.Policy object is accepted as is


class TestJmpPolicyTests:
    """jmp's own policy_test.py, adapted (the same parameter grids)."""

    HALF = (np.float16, jnp.float16, jnp.bfloat16)
    FULL = (np.float32, jnp.float32)
    NAMES = {np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16",
             np.dtype(np.float32): "float32"}

    @pytest.mark.parametrize("dtype", HALF + FULL)
    @pytest.mark.parametrize("np_", [np, jnp])
    @pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
    def test_policy_cast(self, dtype, np_, method):
        policy = mpfunc.Policy(dtype, dtype, dtype)
        assert getattr(policy, method.replace("cast_to_", "") + "_dtype") == dtype
        out = getattr(policy, method)({"a": np_.ones([])})
        assert out["a"].dtype == np.dtype(dtype)

    @pytest.mark.parametrize("dtype", HALF + FULL)
    @pytest.mark.parametrize("np_", [np, jnp])
    def test_policy_with_output_dtype(self, dtype, np_):
        policy = mpfunc.Policy(np_.float32, np_.float32, np_.float32).with_output_dtype(dtype)
        assert policy.output_dtype == dtype

    @pytest.mark.parametrize("name, dtype", [("float16", np.float16), ("float32", np.float32),
                                             ("bfloat16", jnp.bfloat16)])
    def test_get_policy(self, name, dtype):
        p = mpfunc.get_policy(name)
        assert p.param_dtype == p.compute_dtype == p.output_dtype == dtype

    def test_get_policy_almost_dtype(self):
        with pytest.raises(ValueError, match="unknown dtype"):
            mpfunc.get_policy("compute_float16")

    @pytest.mark.parametrize("dtype", HALF + FULL)
    def test_get_policy_mixed(self, dtype):
        p = mpfunc.get_policy(f"c={self.NAMES[np.dtype(dtype)]}")
        assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, dtype, dtype)

    @pytest.mark.parametrize("dtype", HALF + FULL)
    def test_get_policy_compute(self, dtype):
        p = mpfunc.get_policy(f"c={self.NAMES[np.dtype(dtype)]},o=full")
        assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, dtype, F32)

    def test_half_dtype(self, jmp):
        expect = BF16 if jax.default_backend() == "tpu" else F16
        assert mpfunc.half_dtype() == expect == np.dtype(jmp.half_dtype())

    def test_cast_to_full(self, jmp):
        half = dict(o=object(), h=jnp.ones([], mpfunc.half_dtype()), f=jnp.ones([]),
                    i=jnp.ones([], jnp.int16))
        full = mpfunc.cast_to_full(half)
        assert full["o"] is half["o"] and full["f"] is half["f"] and full["i"] is half["i"]
        assert full["h"].dtype == F32
        ref = jmp.cast_to_full(half)
        assert jax.tree.map(lambda x: getattr(x, "dtype", None), full) == \
            jax.tree.map(lambda x: getattr(x, "dtype", None), ref)

    def test_cast_to_half(self, jmp):
        dtype = mpfunc.half_dtype()
        full = dict(o=object(), h=jnp.ones([], dtype), f=jnp.ones([]), i=jnp.ones([], jnp.int16))
        half = mpfunc.cast_to_half(full)
        assert half["o"] is full["o"] and half["h"] is full["h"] and half["i"] is full["i"]
        assert half["f"].dtype == dtype
        ref = jmp.cast_to_half(full)
        assert jax.tree.map(lambda x: getattr(x, "dtype", None), half) == \
            jax.tree.map(lambda x: getattr(x, "dtype", None), ref)

    @pytest.mark.parametrize("dtype", HALF + FULL)
    def test_str(self, dtype):
        policy = mpfunc.Policy(dtype, dtype, dtype)
        for piece in str(policy).split(","):
            assert mpfunc.get_policy(piece.split("=")[1]).param_dtype == dtype
        assert mpfunc.get_policy(str(policy)) == policy


def test_float64_policy_round_trips():
    p = mpfunc.get_policy("p=f64,c=f32,o=f64")
    assert p.param_dtype == np.dtype(np.float64) and str(p) == "p=f64,c=f32,o=f64"
    assert mpfunc.get_policy(str(p)) == p


def readme_jmp_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text()
    body = text.split("<!-- jmp-policy-table -->")[1].split("<!-- /jmp-policy-table -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # skip the header and the rule
        cells = [cell_code(c) for c in line.strip().strip("|").split(" | ")]
        assert all(cells), f"each cell is one code span: {line!r}"
        rows.append(tuple(cells))
    return rows


def test_readme_jmp_table_is_complete():
    names = {jmp_expr.split("(")[0] for jmp_expr, _ in readme_jmp_table()}
    for name in ("jmp.get_policy", "jmp.Policy", "jmp.half_dtype", "jmp.cast_to_half",
                 "jmp.cast_to_full"):
        assert name in names, f"the docs' coming-from-jmp table lacks {name}"


@pytest.mark.parametrize("jmp_expr, ours_expr", readme_jmp_table())
def test_readme_jmp_table_rows_agree_with_jmp(jmp_expr, ours_expr, jmp):
    """Each row of the "coming from jmp" table (docs/migration.md): both sides run and
    agree."""
    tree = {"w": jnp.ones((2, 3)), "h": jnp.ones(2, jnp.float16), "step": jnp.int32(3),
            "key": jax.random.key(0)}
    env = {"jmp": jmp, "mpfunc": mpfunc, "jnp": jnp, "tree": tree}
    theirs, ours = eval(jmp_expr, env), eval(ours_expr, env)  # noqa: S307 - our README

    def norm(x):
        if hasattr(x, "param_dtype"):  # a policy
            return tuple(np.dtype(getattr(x, f)) for f in
                         ("param_dtype", "compute_dtype", "output_dtype"))
        if isinstance(x, dict):
            return {k: (str(v.dtype) if hasattr(v, "dtype") else v) for k, v in x.items()}
        return np.dtype(x)

    assert norm(ours) == norm(theirs)
