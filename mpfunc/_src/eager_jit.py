"""Functions of whole trees that are jitted where they are called eagerly.

An optax transformation's ``init`` and ``update`` are often called outside ``jax.jit``
(the first ``init``, a debugging loop). There each ``jnp`` op compiles a program of its
own for each leaf shape: a few dozen ops over a model's distinct leaves are hundreds of
compiles, seconds on a CPU. `jit_when_eager` makes such a function one compiled program
per argument signature when it is called eagerly, and leaves it as it is inside a trace
(under the caller's ``jit``, ``grad``, ``shard_map``...), where it is inlined into the
caller's program exactly as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core

__all__ = ["jit_when_eager"]


def jit_when_eager(fun: Callable, static_argnums: tuple[int, ...] = ()) -> Callable:
    """``fun`` (its arguments pytrees of arrays, and static ones at ``static_argnums``)
    jitted when no argument is a tracer, called as it is otherwise.

    The jitted function is named ``eager_<name>``: tests/test_examples.py, which fails
    on a function of the project traced twice (a step compiled again), tells these
    eager compiles (one per argument signature, by design) from that.
    """
    def eager(*args: Any) -> Any:
        return fun(*args)

    eager.__name__ = eager.__qualname__ = f"eager_{fun.__name__}"
    jitted = jax.jit(eager, static_argnums=static_argnums)

    @functools.wraps(fun)
    def call(*args: Any) -> Any:
        dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(dynamic)):
            return fun(*args)
        return jitted(*args)

    return call
