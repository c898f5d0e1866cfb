"""Settings of the chunked-logits passes: one frozen, self-validating dataclass."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Optional

__all__ = ["Config", "LM_HEAD_PLANS"]

# The lm_head backward's plans (kernels/tiling.py says what each does); "auto" picks by device.
LM_HEAD_PLANS = ("auto", "two_sweeps", "fp32_tiles", "blocks", "gpu", "kept_logits")
# The chunk budget of every loop on a CPU, and of all but the lm_head's on a GPU.
DEFAULT_BUDGET_MIB = 32


@dataclasses.dataclass(frozen=True)
class Config:
    """What the passes do.  Build it from ``torch.compile(..., options={...})``; the README's
    settings table and docs/ say more about each field.

    Attributes:
        rewrite: rewrite matched FP32-upcast regions into the fused per-row form.
        temperature_after_upcast: move a model-precision ``logits / t`` right before the
            upcast to FP32 after it; False keeps the division where the graph has it.
        remove_div_by_one: drop ``x / 1`` and ``x * 1`` everywhere in the graph.
        report_only: log and count what would be rewritten, change nothing.
        strict: re-raise an error inside the pass instead of falling back to stock
            Inductor (for debugging the pass itself).
        upgrade_low_precision: also compute a model-precision ``log_softmax`` / ``softmax`` /
            ``logsumexp`` / ``cross_entropy`` over the vocabulary in FP32, per row, returning
            FP32: changes results and dtypes on purpose, so off by default.
        fuse_lm_head: when an lm_head matmul ``hidden @ weight.T`` read by nothing else makes
            the logits, compute them chunk by chunk inside the region (``kernels/log_softmax/lm_head.py``).
        chunk_budget_mib: working-set budget of one chunk / block of the chunk loops.  None:
            the device's (``kernels.tiling.device_budget``; docs/gpu.md).
        row_local: run a region the hand-derived path declines as its own ops over chunks
            of rows when every op acts on each row on its own (``match/row_local.py``).
        leave_to_stock: a row-local region on given logits whose every op stock Inductor
            fuses into its row reductions (``match/worth.py``) is left to stock, which holds
            no FP32 ``[T, V]`` tensor there either and is faster; False rewrites it too.
        row_local_sweeps: a row-local region whose lm_head matmul the call runs runs it
            chunk by chunk when the body's gradient splits (``kernels/row_local/split.py``);
            False runs it whole (stock's memory and GEMMs).
        save_masks: a row-local region's forward saves the boolean masks its sorts / top-k /
            scans make (bit-packed) for its backward (``rewrite/saved.py``); False recomputes.
        save_normalizers: a row-local region's forward saves each softmax's max and sum (two
            numbers a row) for its backward (``rewrite/saved.py``); False recomputes.
        lm_head_plan: the fused lm_head's backward plan: "auto" (by device) or one of
            ``LM_HEAD_PLANS`` to force it on any device (docs/gemms.md: each plan's GEMMs).
            "kept_logits" trades memory for time: a per-token call keeps its model-precision
            logits (``2 T V`` bytes, as stock's) and the backward writes their gradient in
            their place, three GEMMs a step instead of four (NOTE [kept logits]); a loss in
            the graph stays there, on that call (no gradients in the forward).  "auto"
            takes it on a GPU where stock keeps an FP32 ``[T, V]`` (a log-prob, an entropy)
            and no mask leaves rows out (``tiling.keeps_logits``); "gpu" forces the loops
            that recompute the logits (less memory, one GEMM more per token).  A
            vocab-parallel lm_head's loops have "gpu", "two_sweeps" and, in its one-pass
            loop with no mask, "kept_logits" (NOTE [kept shard logits]); any other runs
            "two_sweeps" (``kernels/log_softmax/shard.backward_loops``).
        gradients_in_forward: when a fused region's results reach the scalar loss only
            through row-local ops and sums / means (``match/loss_tail.py``), compute
            gradients in the forward's chunk loop (docs/how-it-works.md section 5b).
        skip_masked_rows: there, run the chunk loop (GEMMs included) only on the rows whose
            value and gradient the loss does not zero by a mask or ``ignore_index``; on the
            per-token path (CPUs), only the rows whose results something reads unmasked
            (``match/row_mask.py``; one host read a step; docs/how-it-works.md section 5c);
            in a vocab-parallel one-pass loop (CPUs), the rows every rank may leave out
            (``distributed/shard_mask.py``).
    """

    rewrite: bool = True
    temperature_after_upcast: bool = True
    remove_div_by_one: bool = True
    report_only: bool = False
    strict: bool = False
    upgrade_low_precision: bool = False
    fuse_lm_head: bool = True
    chunk_budget_mib: Optional[float] = None
    leave_to_stock: bool = True
    skip_masked_rows: bool = True
    lm_head_plan: str = "auto"
    row_local: bool = True
    row_local_sweeps: bool = True
    save_masks: bool = True
    save_normalizers: bool = True
    gradients_in_forward: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(
                    f"chunked_logits option {f.name!r} must be True or False, got {value!r}"
                )
        budget = self.chunk_budget_mib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not budget > 0):
            raise ValueError(
                f"chunked_logits option 'chunk_budget_mib' must be a positive number of MiB, "
                f"got {budget!r}; e.g. chunk_budget_mib=32"
            )

        if self.lm_head_plan not in LM_HEAD_PLANS:
            raise ValueError(
                f"chunked_logits option 'lm_head_plan' must be one of {', '.join(map(repr, LM_HEAD_PLANS))}, "
                f"got {self.lm_head_plan!r}; e.g. lm_head_plan='auto'"
            )

    @property
    def chunk_budget_bytes(self) -> int:
        """The budget in bytes; unset, 32 MiB (the chunk loops other than the lm_head's)."""
        return max(1, int((self.chunk_budget_mib or DEFAULT_BUDGET_MIB) * 2**20))

    @property
    def device_budget_bytes(self) -> int:
        """The lm_head and row-local loops' budget in bytes; unset, 0: the device's,
        chosen where the loop runs (``kernels.tiling.resolve_budget``)."""
        return self.chunk_budget_bytes if self.chunk_budget_mib is not None else 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **overrides: Any) -> "Config":
        """Build a Config from a user's options dict; unknown keys are a ValueError."""
        merged = dict(options or {})
        merged.update(overrides)
        names = [f.name for f in dataclasses.fields(cls)]
        for key in merged:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"unknown chunked_logits option {key!r}; {hint}valid options: "
                    f"{', '.join(names)} (Inductor settings go under options={{'inductor': {{...}}}})"
                )
        return cls(**merged)

    def key(self) -> str:
        """A stable text form, part of the pass's cache uuid."""
        return repr(dataclasses.astuple(self))

