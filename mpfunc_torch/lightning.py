"""`AmpPrecision`: mpfunc_torch's modes as a Lightning precision plugin.

``Trainer(plugins=[AmpPrecision("naive")])`` trains in any mode of
`mpfunc_torch.convert_to_amp` inside Lightning's own loop. One class serves both
Lightning packages, ``pytorch_lightning`` and ``lightning`` (``lightning.pytorch``),
whichever are installed. Needs the `lightning` extra (``pip install
'mpfunc[lightning]'``); ``import mpfunc_torch`` alone never imports Lightning.
"""

from mpfunc_torch._src.trainers.lightning import AmpPrecision

__all__ = ["AmpPrecision"]
