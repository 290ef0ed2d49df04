"""The tests' notion of "our code" (tests/own_code.py) holds in a clone named `mpfunc`."""

import inspect

import torch
from own_code import ROOT, is_library_file, is_library_module, is_project_file

import mpfunc_torch._src.modes


def test_our_files_are_ours_and_a_venv_inside_a_clone_named_mpfunc_is_not(tmp_path):
    assert is_library_file(mpfunc_torch._src.modes.__file__)
    assert is_project_file(ROOT / "examples" / "compare_modes.py")
    assert not is_library_file(ROOT / "examples" / "compare_modes.py")
    # torch as a newcomer's clone holds it: every path component but the last says mpfunc.
    clone = tmp_path / "mpfunc"
    adam = clone / ".venv/lib/python3.11/site-packages/torch/optim/adam.py"
    assert "mpfunc" in str(adam)  # what the old substring test matched
    assert not is_library_file(adam) and not is_project_file(adam)
    assert not is_library_file(inspect.getfile(torch.optim.Adam))  # torch as installed here
    assert not is_library_file("<doctest mpfunc.dynamic_scale[0]>")


def test_modules_are_ours_by_their_top_level_package():
    assert is_library_module("mpfunc_torch._src.modes") and is_library_module("mpfunc")
    assert is_library_module("_mpfunc_common.amp_config")
    assert not is_library_module("mpfunc_extras.x") and not is_library_module("torch.optim.adam")
