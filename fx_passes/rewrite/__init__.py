"""Editing a matched single-process region: ``upcast_region`` (a region becomes one ``row_stats``
or lm_head loop call), ``row_local`` (a row-local region becomes one ``row_local`` call;
``row_local_body``: the body it runs; ``slice_first``: a slice of its upcast's rows moved
before the upcast), ``loss_tail`` (a fused lm_head call and its loss
tail become one ``lm_head_loss`` call; ``tail_graphs``: the tail's FX graphs), ``skip_rows``
(a call whose results the graph keeps leaves out the rows a mask leaves unread) and
``unit_scale`` (drop ``x / 1`` and ``x * 1``).

May import: match, kernels, fx, reporting, config, env, compat."""
