"""Plan a kernel for a target before anything runs: prune by the model, prove by compiling, rank.

``plan_op(kernel, problem, arch)`` enumerates the kernel's candidates (``plan.space``) and:

1. rejects those whose modelled shared memory (``target.smem``) exceeds the architecture's
   per-block limit, quoting the breakdown;
2. ranks the rest with the roofline model of the GPU;
3. cross-compiles them in rank order, a few at a time (and always the runtime heuristic's
   choice), until one proves legal: compiled shared memory within the limit, spills within
   ``SPILL_LIMIT_BYTES``, and the MMA instruction the architecture offers for the path (on
   SM100/SM120 the W4A4 path must issue the native block-scaled FP4 MMA: a kernel that decodes
   FP4 to bf16 there is a silent fallback and is rejected);
4. returns the chosen ``Verdict`` and every rejection with its reason in the chip's own terms.

The roofline cannot see in-register decoding cost (the W4A16 decode regime,
docs/performance-engineering.md) nor latency hiding, so when the runtime heuristic (tuned on silicon) is
legal and within ``HEURISTIC_TIE`` of the best modelled time, the heuristic's configuration is
chosen, and ties in modelled time (1% bins) go to the heuristic's pipeline depth and warps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..target import GPU, Arch, find_gpu, get_arch
from ..target.smem import SmemBreakdown
from .cache import CompileCache
from .crosscompile import CompiledKernel, cross_compile
from .space import KernelSpec, TimeEstimate, default_gpu, get_kernel

__all__ = ["HEURISTIC_TIE", "LOOP_FREE_SPILL_LIMIT_BYTES", "SPILL_LIMIT_BYTES", "PlanError", "PlanResult", "Verdict", "evaluate", "legal_config",
           "plan_many", "plan_op", "smem_breakdown"]

#: Spilled bytes (stores + loads per thread, ``ptxas -v``) above which a configuration is rejected.
#: Zero: a spill is local memory traffic inside the main loop of these kernels, every iteration,
#: and there is always a smaller tile that keeps its registers. Where the SASS shows every spill
#: outside the loops (``CompiledKernel.loop_spill_ops`` == 0) the configuration is kept and the
#: spill reported: a wgmma kernel's epilogue spill runs once per tile, and a kernel without loops
#: (the quantizer) runs each spill at most once per thread, up to ``LOOP_FREE_SPILL_LIMIT_BYTES``.
SPILL_LIMIT_BYTES = 0

#: Spilled bytes (stores + loads) a kernel without loops may have. Such a kernel's code runs once
#: per program, so this is local traffic per thread, against the quantizer's 82 B of global traffic
#: per thread: it admits the few bytes the quantizer's heuristic spills under its register cap (in
#: the division path for global scales outside the fast range) and refuses a spill in its fast path
#: (docs/performance-engineering.md, ``LOOP_FREE_SPILL_LIMIT_BYTES``).
LOOP_FREE_SPILL_LIMIT_BYTES = 32

#: The heuristic's configuration wins when its modelled time is within this factor of the best.
HEURISTIC_TIE = 1.05

#: Candidates compiled per round for each problem (after the model's ranking), and in total.
COMPILE_BATCH = 4
MAX_COMPILES = 16


def _rank_key(v: Verdict, reference: Any) -> tuple:
    """Modelled time in 1% bins; ties go to the heuristic, then to its pipeline depth and warps (the
    roofline sees no latency hiding; the heuristic's choices were measured on silicon), then to
    less shared memory."""
    us_bin = math.floor(math.log(max(v.time.us, 1e-9)) / math.log(1.01))
    cfg = v.config
    same = lambda attr: getattr(cfg, attr, None) == getattr(reference, attr, None)  # noqa: E731
    return (us_bin, not v.heuristic, not same("num_stages"), not same("num_warps"), v.smem.total, str(cfg))


class PlanError(RuntimeError):
    """No configuration of a kernel is legal for the problem on the target."""


@dataclass(frozen=True)
class Verdict:
    """One configuration judged for one target: the model, the compiler's numbers, the decision."""

    config: Any
    smem: SmemBreakdown  # modelled shared memory, term by term
    smem_limit: int  # the architecture's per-block opt-in limit
    time: TimeEstimate
    compiled: CompiledKernel | None = None  # None: not compiled (ranked too low, or compile=False)
    reasons: tuple[str, ...] = ()  # why it is rejected; empty when legal
    stage: str = "model"  # "model": judged by the model only; "compile": proven by cross-compilation
    heuristic: bool = False  # the runtime heuristic's choice

    @property
    def legal(self) -> bool:
        return not self.reasons

    @property
    def shared_model(self) -> int:
        return self.smem.total

    @property
    def shared_compiled(self) -> int | None:
        return self.compiled.shared if self.compiled is not None else None

    @property
    def registers(self) -> int | None:
        return self.compiled.registers if self.compiled is not None else None

    @property
    def spills(self) -> int | None:
        return self.compiled.spill_bytes if self.compiled is not None else None

    @property
    def mma(self) -> tuple[str, ...]:
        return self.compiled.mma if self.compiled is not None else ()

    def as_dict(self) -> dict:
        cfg = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else str(self.config)
        return {
            "config": cfg,
            "config_name": str(self.config),
            "legal": self.legal,
            "stage": self.stage,
            "heuristic": self.heuristic,
            "reasons": list(self.reasons),
            "shared_limit": self.smem_limit,
            "shared_model": self.shared_model,
            "shared_compiled": self.shared_compiled,
            "smem_breakdown": self.smem.as_dict(),
            "registers": self.registers,
            "spill_bytes": self.spills,
            "mma": list(self.mma),
            "modelled_us": self.time.us,
            "bound_us": self.time.bound_us,
            "fraction_of_peak": self.time.fraction,
            "limiter": self.time.limiter,
            "programs": self.time.programs,
            "waves": self.time.waves,
        }


@dataclass(frozen=True)
class PlanResult:
    """The plan of one kernel for one problem on one target."""

    kernel: str
    variant: str  # the code path (e.g. "w4a4_native")
    problem: Any
    arch: Arch
    gpu: GPU
    chosen: Verdict | None
    heuristic: Verdict
    legal: tuple[Verdict, ...]  # compiled and legal (or model-legal with compile=False), best first
    rejected: tuple[Verdict, ...]
    unverified: int  # model-legal candidates ranked below those compiled
    compiled: int  # cross-compilations used (cache hits included)

    def explain(self, rejected: bool = True) -> str:
        """A readable report: the choice, the heuristic's verdict, and (optionally) the rejections."""
        lines = [f"{self.kernel} [{self.variant}] {self.problem} on {self.gpu.name} ({self.arch.name}, "
                 f"{self.arch.smem_per_block_optin:,} B shared memory per block)"]
        if self.chosen is None:
            lines.append("  no legal configuration")
        else:
            lines.append("  chosen: " + _verdict_line(self.chosen))
            if self.chosen.smem.total:
                lines.append("    shared memory: " + smem_breakdown(self.chosen.smem))
        if self.chosen is None or self.heuristic.config != self.chosen.config:
            lines.append("  runtime heuristic: " + _verdict_line(self.heuristic))
        if rejected and self.rejected:
            lines.append(f"  rejected ({len(self.rejected)}):")
            for v in self.rejected:
                lines.append(f"    {v.config}: " + "; ".join(v.reasons))
        if self.unverified:
            lines.append(f"  {self.unverified} more model-legal candidates ranked below and not compiled")
        return "\n".join(lines)

    def as_dict(self, rejected: bool = True) -> dict:
        out = {
            "kernel": self.kernel,
            "variant": self.variant,
            "problem": dataclasses.asdict(self.problem) if dataclasses.is_dataclass(self.problem) else str(self.problem),
            "arch": self.arch.name,
            "gpu": self.gpu.name,
            "shared_limit": self.arch.smem_per_block_optin,
            "chosen": self.chosen.as_dict() if self.chosen is not None else None,
            "heuristic": self.heuristic.as_dict(),
            "legal": [v.as_dict() for v in self.legal],
            "unverified": self.unverified,
            "compiled": self.compiled,
        }
        if rejected:
            out["rejected"] = [v.as_dict() for v in self.rejected]
        return out


def smem_breakdown(smem: SmemBreakdown) -> str:
    """``SmemBreakdown.describe``, or where only the epilogue uses shared memory, its terms (not
    "nothing = 0 B; epilogue ..."). Callers print it only when ``smem.total`` is not 0."""
    if smem.mainloop or not smem.epilogue:
        return smem.describe()
    terms = [t for t in smem.terms if t.phase == "epilogue" and t.bytes]
    return " + ".join(str(t) for t in terms) + f" = {smem.epilogue:,} B (epilogue)"


def _verdict_line(v: Verdict) -> str:
    shared = f"shared {v.shared_model:,} B modelled"
    if v.shared_compiled is not None:
        shared += f" / {v.shared_compiled:,} B compiled"
    shared += f" (limit {v.smem_limit:,} B)"
    parts = [str(v.config), shared]
    if v.registers is not None:
        spilled = f"{v.spills or 0} B spilled"
        if v.spills and v.compiled is not None and v.compiled.loop_spill_ops == 0:
            spilled += " (outside the main loop)" if v.compiled.uses_wgmma else " (no loop: once per thread)"
        parts.append(f"{v.registers} registers, {spilled}")
    if v.mma:
        parts.append(", ".join(v.mma))
    parts.append(f"{v.time.us:.1f} us modelled, {100 * v.time.fraction:.0f}% of the roofline "
                 f"({v.time.limiter}-bound)")
    status = "legal" if v.legal else "REJECTED: " + "; ".join(v.reasons)
    if v.legal and v.stage == "model":
        status += " by the model (not compiled)"
    return " | ".join(parts) + " | " + status


# ------------------------------------------------------------------------------------------
# judging


def _resolve(arch: str | int | tuple[int, int] | Arch | None, gpu: str | GPU | None) -> tuple[Arch, GPU]:
    product = find_gpu(gpu, strict=True) if isinstance(gpu, str) else gpu
    if arch is None:
        if product is None:
            raise ValueError("plan: give an arch (e.g. 'sm120') or a gpu (e.g. 'rtx pro 6000')")
        return product.arch, product
    target = get_arch(arch)
    if product is None:
        product = default_gpu(target)
    elif product.arch != target:
        raise ValueError(f"plan: gpu {product.name} is {product.arch.name}, not {target.name}")
    return target, product


def _model_verdict(spec: KernelSpec, config: Any, problem: Any, arch: Arch, gpu: GPU, heuristic: bool) -> Verdict:
    smem = spec.smem_model(config, problem, arch)
    limit = arch.smem_per_block_optin
    time = spec.model_time(config, problem, gpu)
    reasons = ()
    if smem.total > limit:
        reasons = (f"needs {smem.total:,} B of shared memory, limit {limit:,} B ({arch.name}): {smem.describe()}",)
    return Verdict(config=config, smem=smem, smem_limit=limit, time=time, reasons=reasons, heuristic=heuristic)


def _compiled_verdict(spec: KernelSpec, v: Verdict, problem: Any, arch: Arch, gpu: GPU,
                      result: CompiledKernel) -> Verdict:
    reasons = []
    if not result.ok:
        first = (result.error or "unknown error").strip().splitlines()[0][:300]
        reasons.append(f"does not compile for {arch.name}: {first}")
    else:
        if result.shared is not None and result.shared > v.smem_limit:
            reasons.append(f"compiled kernel needs {result.shared:,} B of shared memory, limit {v.smem_limit:,} B "
                           f"({arch.name}); the model said {v.smem.total:,} B: {v.smem.describe()}")
        if result.spill_bytes is not None and result.spill_bytes > SPILL_LIMIT_BYTES:
            if result.loop_spill_ops != 0:
                reasons.append(f"spills {result.spill_bytes:,} B to local memory ({result.registers} registers "
                               f"per thread; limit {SPILL_LIMIT_BYTES} B inside loops)")
            elif not result.uses_wgmma and result.spill_bytes > LOOP_FREE_SPILL_LIMIT_BYTES:
                reasons.append(f"spills {result.spill_bytes:,} B to local memory ({result.registers} registers "
                               f"per thread; limit {LOOP_FREE_SPILL_LIMIT_BYTES} B for a kernel without loops)")
        if result.wgmma_hazards:
            reasons.append(f"{len(result.wgmma_hazards)} SASS instruction(s) write registers of a wgmma still in "
                           f"flight (its A operand), e.g. {result.wgmma_hazards[0]} (plan.sass)")
        expectation = spec.expected_mma(problem, arch)
        if expectation is not None:
            problem_mma = expectation.violation(result.mma)
            if problem_mma:
                reasons.append(f"wrong MMA on {arch.name}: {problem_mma}")
    time = spec.model_time(v.config, problem, gpu, registers=result.registers) if result.ok else v.time
    return dataclasses.replace(v, compiled=result, reasons=tuple(reasons), stage="compile", time=time)


def evaluate(kernel: str | KernelSpec, problem: Any, arch: str | int | Arch | None = None, config: Any = None,
             gpu: str | GPU | None = None, *, compile: bool = True, cache: CompileCache | None = None,
             jobs: int | None = None) -> Verdict:
    """Judge one configuration (default: the runtime heuristic's) for ``problem`` on the target."""
    spec = get_kernel(kernel)
    spec.check_problem(problem)
    target, product = _resolve(arch, gpu)
    heuristic = spec.heuristic(problem, target, product.sm_count)
    cfg = heuristic if config is None else spec.check_config(config)
    v = _model_verdict(spec, cfg, problem, target, product, heuristic=cfg == heuristic)
    if not compile:
        return v
    result = cross_compile([spec.compile_request(cfg, problem, target)], jobs=jobs, cache=_cache(cache))[0]
    return _compiled_verdict(spec, v, problem, target, product, result)


def legal_config(kernel: str | KernelSpec, problem: Any, arch: str | int | Arch, sm_count: int | None = None) -> Any:
    """The runtime heuristic's configuration, checked against the shared-memory model: raises
    ``PlanError`` (quoting required and allowed bytes) if the model says it does not fit."""
    spec = get_kernel(kernel)
    target = get_arch(arch)
    cfg = spec.heuristic(spec.check_problem(problem), target, sm_count)
    smem = spec.smem_model(cfg, problem, target)
    if smem.total > target.smem_per_block_optin:
        raise PlanError(f"{spec.name}: the heuristic's {cfg} for {problem} needs {smem.total:,} B of shared memory, "
                        f"limit {target.smem_per_block_optin:,} B ({target.name}): {smem.describe()}")
    return cfg


def _cache(cache: CompileCache | None | bool) -> CompileCache | None:
    if cache is False:
        return None
    return CompileCache() if cache is None or cache is True else cache


# ------------------------------------------------------------------------------------------
# planning


@dataclass
class _Work:
    spec: KernelSpec
    problem: Any
    heuristic: Verdict
    ranked: list[Verdict]  # model-legal, best first (heuristic included where legal)
    rejected: list[Verdict] = field(default_factory=list)
    judged: dict[int, Verdict] = field(default_factory=dict)  # index in ranked -> compiled verdict
    next: int = 0
    compiled: int = 0

    def done(self) -> bool:
        return any(v.legal for v in self.judged.values()) or self.next >= len(self.ranked) \
            or self.compiled >= MAX_COMPILES


def plan_many(items: Sequence[tuple[str | KernelSpec, Any]], arch: str | int | Arch | None = None,
              gpu: str | GPU | None = None, *, compile: bool = True, cache: CompileCache | None | bool = None,
              jobs: int | None = None, progress: Callable[[int, int], None] | None = None) -> list[PlanResult]:
    """``plan_op`` for several (kernel, problem) pairs on one target, compiling in shared batches
    (one cross-compilation per distinct request, on ``jobs`` processes). ``progress(done, total)``:
    cross-compilations finished and begun so far (cache hits not counted; a later batch, after a
    candidate proved illegal, raises the total)."""
    target, product = _resolve(arch, gpu)
    store = _cache(cache) if compile else None
    works: list[_Work] = []
    for kernel, problem in items:
        spec = get_kernel(kernel)
        spec.check_problem(problem)
        heuristic_cfg = spec.heuristic(problem, target, product.sm_count)
        candidates = spec.candidates(problem, target)
        if heuristic_cfg not in candidates:
            candidates.append(heuristic_cfg)
        verdicts = [_model_verdict(spec, c, problem, target, product, heuristic=c == heuristic_cfg)
                    for c in candidates]
        ranked = sorted((v for v in verdicts if v.legal), key=lambda v: _rank_key(v, heuristic_cfg))
        # the heuristic is compiled in the first round wherever it ranks
        ranked.sort(key=lambda v: not v.heuristic)
        heuristic = next(v for v in verdicts if v.heuristic)
        works.append(_Work(spec, problem, heuristic, ranked, [v for v in verdicts if not v.legal]))

    if compile:
        finished = 0  # compilations done in earlier batches (for ``progress``)
        while True:
            batch: list[tuple[_Work, int]] = []
            for w in works:
                if w.done():
                    continue
                take = min(COMPILE_BATCH, len(w.ranked) - w.next, MAX_COMPILES - w.compiled)
                batch += [(w, i) for i in range(w.next, w.next + take)]
                w.next += take
                w.compiled += take
            if not batch:
                break
            requests = [w.spec.compile_request(w.ranked[i].config, w.problem, target) for w, i in batch]
            this_batch = [0]  # compilations the cache did not hold

            def report(done: int, total: int, before: int = finished) -> None:
                this_batch[0] = total
                progress(before + done, before + total)  # type: ignore[misc]

            compiled = cross_compile(requests, jobs=jobs, cache=store, progress=report if progress else None)
            finished += this_batch[0]
            for (w, i), result in zip(batch, compiled):
                w.judged[i] = _compiled_verdict(w.spec, w.ranked[i], w.problem, target, product, result)

    results = []
    for w in works:
        if compile:
            judged = [w.judged[i] for i in sorted(w.judged)]
            legal = [v for v in judged if v.legal]
            rejected = w.rejected + [v for v in judged if not v.legal]
            unverified = len(w.ranked) - len(judged)
        else:
            legal, rejected, unverified = list(w.ranked), list(w.rejected), 0
        legal.sort(key=lambda v: _rank_key(v, w.heuristic.config))
        chosen = legal[0] if legal else None
        heuristic = next((v for v in legal + rejected if v.heuristic), w.heuristic)
        if chosen is not None and heuristic.legal and heuristic.time.us <= HEURISTIC_TIE * chosen.time.us:
            chosen = heuristic
        results.append(PlanResult(kernel=w.spec.name, variant=w.spec.variant(w.problem, target), problem=w.problem,
                                  arch=target, gpu=product, chosen=chosen, heuristic=heuristic, legal=tuple(legal),
                                  rejected=tuple(rejected), unverified=unverified, compiled=len(w.judged)))
    return results


def plan_op(kernel: str | KernelSpec, problem: Any, arch: str | int | Arch | None = None,
            gpu: str | GPU | None = None, *, compile: bool = True, cache: CompileCache | None | bool = None,
            jobs: int | None = None) -> PlanResult:
    """Plan ``kernel`` for ``problem`` on ``arch`` (or the ``gpu``'s architecture).

    ``gpu`` (a catalogue name or GPU) sets the roofline (bandwidth, peaks, SM count); default: the
    first catalogued product of the architecture. ``compile=False`` judges by the model only.
    ``cache``: a ``CompileCache``; None: the default location; False: none.
    """
    return plan_many([(kernel, problem)], arch, gpu, compile=compile, cache=cache, jobs=jobs)[0]
