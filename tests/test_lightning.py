"""SkewAdam in PyTorch Lightning: ``configure_optimizers`` returning ``SkewAdam.from_model(self)`` trains with tiers and
resumes from a Lightning checkpoint bitwise (CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")

from skewadam import SkewAdam  # noqa: E402
from skewadam.bench.models import MoETransformer, get_config  # noqa: E402

VOCAB, SEQ, BATCH, SAMPLES = 64, 16, 4, 12  # 3 steps per epoch


class LitMoE(L.LightningModule):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = MoETransformer(get_config("tiny", vocab_size=VOCAB, block_size=SEQ, router_noise_std=0.0))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = self.model(tokens, targets).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return SkewAdam.from_model(self, lr=1e-2, weight_decay=0.1)


def data() -> DataLoader:
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=BATCH)


def fit(root, max_steps: int, seed: int = 0, ckpt_path=None, save_every: int = 0):
    module = LitMoE(seed)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1)]
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks if save_every else [],
                        enable_checkpointing=bool(save_every), default_root_dir=root)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    return module, trainer.optimizers[0]


def test_import_skewadam_does_not_import_lightning():
    code = "import sys, skewadam; assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'lightning imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_configure_optimizers_returning_from_model_trains_every_tier(tmp_path):
    module, opt = fit(tmp_path, max_steps=3)
    assert type(opt) is SkewAdam
    tiers = {g["tier"]: g["param_names"] for g in opt.param_groups}
    assert set(tiers) == {"backbone", "expert", "router"}
    assert all(n.startswith("model.") for names in tiers.values() for n in names)  # named from the LightningModule
    assert tiers["router"] == ["model.blocks.1.moe.router.weight"]
    assert all(int(s["step"].max()) == 3 for s in opt.state.values())


def test_resume_from_a_lightning_checkpoint_is_bitwise(tmp_path):
    # checkpoint at the end of the first epoch (step 3): the resumed run sees the same batches as the full one
    full, full_opt = fit(tmp_path / "full", max_steps=6, save_every=3)
    ckpt = tmp_path / "full" / "epoch=0-step=3.ckpt"
    resumed, resumed_opt = fit(tmp_path / "resumed", max_steps=6, seed=1, ckpt_path=str(ckpt))
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    a, b = full_opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    assert all(int(s["step"].max()) == 6 for s in resumed_opt.state.values())
