"""How the package's custom ops are built: ``args`` (each op's arguments by name: a flat schema
unpacked into named types, an emitted call read by parameter name), ``pair`` (each op's
autograd by name: what the forward saves, what the backward reads and passes on),
``registry`` (the run-time registries and ``@emitted``, the mark on every function a rewritten
graph calls), ``body_compiler`` (the one way a chunk body is compiled) and ``user_bodies``
(bodies made of the user's own ops: vocab-parallel stages and row-local regions)."""
