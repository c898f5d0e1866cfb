"""Finding regions in a Dynamo graph: ``upcast`` (the upcast and what leads to it),
``logits`` (upcast -> row views -> temperature -> log-probs / entropy / cross-entropy),
``region`` (what a match holds) and ``lm_head`` (the matmul that makes a region's
logits).  Knows nothing of vocab-parallel regions.

May import: kernels, fx, reporting, config, env, compat."""
