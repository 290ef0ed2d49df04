"""`convert_to_fp8` through stacked layer params and ``scan`` bodies.

Scanned JAX transformers (MaxText, flax ``nn.scan`` / ``nnx.scan``, a plain
``jax.lax.scan``) keep each layer's params stacked along a leading layer axis: ``w1``
of shape ``[L, d, 4d]``, sliced per layer by the scan (or by ``w1[i]`` in an unrolled
loop). The fp8 rewrite tags every variable that is a *view* of a params leaf (`View`),
follows it through ``w[i]`` and into ``scan`` bodies, and converts a matmul whose
kernel is a 2-D view, whatever the leaf's rank.

Each converted matmul has a *site* key: the leaf's path (``blocks/qkv/w``), with
``#1``, ``#2`` for further uses. Delayed scaling's state for a site is stacked like
the layers it serves: a kernel sliced from ``[L, d, k]`` has one `Fp8DotState` per
layer, with leaves ``[L, history]`` / ``[L]``; a loop-invariant kernel used inside a
scan of length ``n`` has one per iteration. Inside a scan the per-layer state goes in
as extra scanned inputs, so its "gradient" (the new state) comes back stacked along
the same axis, one slice per layer; an unrolled ``w[i]`` uses slice ``i`` of the same
stacked state. Current-scaling recipes (tensorwise, rowwise, blockwise) compute their
scales from each layer's slice.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mpfunc._src.rewrite import Literal, cast

__all__ = ["ALL", "Level", "Sites", "View", "follow", "index_state", "rewrite_scan",
           "stacked_state"]

ALL = "*"  # a slot signature entry: every index of that axis (a scan covers them all)

# Ops that keep "this value is a view of a parameter": dtype changes only (shard_map's
# `pvary` marks a replicated parameter as varying before it meets a sharded activation)
# and layout changes (after which the view can no longer be indexed by layer).
_DTYPE_ONLY = frozenset({"convert_element_type", "copy", "copy_p", "optimization_barrier",
                         "pvary", "pbroadcast"})
_LAYOUT = frozenset({"transpose", "reshape", "squeeze", "expand_dims"})


class View(NamedTuple):
    """The tag of a variable that shows (part of) a params leaf.

    Attributes:
      path: the leaf's path in ``params`` (``"blocks/qkv/w"``).
      origin: where its delayed state comes from at this level: None at the top, the
        scan body input it came through otherwise.
      index: ``(i, size)`` per leading axis indexed away at this level (``w[i]``); ``i``
        is None for a traced index (``dynamic_slice``).
      stack: sizes of the state axes consumed at enclosing levels (scan axes).
      slots: which slots of those axes this view covers (ints, or `ALL` for a scan).
      pending: ``(i, size)`` when a ``slice`` kept index ``i`` of axis 0 with size 1,
        waiting for its ``squeeze``.
      pristine: only dtype changes and leading-axis indexing so far, so its axis 0 is
        still a layer axis (it can be indexed or scanned over).
    """

    path: str
    origin: Any = None
    index: tuple = ()
    stack: tuple = ()
    slots: tuple = ()
    pending: tuple | None = None
    pristine: bool = True

    def site(self) -> tuple[tuple, tuple]:
        """``(stack, slots)`` of a matmul with this view as its kernel. A traced index
        adds no axis: that use gets a state of its own (per iteration in a loop)."""
        static = [(i, n) for i, n in self.index if i is not None]
        return self.stack + tuple(n for _, n in static), self.slots + tuple(i for i, _ in static)


def _leading_index(eqn, view: View):
    """``(i, size)`` if ``eqn`` keeps one index of axis 0 of ``view`` whole otherwise."""
    shape = eqn.invars[0].aval.shape
    if not shape:
        return None
    if eqn.primitive.name == "slice":
        p = eqn.params
        start, limit, strides = p["start_indices"], p["limit_indices"], p["strides"]
        if (limit[0] - start[0] == 1 and tuple(start[1:]) == (0,) * (len(shape) - 1)
                and tuple(limit[1:]) == tuple(shape[1:])
                and (strides is None or all(s == 1 for s in strides))):
            return int(start[0]), shape[0]
        return None
    if tuple(eqn.params["slice_sizes"]) != (1, *shape[1:]):  # dynamic_slice
        return None
    # The other start indices are clamped to 0 (their slices are whole).
    i = eqn.invars[1]
    return (int(i.val) if isinstance(i, Literal) else None), shape[0]


def follow(eqn, view: View | None) -> View | None:
    """The tag of ``eqn``'s first output, given its first input's."""
    if view is None:
        return None
    name = eqn.primitive.name
    if name in _DTYPE_ONLY:
        return view
    if view.pending is not None:
        if name == "squeeze" and tuple(eqn.params["dimensions"]) == (0,):
            return view._replace(index=view.index + (view.pending,), pending=None)
        return None
    if name in _LAYOUT:
        return view._replace(pristine=False)
    if view.pristine and name in ("slice", "dynamic_slice"):
        pending = _leading_index(eqn, view)
        if pending is not None:
            return view._replace(pending=pending)
    return None


def _overlap(a: tuple, b: tuple) -> bool:
    return all(x == y or ALL in (x, y) for x, y in zip(a, b))


class Sites:
    """The converted matmuls' keys, each with its state's stack shape and the slots of
    it that its uses cover (two uses of one slot get two keys)."""

    def __init__(self):
        self.stacks: dict[str, tuple] = {}
        self.slots: dict[str, list] = {}
        self.seen: dict[str, tuple] = {}  # every key's stack, kept through `restore`

    def key(self, path: str, stack: tuple, slots: tuple) -> str:
        n = 0
        while True:
            key = path if n == 0 else f"{path}#{n}"
            if key not in self.stacks:
                self.stacks[key], self.slots[key] = stack, [slots]
                self.seen[key] = stack
                return key
            if self.stacks[key] == stack and not any(_overlap(slots, s)
                                                     for s in self.slots[key]):
                self.slots[key].append(slots)
                return key
            n += 1

    def snapshot(self):
        return dict(self.stacks), {k: list(v) for k, v in self.slots.items()}

    def restore(self, snap) -> None:
        self.stacks, self.slots = dict(snap[0]), {k: list(v) for k, v in snap[1].items()}


class Level:
    """The delayed states one level (the top, or a scan body) uses, by ``(key, origin)``,
    and the ones it asked for (recorded while discovering, when ``states`` is None)."""

    def __init__(self, states: dict | None = None, requests: list | None = None):
        self.states = states
        self.requests = [] if requests is None else requests

    def get(self, key: str, origin: Any):
        if (key, origin) not in self.requests:
            self.requests.append((key, origin))
        return None if self.states is None else self.states[key, origin]

    def child(self, states: dict | None) -> Level:
        """A level with other state values (a checkpointed region's inputs) that records
        its requests here."""
        return Level(states, self.requests)


class TopLevel(Level):
    """The user's ``fp8_state``: checked against the sites' stack shapes on use."""

    def __init__(self, user_state: dict, sites: Sites, history: int):
        super().__init__({(k, None): v for k, v in user_state.items()})
        self.user_state, self.sites, self.history = user_state, sites, history

    def get(self, key, origin):
        if key not in self.user_state:
            raise ValueError(f"`fp8_state` has no entry {key!r}; its keys are "
                             f"{sorted(self.user_state)}. Make it with `.init` on the same "
                             "function and arguments.")
        want = (*self.sites.seen[key], self.history)
        found = getattr(getattr(self.user_state[key], "input", None), "amax_history", None)
        if getattr(found, "shape", None) != want:
            raise ValueError(
                f"`fp8_state[{key!r}]` has amax histories of shape "
                f"{getattr(found, 'shape', None)}; its matmul needs {want} (one history per "
                "layer of a stacked or scanned kernel). Make the state with `.init` on the "
                "same function and arguments.")
        return super().get(key, origin)

    def child(self, states):
        level = TopLevel(self.user_state, self.sites, self.history)
        level.states, level.requests = states, self.requests
        return level


def index_state(state, view: View):
    """The per-layer state of ``view``'s matmul, from its level's (stacked) state."""
    for i, _ in view.index:
        if i is not None:
            state = jax.tree.map(lambda a, i=i: a[i], state)
    return state


def stacked_state(fresh, stack: tuple):
    """``fresh`` (one `Fp8DotState`) with leading axes ``stack``, each leaf its own
    buffer (leaves sharing one cannot all be donated)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (*stack, *a.shape)).copy(), fresh)


