"""Strict test configuration shared by every test file.

* 8 host CPU devices are forced *before* JAX is imported, for the sharding tests.
* JAX uses strict dtype promotion, so an accidental f16 + f32 upcast is an error.
* Warnings are errors (see ``filterwarnings`` in pyproject.toml).
* Scripts the tests run keep JAX's compilation cache in a temporary folder.
"""

import atexit
import os
import shutil
import tempfile

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The demo and the JAX benchmarks turn JAX's persistent compilation cache on (in
# $MPFUNC_JAX_CACHE, else ~/.cache/mpfunc/jax): the scripts the tests run use a temporary
# folder, removed when the test process ends.
if "MPFUNC_JAX_CACHE" not in os.environ:
    os.environ["MPFUNC_JAX_CACHE"] = tempfile.mkdtemp(prefix="mpfunc-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["MPFUNC_JAX_CACHE"], True)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

try:  # a torch-only install (the `torch` extra alone) runs the torch tests without JAX
    import jax
except ModuleNotFoundError:
    jax = None
else:
    jax.config.update("jax_numpy_dtype_promotion", "strict")

# Entry points of the multi-process tests (run as scripts, never imported).
collect_ignore = ["mp_jax_worker.py", "torch_dist_worker.py", "torch_scaleout_worker.py",
                  "torch_combos_worker.py", "torch_report_worker.py"]

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _strict_promotion():
    # Re-assert per test: a test that flips it must not leak into the next one.
    if jax is not None:
        jax.config.update("jax_numpy_dtype_promotion", "strict")
    yield


@pytest.fixture(scope="module")
def gloo_world():
    """A 1-rank gloo process group for torch.distributed in one process (DDP, FSDP2,
    DTensor); a group that is already up is used and left up."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()
