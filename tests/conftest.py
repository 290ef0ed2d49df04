"""Strict test configuration shared by every test file.

* 8 host CPU devices are forced *before* JAX is imported, for the sharding tests.
* JAX uses strict dtype promotion, so an accidental f16 + f32 upcast is an error.
* Warnings are errors (see ``filterwarnings`` in pyproject.toml).
* Scripts the tests run keep JAX's compilation cache in a temporary folder.
* The test processes keep theirs in the user's cache folder, one per CPU kind (see
  `pytest_configure`): a later run, in any checkout, loads what earlier ones compiled.
"""

import atexit
import hashlib
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

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

CACHE_ENV = "MPFUNC_TEST_JAX_CACHE"


def _machine_key():
    """What an XLA:CPU executable is built for: its entries are machine code for this
    CPU (jax's cache key does not say which CPU), so each CPU model and feature set gets
    a folder of its own; jax's and jaxlib's versions are in the key already."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags"))}))
    except OSError:
        pass
    text = "|".join([platform.machine(), platform.processor(), cpu])
    return f"{platform.machine()}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


_HELD = []  # the open lock files of this process's cache folder (held until it exits)
_STORE_CAP = 4 << 30  # past this many bytes, the oldest entries go (down to half of it)


def _gather(store, machine):
    """Moves the entries that the processes of earlier runs wrote (a folder each) into
    ``store``. A folder whose process is alive holds a lock (``<folder>.lock``), and stays
    where it is: two checkouts (worktrees) may test at the same time."""
    import fcntl

    store.mkdir(parents=True, exist_ok=True)
    for folder in machine.iterdir():
        if folder == store or not folder.is_dir():
            continue
        lock = folder.with_name(folder.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its process is running
            os.close(fd)
            continue
        for entry in folder.iterdir():
            try:
                if not (store / entry.name).exists():
                    os.replace(entry, store / entry.name)
            except OSError:  # another run gathered it first
                pass
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)
    entries = sorted((e.stat().st_mtime, e.stat().st_size, e) for e in store.iterdir())
    total = sum(size for _, size, _ in entries)
    limit = _STORE_CAP if total <= _STORE_CAP else _STORE_CAP // 2
    while entries and total > limit:
        _, size, oldest = entries.pop(0)
        oldest.unlink(missing_ok=True)
        total -= size


def _own_folder(store, machine, name):
    """A folder of this process's own, holding (hard links to) every entry of ``store``:
    jax writes an entry in place, so no process may read a folder another writes to. It is
    locked while this process lives, so no other run gathers it meanwhile."""
    import fcntl

    own = machine / name
    fd = os.open(own.with_name(name + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _HELD.append(fd)
    shutil.rmtree(own, ignore_errors=True)
    own.mkdir()
    for entry in store.iterdir():
        try:
            os.link(entry, own / entry.name)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this file system
            shutil.copy2(entry, own / entry.name)
    return own


def _default_cache():
    """Where the test processes keep JAX's compilation cache unless told otherwise: the
    user's cache folder, shared by every checkout of this machine (a fresh clone or a new
    worktree loads what another one compiled)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mpfunc" / "test-jax-cache"


def pytest_configure(config):
    """JAX's persistent compilation cache for the test processes (not for the scripts
    they run, which use $MPFUNC_JAX_CACHE above). Every compile is kept, and a later run
    loads it instead of compiling: the default suite's second run takes about half the
    time of its first. The first run gains too: a program that several tests compile (the
    same step, traced again) is compiled once.

    The entries live in ``~/.cache/mpfunc/test-jax-cache/<machine>/`` (under
    ``$XDG_CACHE_HOME`` when set), shared by every checkout of the machine, so a fresh
    clone or a new worktree starts warm. XLA:CPU entries are machine code for one CPU,
    and jax's key does not name the CPU: each CPU model and feature set gets a folder.
    Each process (each xdist worker) reads and writes a folder of its own, filled at its
    start with the entries of all earlier runs (hard links to ``entries/``, where the
    first process of a run gathers what finished runs wrote; a running process's folder
    is locked, and left alone). A machine that never ran the suite, as CI's, starts with
    none, and every test passes cold. ``pytest --cache-clear`` runs with it off,
    ``MPFUNC_TEST_JAX_CACHE=off`` turns it off, ``MPFUNC_TEST_JAX_CACHE=DIR`` keeps it
    in DIR instead. An executable loaded from it reports the same ``memory_analysis()``
    and ``as_text()`` as a fresh one, and jax's compile event (what the benchmarks'
    compile counter counts) fires for a load as for a compile, so no test reads a warm
    run differently."""
    profile = os.environ.get("MPFUNC_COMPILE_PROFILE")
    if profile and jax is not None:  # `make test-compiles`: see tests/compile_profile.py
        from compile_profile import Plugin

        config.pluginmanager.register(Plugin(profile), "mpfunc-compile-profile")
    setting = os.environ.get(CACHE_ENV, "")
    if jax is None or setting.lower() in ("0", "off", "false", "no") or config.getoption("cacheclear", False):
        return
    base = Path(setting).expanduser() if setting else _default_cache()
    machine = base / _machine_key()
    store = machine / "entries"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    try:
        if worker is None:  # the first process of the run: no worker has started yet
            _gather(store, machine)
        own = _own_folder(store, machine, f"{platform.node()}-{os.getpid()}")
    except OSError as e:  # a read-only home, say: the run goes on without it, and says so
        print(f"mpfunc tests: JAX compilation cache off ({machine}: {e})", file=sys.stderr)
        return
    jax.config.update("jax_compilation_cache_dir", str(own))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # jax points XLA's GPU autotuning cache into the folder by default, and that path is
    # part of every entry's key (CPU ones too): each worker's folder would then key its
    # own entries, and no other process could load them.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "")


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
