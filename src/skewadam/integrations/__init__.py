"""Drop-ins for the training frameworks SkewAdam is used from; each module imports its framework (an optional
dependency) and is imported only by its users: ``import skewadam`` imports none of them.

- `skewadam.integrations.hf`: Hugging Face Transformers' `Trainer` (``pip install 'skewadam[hf]'``).
- `skewadam.integrations.torchtitan`: an ``OptimizersContainer`` for torchtitan
  (``pip install 'skewadam[torchtitan]'``).

PyTorch Lightning needs no module: ``configure_optimizers`` returns ``SkewAdam.from_model(self)``
(docs/guide/lightning.md).
"""
