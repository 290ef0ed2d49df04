"""Run third-party optax transforms under standard promotion inside our strict tests.

optax's own code is not strict-promotion clean (Adam's bias correction computes
``decay ** count`` with an int32 count). Wrapping only the third-party transform keeps
strict promotion on for mpfunc's own code around it.
"""

import functools

import jax
import optax


def lenient(tx):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with jax.numpy_dtype_promotion("standard"):
                return fn(*args, **kwargs)

        return inner

    tx = optax.with_extra_args_support(tx)
    return optax.GradientTransformationExtraArgs(wrap(tx.init), wrap(tx.update))


def adam(lr):
    return lenient(optax.adam(lr))
