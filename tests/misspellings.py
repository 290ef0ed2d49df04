"""Misspelt modes, keys and apex levels, with the error each must give: one table, run
through both frameworks' `convert_to_amp` (test_mixed_precision.py, test_torch_booster.py)."""

MISSPELT = [
    (dict(mode="apex-O2", opt_level="O1"),
     r"^`mode='apex-O2'` sets opt_level 'O2', and `opt_level='O1'` was given too\. Give the "
     r"level once: `mode='apex-O2'` alone, or `mode=\"apex\", opt_level=\.\.\.`"),
    (dict(mode="apex-O4"),
     r"got 'apex-O4' \(did you mean `apex-O3`\?\)\. apex's levels are `mode=\"apex\", "
     r"opt_level=\"O2\"` or, the same, `mode=\"apex-O2\"` \(apex-O0, apex-O1, apex-O2, "
     r"apex-O3\)\.$"),
    (dict(mixed_precision="fp16-naive"), r"got 'fp16-naive' \(did you mean `fp16_naive`\?\)"),
    (dict(mode="naive", inital_scale=2.0**16),
     r"^unknown config key\(s\) \['inital_scale'\] for mode 'naive' \(did you mean "
     r"`initial_scale`\?\); valid keys for this mode: \['backoff_factor'"),
    (dict(mode="apex", opt_level="o2"), r"got 'o2' \(did you mean `O2`\?\)\.$"),
    (dict(mode="fp8", recipe="tensorwize"),
     r"got 'tensorwize' \(did you mean `tensorwise`\?\)\.$"),
]
