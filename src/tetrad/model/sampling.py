"""How `tetrad generate` draws the next token from the model's logits: as transformers' generate
does, in its order, so that an imported model samples as its generation_config.json asks.

First the repetition penalty, which transformers applies in greedy decoding too: every id
already in the sequence (the prompt included) has its logit divided by the penalty where
positive and multiplied by it where negative. Then greedy at temperature 0; else the logits over
the temperature, kept to the top_k largest, to the smallest set of mass top_p, and to the tokens
at least min_p times as likely as the likeliest, before the draw.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: none

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1 \
                or self.repetition_penalty <= 0:
            raise ValueError(f"sampling out of range ({self.describe()}): need --temperature >= 0, --top-k >= 0, "
                             "0 < --top-p <= 1, 0 <= --min-p <= 1 and --repetition-penalty > 0")

    def describe(self) -> str:
        return ", ".join(f"{name.replace('_', '-')} {value}" for name, value in asdict(self).items())

    def processed(self, logits: torch.Tensor, seen: list[int]) -> torch.Tensor:
        """`logits` [vocab] after every processor, in float32: -inf where a token cannot be drawn.
        `seen`: the sequence so far, prompt included (the repetition penalty's ids)."""
        logits = logits.float().clone()
        if self.repetition_penalty != 1 and seen:
            ids = torch.tensor(sorted(set(seen)), device=logits.device)
            before = logits[ids]
            logits[ids] = torch.where(before < 0, before * self.repetition_penalty, before / self.repetition_penalty)
        if self.temperature == 0:
            return logits
        logits /= self.temperature
        if 0 < self.top_k < logits.numel():
            logits[logits < logits.topk(self.top_k).values[-1]] = -float("inf")
        if self.top_p < 1:
            ordered, order = logits.softmax(-1).sort(descending=True)
            outside = ordered.cumsum(-1) - ordered >= self.top_p  # the mass before a token already reaches top_p
            logits[order[outside]] = -float("inf")
        if self.min_p > 0:
            probs = logits.softmax(-1)
            logits[probs < self.min_p * probs.max()] = -float("inf")
        return logits

    def pick(self, logits: torch.Tensor, seen: list[int], generator: torch.Generator) -> int:
        """One token id from `logits` [vocab] after `seen` (processed's), on any device. The draw is
        made on the CPU by `generator`, a CPU one: a seed then draws the same token from the same
        probabilities on every device (torch's CUDA multinomial wants a CUDA generator and draws
        otherwise), for the copy of one vocabulary of floats, which reading the token back waits
        for anyway."""
        processed = self.processed(logits, seen)
        if self.temperature == 0:
            return int(processed.argmax())
        return int(torch.multinomial(processed.softmax(-1).cpu(), 1, generator=generator))


GREEDY = Sampling(temperature=0.0)
SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))  # as in generation_config.json and generate's flags