def _into_body(view: View | None, j: int, scanned: bool, length: int, serial) -> View | None:
    """The tag of scan body input ``j`` (a const, or a scanned input) given the outer
    one: a layer of a stacked kernel, or a loop-invariant kernel whose state then has
    one slice per iteration. Either way its state goes in scanned, along ``length``."""
    if view is None or view.pending is not None or (scanned and not view.pristine):
        return None
    stack, slots = view.site()
    return View(view.path, (serial, j), (), (*stack, length), (*slots, ALL),
                pristine=view.pristine)


def rewrite_scan(rw, eqn, invals, tags):
    """A ``scan`` equation rewritten by the fp8 rewriter ``rw``, its body's kernels
    tagged (see `_into_body`), the body's delayed states going in as extra scanned
    inputs. Rebuilt with ``jax.lax.scan``; carries and outputs keep their dtypes."""
    p = eqn.params
    body, nc, ncar, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
    serial = object()
    in_tags = [None if nc <= j < nc + ncar else
               _into_body(t, j, j >= nc + ncar, length, serial) for j, t in enumerate(tags)]
    invals = [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)]
    consts, carry, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]
    out_dtypes = [v.aval.dtype for v in body.jaxpr.outvars]
    outer = rw.level
    real = rw.recipe.delayed and outer.states is not None

    def run(level, c, x):
        saved, rw.level = rw.level, level
        try:
            outs = rw.eval_jaxpr(body.jaxpr, body.consts, [*consts, *c, *x], in_tags)
        finally:
            rw.level = saved
        return [cast(o, d) for o, d in zip(outs, out_dtypes)]

    requests = []
    if real:  # which states does the body use? Trace it once without them to see.
        snap = rw.table.snapshot()
        probe = Level(None)
        specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
                 for v in body.jaxpr.invars[nc:]]
        jax.eval_shape(lambda c, x: run(probe, c, x), specs[:ncar], specs[ncar:])
        rw.table.restore(snap)
        requests = probe.requests
    state_xs = [index_state(outer.get(k, tags[j].origin), tags[j]) for k, (_, j) in requests]
    snap = rw.table.snapshot()

    def step(c, x):
        rw.table.restore(snap)  # the same keys however often scan traces this
        x_vals, st = x
        level = Level(dict(zip(requests, st)) if real else None)
        outs = run(level, c, x_vals)
        if not real:  # discovering: the states this body needs come from the level above
            for k, (_, j) in level.requests:
                outer.get(k, tags[j].origin)
        return outs[:ncar], outs[ncar:]

    carry_out, ys = jax.lax.scan(step, carry, (xs, state_xs), length=length,
                                 reverse=p["reverse"], unroll=p["unroll"])
    return [*carry_out, *ys]
