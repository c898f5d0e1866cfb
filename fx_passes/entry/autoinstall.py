"""The environment switch: ``CHUNKED_LOGITS=1`` turns the pass on in any Python process.

``chunked_logits.pth`` (put into site-packages by ``pip install``) imports this module at
interpreter start when the switch is set.  It imports no torch and only registers a
post-import hook: when ``torch._inductor.config`` is first imported, the hook calls
:func:`fx_passes.entry.install.install_from_env`, which puts the passes into Inductor's
``pre_grad_custom_pass`` and arranges the exit summary.  The variables and their parsing
are in :mod:`fx_passes.env`.  See NOTE [interpreter start].
"""

# NOTE [interpreter start]
# ``chunked_logits.pth`` (put into site-packages by ``pip install``) runs, at every
# interpreter start::
#
#     import os; os.environ.get('CHUNKED_LOGITS') and __import__('fx_passes.entry.autoinstall')
#
# so with the switch unset nothing of this package is imported.  With it set, this
# module must stay cheap too (it runs before the user's program, in every Python
# process, including ``pip`` itself): it imports no torch.

from __future__ import annotations

import os
import sys
import warnings

from fx_passes import env

# The module whose import means "this process is about to compile with Inductor".
TRIGGER = "torch._inductor.config"


class _PostImportHooks:
    """A ``sys.meta_path`` entry that runs callbacks right after a module is imported.

    It finds the module's spec with the other finders and wraps that loader's
    ``exec_module`` once; it never changes what gets imported.
    """

    def __init__(self) -> None:
        self.hooks: dict[str, list] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        callbacks = self.hooks.pop(fullname)
        if not self.hooks and self in sys.meta_path:
            sys.meta_path.remove(self)
        original = loader.exec_module

        def exec_module(module):
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method
                except AttributeError:
                    pass
            for callback in callbacks:
                _safe_call(callback, module)

        loader.exec_module = exec_module
        return spec


_hooks = _PostImportHooks()


def _safe_call(callback, module) -> None:
    try:
        callback(module)
    except Exception as e:  # never break the user's import
        warnings.warn(f"chunked_logits: the environment switch could not install the pass: {e!r}",
                      stacklevel=2)


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        _safe_call(callback, module)
        return
    _hooks.hooks.setdefault(name, []).append(callback)
    if _hooks not in sys.meta_path:
        sys.meta_path.insert(0, _hooks)


def _install(_module) -> None:
    from fx_passes.entry.install import install_from_env

    install_from_env()


def check_options() -> None:
    """A bad ``CHUNKED_LOGITS_OPTIONS`` stops the process here, at its start, with the
    message: the pass was asked for, and a run without it (a training run, hours later
    found to have no pass and no summary) costs more than a process that does not start."""
    if not os.environ.get(env.OPTIONS, "").strip():
        return
    from fx_passes.config import Config  # torch-free

    try:
        Config.from_options(env.options())
    except ValueError as e:  # a JSON error is a ValueError too
        sys.stderr.write(f"chunked_logits: {env.OPTIONS}={os.environ[env.OPTIONS]!r} is not valid: {e}\n"
                         f"chunked_logits: this process stops here; fix {env.OPTIONS}, or unset "
                         f"{env.SWITCH} to run without the pass\n")
        sys.stderr.flush()
        # Not SystemExit: raised while site.py runs the .pth file, Python would add a
        # "Fatal Python error" and a traceback to the message; nothing has run to clean up.
        os._exit(2)


def activate() -> bool:
    """Arrange the install if the switch is on (and the kill switch off); a bad
    ``CHUNKED_LOGITS_OPTIONS`` ends the process (:func:`check_options`)."""
    if not env.switch_on() or env.disabled():
        return False
    check_options()
    when_imported(TRIGGER, _install)
    return True


activate()
