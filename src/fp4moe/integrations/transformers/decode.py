"""Greedy decoding of a transformers causal LM with every decode step replayed from one CUDA graph.

``generate(model, input_ids, max_new_tokens)`` is the one call: it prefills the prompt eagerly into a
transformers ``StaticCache`` (fixed addresses), runs the first decode step eagerly (compiles the
kernels, packs the weights, runs the guard's probes), captures the step (model forward, argmax of the
last logits, the next token and its position written back into the step's static inputs, the token
appended to the output buffer) into a CUDA graph, and replays it once per further token: a decode
step then costs the host one graph launch, whatever the model's kernel count. It works for any model
whose forward with a ``StaticCache`` and explicit ``position_ids`` makes no host synchronisation
(fp4moe's modules make none; transformers' MoE experts need ``experts_implementation="grouped_mm"``).

The runner (:class:`DecodeGraphs`) is kept on the model per batch size and cache length, so a
second ``generate`` of the same batch replays the graph captured by the first (its cache is reset in
place). Prompts are unpadded rows of one length. Greedy only: the same tokens as
``model.generate(do_sample=False)`` up to the rounding of the static cache's attention mask (the
tests compare them). A step that cannot be captured raises a warning and the remaining steps run
eagerly on the same cache.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ...graphs import eager_calls, new_graph

__all__ = ["DecodeGraphs", "generate"]


@dataclass
class _Step:
    ids: torch.Tensor  # [B, 1] the token the step reads; the step writes the next one here
    pos: torch.Tensor  # [B, 1] its position; the step adds one
    slot: torch.Tensor  # [] index of the output column the step writes
    tokens: torch.Tensor  # [B, capacity] generated tokens
    graph: object | None = None
    failed: str = ""
    steps: dict[str, int] = field(default_factory=lambda: {"replayed": 0, "eager": 0})


class DecodeGraphs:
    """Decode steps of ``model`` at batch ``batch`` with a static cache of ``max_cache_len`` tokens,
    replayed from a CUDA graph (module docstring)."""

    def __init__(self, model: nn.Module, batch: int, max_cache_len: int):
        from transformers import StaticCache

        if batch < 1 or max_cache_len < 2:
            raise ValueError(f"batch and max_cache_len: expected >= 1 and >= 2, got {batch} and {max_cache_len}")
        self.model, self.batch, self.max_cache_len = model, batch, max_cache_len
        self.device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        params = inspect.signature(model.forward).parameters
        self._keep_logits = "logits_to_keep" in params
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in later transformers
        B = batch
        self.state = _Step(ids=torch.zeros(B, 1, dtype=torch.long, device=self.device),
                           pos=torch.zeros(B, 1, dtype=torch.long, device=self.device),
                           slot=torch.zeros((), dtype=torch.long, device=self.device),
                           tokens=torch.zeros(B, max_cache_len, dtype=torch.long, device=self.device))

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kw = {"logits_to_keep": 1} if self._keep_logits else {}
        kw[self._cache_kw] = self.cache
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **kw)
        return out.logits[:, -1]

    def _step(self) -> None:
        """One decode step on the static inputs (what the graph holds)."""
        s = self.state
        nxt = self._forward(s.ids, s.pos).argmax(-1, keepdim=True)
        s.ids.copy_(nxt)
        s.pos.add_(1)
        s.tokens.index_copy_(1, s.slot.reshape(1), nxt)
        s.slot.add_(1)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The prompt [B, L] followed by ``max_new_tokens`` greedy tokens, [B, L + max_new_tokens]."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        ids = self.prefill(input_ids, max_new_tokens)
        for _ in range(max_new_tokens - 1):
            self.advance()
        return torch.cat((ids, self.state.tokens[:, :max_new_tokens]), dim=1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, max_new_tokens: int = 1) -> torch.Tensor:
        """Reset the cache, run the prompt [B, L] eagerly and take its next token (the first
        generated); later :meth:`advance` calls each add one token. Returns the prompt on the device."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise ValueError(f"input_ids: expected [{self.batch}, L] token ids, got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
        B, L = input_ids.shape
        if L < 1 or L + max_new_tokens > self.max_cache_len:
            raise ValueError(f"prompt of {L} tokens + {max_new_tokens} new: expected 1..{self.max_cache_len} in all "
                             f"(max_cache_len)")
        s = self.state
        ids = input_ids.to(self.device)
        self.cache.reset()
        pos = torch.arange(L, device=self.device).unsqueeze(0).expand(B, L)
        first = self._forward(ids, pos).argmax(-1, keepdim=True)
        s.ids.copy_(first)
        s.pos.fill_(L)
        s.tokens[:, 0:1].copy_(first)
        s.slot.fill_(1)
        self.length = L + 1
        return ids

    @torch.no_grad()
    def eager_step(self) -> None:
        """One decode step run eagerly, kernels launched one by one (profiling), even where the step
        is captured; the modules' own graphs stay out of it."""
        with eager_calls():
            self._step()
        self.length += 1

    @torch.no_grad()
    def advance(self) -> None:
        """One decode step: eager the first time (kernels compiled, guard probes run), captured the
        second time, replayed after that."""
        s = self.state
        if getattr(self, "length", self.max_cache_len) >= self.max_cache_len:
            raise ValueError(f"advance: the static cache holds {self.max_cache_len} tokens and is full (prefill first, "
                             "or a larger max_cache_len)")
        self.length += 1
        if s.graph is not None:
            s.graph.replay()
            s.steps["replayed"] += 1
            return
        if s.steps["eager"] and not s.failed:
            graph = new_graph(self.device)
            try:
                with eager_calls():  # the modules' kernels go into this graph, not graphs of their own
                    graph.capture(self._step)
            except Exception as err:  # noqa: BLE001 - stay eager, and say so
                s.failed = f"{type(err).__name__}: {err}"
                warnings.warn(f"fp4moe: the decode step of {type(self.model).__name__} could not be captured in a "
                              f"CUDA graph; it runs eagerly ({s.failed})", RuntimeWarning, stacklevel=3)
            else:
                s.graph = graph
                if not graph.runs_at_capture:
                    graph.replay()
                s.steps["replayed"] += 1
                return
        with eager_calls():  # the modules' own graphs stay out of the step
            self._step()
        s.steps["eager"] += 1


def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
             max_cache_len: int | None = None) -> torch.Tensor:
    """Greedy decoding with each step replayed from a CUDA graph (module docstring).

    Args:
        model: a transformers causal LM (e.g. from :func:`load_fp4_model`), on its device.
        input_ids: [B, L] prompt token ids (unpadded rows of one length).
        max_new_tokens: tokens to generate.
        max_cache_len: static cache length (default: the smallest power of two >= L + max_new_tokens,
            at least 256), so that later calls of other lengths reuse the runner and its graph.

    Returns:
        [B, L + max_new_tokens] token ids, as ``model.generate(do_sample=False)`` returns them.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a [B, L] tensor of token ids, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    need = input_ids.shape[1] + max_new_tokens
    if max_cache_len is None:
        max_cache_len = max(256, 1 << (max(1, need) - 1).bit_length())
    runners = model.__dict__.setdefault("_fp4moe_decode_graphs", {})
    key = (input_ids.shape[0], max_cache_len)
    runner = runners.get(key)
    if runner is None:
        runner = runners[key] = DecodeGraphs(model, input_ids.shape[0], max_cache_len)
    return runner.generate(input_ids, max_new_tokens)
