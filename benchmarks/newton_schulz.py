"""What Newton-Schulz sees and what cheaper forms of it cost: the figures of docs/study/cheaper.md.

``spectra``: trains the bench model (preset ``cpu``, the embedded Shakespeare, 16 x 128 tokens) with the quality
recipe as it was when these figures were taken (arm ``skewadam-quality-fp32``: every matrix every step, fp32) for
``--steps`` steps (lr 1e-2 after 10 warm-up steps, grad clip 1), captures every matrix the orthogonal update hands
Newton-Schulz at the steps ``--at``, and prints the quantiles of their singular values over their Frobenius norm
(float64 SVD), then those of Muon's iteration's output after 2 to 5 iterations: the quintic acts on each singular
value on its own, so the output's spectrum is the polynomial applied to the input's.

``gram``: Newton-Schulz iterated in the Gram space (``R = X X^T``; per iteration ``Z = aI + bR + cR^2``, ``Q <- Q Z``,
``R <- Z R Z``; then ``Q X``) against the plain iteration, 5 iterations, on a batch of ``[320, 512]`` matrices (the
20M model's expert slices, wide orientation): CPU time (1 thread, best of 3) in fp32 and bf16 on ``--batch``
random matrices, and the largest difference from the float64 plain iteration on the momentum matrices ``spectra``
captures at the end of a ``--steps``-step run.

Usage (from the repository root):
    python benchmarks/newton_schulz.py spectra
    python benchmarks/newton_schulz.py gram
"""

from __future__ import annotations

import argparse
import time

import torch

from skewadam.bench import arms
from skewadam.bench.data import get_batch, load_corpus
from skewadam.bench.models import MoETransformer, get_config
from skewadam.kernels import orthogonal

QUANTILES = (0.01, 0.1, 0.5, 0.9, 1.0)


def _q(x: torch.Tensor) -> str:
    return " ".join(f"{v:.3g}" for v in torch.quantile(x, torch.tensor(QUANTILES, dtype=x.dtype)).tolist())


def capture(steps: int, at: list[int]) -> list[torch.Tensor]:
    """The matrices the fp32 quality arm hands Newton-Schulz at the steps ``at`` of a ``steps``-step run, in float64."""
    torch.manual_seed(0)
    model = MoETransformer(get_config("cpu"))
    opt = arms.get("skewadam-quality-fp32").build(model, lr=1e-2)
    corpus, gen = load_corpus(None), torch.Generator().manual_seed(0)
    captured, capturing = [], [False]
    plain = orthogonal.newton_schulz_

    def spy(x, *args):
        if capturing[0]:
            captured.append(x.detach().double().clone())
        return plain(x, *args)

    orthogonal.newton_schulz_ = spy
    try:
        for step in range(1, steps + 1):
            capturing[0] = step in at
            x, y = get_batch(corpus.train, 16, 128, gen)
            model(x, y).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = 1e-2 * min(1.0, step / 10)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        orthogonal.newton_schulz_ = plain
    return captured


def spectra(steps: int, at: list[int]) -> None:
    captured = capture(steps, at)
    sigma = torch.cat([(torch.linalg.svdvals(x) / x.norm(dim=(-2, -1))[:, None]).flatten() for x in captured])
    print(f"{sigma.numel()} singular values of {sum(x.shape[0] for x in captured)} matrices at steps {at}; "
          f"quantiles {QUANTILES}")
    print(f"sigma / ||X||_F:                {_q(sigma)}")
    a, b, c = orthogonal.NS_COEFFICIENTS
    s = sigma.clone()
    for t in range(1, 6):
        s = a * s + b * s ** 3 + c * s ** 5
        if t >= 2:
            print(f"after {t} of Muon's iterations: {_q(s)}")


def _gram(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = orthogonal.NS_COEFFICIENTS
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    r = x @ x.mT
    eye = torch.eye(r.shape[-1], dtype=x.dtype)
    q = None
    for i in range(steps):
        z = torch.baddbmm(r, r, r, beta=b, alpha=c) + a * eye
        q = z if q is None else q @ z
        if i < steps - 1:
            r = z @ (r @ z)
    return q @ x


def gram(batch: int, steps: int) -> None:
    x = torch.randn(batch, 320, 512, generator=torch.Generator().manual_seed(0))
    momentum = capture(steps, [steps])
    for dtype in (torch.float32, torch.bfloat16):
        times = {}
        for name, fn in (("plain", orthogonal.newton_schulz), ("Gram space", _gram)):
            best = []
            for _ in range(3):
                t0 = time.process_time()
                fn(x.to(dtype))
                best.append(time.process_time() - t0)
            error = max((fn(m.to(dtype)).double() - orthogonal.newton_schulz(m)).abs().max().item() for m in momentum)
            times[name] = f"{min(best) * 1e3:.0f} ms, max error on the momentum {error:.2g}"
        print(f"{dtype}: [{batch}, 320, 512] x5: " + "; ".join(f"{k} {v}" for k, v in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("spectra", help="singular values Newton-Schulz sees in training, and after its iterations")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--at", type=int, nargs="+", default=[30, 120])
    p = sub.add_parser("gram", help="the Gram-space iteration against the plain one: time and error")
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "spectra":
        spectra(args.steps, args.at)
    else:
        gram(args.batch, args.steps)


if __name__ == "__main__":
    main()
