"""`AmpTrainer`: HuggingFace's ``Trainer`` in any mode of mpfunc_torch.

``AmpTrainer(model=..., args=..., amp_mode="naive", amp_config={...})`` is a
``transformers.Trainer`` subclass: the same arguments, the same loop, in the mode's
precision with its loss scaling, exact skips and master weights. Needs the `hf` extra
(``pip install 'mpfunc[hf]'``: transformers and accelerate); ``import mpfunc_torch``
alone never imports them.
"""

from mpfunc_torch._src.trainers.huggingface import AmpTrainer

__all__ = ["AmpTrainer"]
