"""Plain-Python references of the three anchors' loss-scale rules, written from their
sources independently of mpfunc. Each returns the scale after every step."""

import numpy as np


def torch_gradscaler(seq, init=2.0**16, growth=2.0, backoff=0.5, interval=2000):
    """torch.amp.GradScaler (``_amp_update_scale_``): float32 scale, int tracker."""
    scale, tracker, out = np.float32(init), 0, []
    with np.errstate(over="ignore"):
        for finite in seq:
            if not finite:
                scale = np.float32(scale * np.float32(backoff))
                tracker = 0
            else:
                tracker += 1
                if tracker == interval:
                    new = np.float32(scale * np.float32(growth))
                    if np.isfinite(new):
                        scale = new
                    tracker = 0
            out.append(np.float32(scale))
    return out


def apex_loss_scaler(seq, init=2.0**16, min_loss_scale=None, max_loss_scale=2.0**24, window=2000):
    """apex.amp.scaler.LossScaler.update_scale (Python floats)."""
    scale, unskipped, out = min(max_loss_scale, init), 0, []
    for finite in seq:
        if not finite:
            scale = max(min_loss_scale, scale / 2.0) if min_loss_scale else scale / 2.0
            unskipped = 0
        else:
            unskipped += 1
        if unskipped == window:
            scale = min(max_loss_scale, scale * 2.0)
            unskipped = 0
        out.append(scale)
    return out


def megatron_scaler(
    seq, init=2.0**32, min_scale=1.0, growth=2.0, backoff=0.5, interval=1000, hysteresis=2,
    max_scale=2.0**32,
):
    """Megatron-LM / Colossal-AI DynamicGradScaler.update (float32 tensors)."""
    scale, growth_tracker, hyst, out = np.float32(init), 0, hysteresis, []
    for finite in seq:
        if not finite:
            growth_tracker = 0
            hyst -= 1
            if hyst <= 0:
                scale = max(np.float32(scale * np.float32(backoff)), np.float32(min_scale))
        else:
            growth_tracker += 1
            if growth_tracker == interval:
                growth_tracker = 0
                hyst = hysteresis
                scale = np.float32(scale * np.float32(growth))
                if max_scale:
                    scale = min(scale, np.float32(max_scale))
        out.append(np.float32(scale))
    return out


def assert_matches_anchor(ours, ref, floor=1.0):
    """Our trajectory against an anchor's that has no floor (GradScaler, apex).

    Where the anchor's scale stays >= ``floor`` the two are bit for bit equal. Where it
    falls below, ours is equal up to that step, then sits at ``floor`` for that step and
    never goes below it.
    """
    ours = np.asarray(ours, np.float32)
    ref = np.asarray(ref, np.float32)
    below = np.flatnonzero(ref < np.float32(floor))
    cut = below[0] if below.size else len(ref)
    np.testing.assert_array_equal(ours[:cut].view(np.uint32), ref[:cut].view(np.uint32))
    assert (ours >= np.float32(floor)).all(), ours.min()
    if below.size:
        assert ours[cut] == np.float32(floor)
