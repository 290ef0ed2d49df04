"""mpfunc: functional mixed-precision training for JAX.

Precision policies, loss scaling as optax transformations, and AMP modes.
"""

from mpfunc._src.policy import Policy, cast_floating, get_policy

__version__ = "0.1.0"

__all__ = [
    "Policy",
    "cast_floating",
    "get_policy",
]
