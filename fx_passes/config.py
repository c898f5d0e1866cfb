"""Settings of the chunked-logits passes: one frozen, self-validating dataclass."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Optional

__all__ = ["Config", "LM_HEAD_PLANS"]

# The lm_head backward's plans (kernels/tiling.py says what each does); "auto" picks by device.
LM_HEAD_PLANS = ("auto", "two_sweeps", "fp32_tiles", "blocks", "gpu")
# The chunk budget of every loop on a CPU, and of all but the lm_head's on a GPU.
DEFAULT_BUDGET_MIB = 32


@dataclasses.dataclass(frozen=True)
class Config:
    """What the passes do.  Build it from ``torch.compile(..., options={...})``.

    Attributes:
        rewrite: rewrite matched FP32-upcast regions into the fused per-row form.
        temperature_after_upcast: where the graph divides the model-precision logits
            by a temperature right before the upcast, divide in FP32 after it instead.
            Turn off to keep the division (and its rounding) where the graph has it.
        remove_div_by_one: drop ``x / 1`` and ``x * 1`` everywhere in the graph.
        report_only: log and count what would be rewritten, change nothing.
        strict: re-raise an error inside the pass instead of falling back to stock
            Inductor (for debugging the pass itself).
        upgrade_low_precision: also rewrite a model-precision ``log_softmax`` /
            ``softmax`` / ``logsumexp`` / ``cross_entropy`` over the vocabulary (and a
            model-precision temperature division feeding it) as if the graph had
            upcast first: computed in FP32, per row, and returned in FP32.  This
            changes results (to the accurate ones) and dtypes on purpose, so it is off
            by default.
        fuse_lm_head: when the logits are ``hidden @ weight.T`` in the same graph and
            nothing else reads them, compute them chunk by chunk inside the region
            (``lm_head.py``) so even the model-precision ``[T, V]`` logits never exist
            (when the graph returns them, the loop writes them and the backward forms
            no ``[T, V]`` gradient).  The gradients are no less accurate than stock's,
            not always its bits; False keeps the matmul whole.
        chunk_budget_mib: working-set budget of one chunk of that loop: rows per
            forward chunk are ``budget / (4 V)``, vocabulary columns per backward
            block ``budget / (8 T)`` (``budget / (4 T)`` in the "gpu" plan).  None (the
            default): the device's (``kernels.tiling.device_budget``): 32 MiB on a CPU;
            for the lm_head loop, row-local regions and the vocab-parallel loops on a
            GPU 1/64 of its total memory, within 256 MiB and 2 GiB (2 GiB on an H200),
            the same on every step and rank, so that their GEMMs are large enough to
            run near peak and a step is not thousands of small chunks.
        row_local: a region the hand-derived path does not take (an op it does not
            know: a top-k / top-p mask, a distillation loss, label smoothing) runs as
            its own ops over chunks of rows when every op acts on each row on its own
            (``match/row_local.py``); False leaves such regions as they are.
        leave_to_stock: a row-local region on logits the graph is given whose every op
            stock Inductor fuses into its row reductions (``log_softmax``, sums, ``+ - * /``,
            ``exp`` / ``log``, ``kl_div``, a cross-entropy of class indices with weights
            or label smoothing: ``match/worth.py``) is left to stock, which holds no FP32
            ``[T, V]`` tensor there either and is faster; the summary says so.  False
            rewrites it too.
        row_local_sweeps: a row-local region whose logits an lm_head matmul in the graph
            makes (read by nothing else) runs that matmul chunk by chunk when the body's
            gradient is a pointwise function of the logits given a few per-row values
            (distillation, KL / JSD, label smoothing, a top-k mask:
            ``kernels/row_split.py``): neither the logits nor their gradient exists
            whole, for five ``[T, H] x [H, V]`` GEMMs a step against stock's three
            (``kernels/row_local_sweeps.py``).  False, or a body that does not split (a
            sort, a scan): the call runs the matmul whole and writes the logits'
            gradient over them (stock's memory and GEMMs).  A region that takes no
            gradient runs its matmul chunk by chunk whatever its body (off: whole).
        save_masks: a row-local region's forward saves the boolean masks its sorts /
            top-k / scans make (packed: ``V / 8`` bytes a row each) and its backward
            reads them instead of sorting again (``rewrite/saved.py``); False
            recomputes them (no saved bytes, the forward's work twice).
        save_normalizers: a row-local region's forward also returns the two reductions
            of each softmax / log_softmax its backward needs (the max and the sum of
            exponentials or its log: two numbers a row) and the backward computes their
            values pointwise from them (``rewrite/saved.py``); False recomputes the
            reductions.
        lm_head_plan: the fused lm_head's backward plan: "auto" (by device: "gpu" on
            CUDA/XPU where torch has ``mm(.., out_dtype=)`` for it, else "blocks";
            "two_sweeps" on CPUs that multiply bf16/fp16 in hardware, "fp32_tiles" on
            other CPUs), or one of those names to force it on any device (tests run
            every plan on one CPU this way; "gpu" needs the test-only CPU kernels of
            ``fx_passes.testing.gemms`` there, and runs "blocks" without them).
            docs/gemms.md: each plan's GEMMs and memory.
        gradients_in_forward: when a fused lm_head region's results reach the graph's
            scalar loss only through row-local ops and sums / means whose weights are
            known in the forward (``match/loss_tail.py``), the chunk loop also computes
            gradients in the forward: plan "gpu" all of them (3 GEMMs a step, kept in
            FP32 until the backward scales them by the incoming gradient and rounds
            once); "two_sweeps" ``grad_hidden``, with ``grad_weight`` from one
            vocabulary sweep in the backward (4 GEMMs; an incoming gradient that is not
            a power of two recomputes both).  Other plans, and False, recompute in the
            backward (docs/how-it-works.md section 5b).  The same for a row-local region
            whose lm_head runs chunk by chunk (``kernels/row_local_loss.py``): 4 GEMMs,
            3 on plan "gpu", instead of 5.
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

