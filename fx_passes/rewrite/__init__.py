"""Editing a matched single-process region: ``logits`` (a region becomes one ``row_stats``
or lm_head loop call) and ``unit_scale`` (drop ``x / 1`` and ``x * 1``).

May import: match, kernels, fx, reporting, config, env, compat."""
