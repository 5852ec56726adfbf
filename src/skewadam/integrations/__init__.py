"""Drop-ins for the training frameworks SkewAdam is used from; each module imports its framework (an optional
dependency) and is imported only by its users: ``import skewadam`` imports none of them.

- `skewadam.integrations.hf`: Hugging Face Transformers' `Trainer` (``pip install 'skewadam[hf]'``).
- `skewadam.integrations.torchtitan`: an ``OptimizersContainer`` for torchtitan
  (``pip install 'skewadam[torchtitan]'``).
- `skewadam.integrations.deepspeed`: DeepSpeed ZeRO (stages 1-3, Offload, DeepSpeed-MoE), a drop-in for
  ``deepspeed.initialize`` (``pip install deepspeed``).

PyTorch Lightning needs no module: ``configure_optimizers`` returns ``SkewAdam.from_model(self)``
(docs/guide/lightning.md).
"""
