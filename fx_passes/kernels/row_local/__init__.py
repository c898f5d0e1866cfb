"""The row-local engine: a region whose every result row depends only on its own row of the
logits runs over row chunks.  ``engine`` holds the one forward loop, the autograd setup and
gradient mapping shared by the ops, and the ``row_local`` op (logits given); each other op is
the engine with one piece chosen: ``head`` (the lm_head matmul made whole first, the backward
over the logits), ``sweeps`` (per-chunk logits, the backward in two sweeps over the body split
by ``split``) and ``loss`` (the gradients made in the forward with the loss).  ``bitmask``
and ``normalizers`` are what region bodies save for their backward."""
