"""The measures: a test run's next-token logits against the reference run's, on the same teacher-forced tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    positions: int
    nll_ref: float          # mean negative log-likelihood of the targets (nats), reference cache
    nll_test: float         # the same with the cache through the codec
    mean_kl: float          # mean over positions of KL(reference || test), nats
    top1: float             # share of positions whose most likely token is the same

    @property
    def ppl_ref(self) -> float:
        return math.exp(self.nll_ref)

    @property
    def ppl_test(self) -> float:
        return math.exp(self.nll_test)

    @property
    def ppl_change_pct(self) -> float:
        """Perplexity change of the test run, in percent of the reference's (negative: lower perplexity)."""
        return 100.0 * (math.exp(self.nll_test - self.nll_ref) - 1.0)


def score(reference: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> Scores:
    """``reference``/``test``: logits [positions, vocab] predicting ``targets`` [positions] (token ids)."""
    if reference.dim() != 2 or reference.shape != test.shape or reference.shape[0] == 0:
        raise ValueError(f"logits: shapes {tuple(reference.shape)} and {tuple(test.shape)} must be one non-empty "
                         "[positions, vocab]")
    if targets.shape != reference.shape[:1]:
        raise ValueError(f"targets: shape {tuple(targets.shape)}, the logits have {reference.shape[0]} positions")
    lp = torch.log_softmax(reference.double(), dim=-1)
    lq = torch.log_softmax(test.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(dim=-1)
    t = targets.long().unsqueeze(1)
    return Scores(positions=int(reference.shape[0]), nll_ref=float(-lp.gather(1, t).mean()),
                  nll_test=float(-lq.gather(1, t).mean()), mean_kl=float(kl.mean()),
                  top1=float((lp.argmax(-1) == lq.argmax(-1)).double().mean()))
