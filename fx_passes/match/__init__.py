"""Finding regions in a Dynamo graph: ``upcast`` (the upcast and what leads to it),
``upcast_regions`` (upcast -> row views -> temperature -> log-probs / entropy / cross-entropy),
``region`` (what a match holds), ``lm_head`` (the matmul that makes a region's
logits), ``row_local`` (regions of ops that act on each row on their own) and
``loss_tail`` (from a fused lm_head call's per-row results to the scalar loss).  Knows
nothing of vocab-parallel regions.

May import: kernels, fx, reporting, config, env, compat."""
