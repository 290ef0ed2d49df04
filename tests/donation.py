"""Checks that a state can be donated to a jitted step as soon as ``init`` returns it."""

import jax


def assert_own_buffers(*trees) -> None:
    """Every array leaf of ``trees`` has a buffer of its own (single-device arrays).

    XLA refuses to donate one buffer twice (``f(donate(a), donate(a))``), so a state whose
    leaves share an array fails on the first ``jax.jit(step, donate_argnums=...)`` call
    unless its ``init`` itself ran under ``jit``.
    """
    seen = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(trees):
        if isinstance(leaf, jax.Array):
            ptr = leaf.unsafe_buffer_pointer()
            name = jax.tree_util.keystr(path)
            assert ptr not in seen, f"{name} shares its buffer with {seen[ptr]}"
            seen[ptr] = name
