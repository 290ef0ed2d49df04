"""The trainer integrations: Lightning's `AmpPrecision` (`lightning`), HuggingFace's
`AmpTrainer` (`huggingface`), Colossal-AI's Booster loop (`booster`) and what they share
(`trainer_amp`)."""
