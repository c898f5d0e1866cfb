"""How users turn the pass on: the ``chunked_logits`` backend (``backend``), ``install()``
into stock Inductor (``install``), the ``chunked-logits run`` launcher (``launcher``) and
the ``CHUNKED_LOGITS=1`` switch (``autoinstall``, imported at interpreter start: this
``__init__`` imports nothing).

May import: pipeline, reporting, config, env, compat."""
