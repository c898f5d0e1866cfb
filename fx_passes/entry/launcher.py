"""The launcher: ``chunked-logits run [options] -- script.py args...``.

Also ``python -m fx_passes run ...``, and as the program under torchrun::

    torchrun --nproc-per-node 8 -m fx_passes run -- train.py --lr 1e-5
    torchrun --nproc-per-node 8 --no-python chunked-logits run -- train.py --lr 1e-5

It turns the pass on for the stock ``inductor`` backend (as ``CHUNKED_LOGITS=1``
does), runs the script as ``__main__`` with its arguments (like ``python script.py``
or ``python -m module``), and at exit prints what was rewritten.  The options are
the Config fields; they are also exported (``CHUNKED_LOGITS=1``,
``CHUNKED_LOGITS_OPTIONS``) so that Python subprocesses of the script get the pass
too, when the package's ``chunked_logits.pth`` is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
import sys
from typing import Any, Optional, Sequence

from .. import __version__, env
from ..config import LM_HEAD_PLANS, Config
from ..reporting import summary
from . import autoinstall as _autoinstall

__all__ = ["main", "build_parser", "config_options"]


def plain(text: str) -> str:
    """Docstring text as plain text for a terminal: no reST roles or literal markup."""
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", text)  # :mod:`x`, :func:`~a.b`
    return text.replace("``", "").replace("`", "")


def _field_help() -> dict[str, str]:
    """Config attribute descriptions, read from its docstring's ``Attributes:`` list, as plain text."""
    out: dict[str, str] = {}
    name = None
    for line in (Config.__doc__ or "").splitlines():
        m = re.match(r"\s{8}(\w+): (.*)", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2).strip()
        elif name and re.match(r"\s{12}\S", line):
            out[name] += " " + line.strip()
        else:
            name = None
    return {k: plain(v) for k, v in out.items()}


def _field_type(f: dataclasses.Field) -> type:
    """The type a Config field's flag parses (its annotation, which may be a string)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return float if "float" in kind else int if "int" in kind else str


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pass options (Config fields; default in brackets)")
    helps = _field_help()
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        text = helps.get(f.name, "").replace("%", "%%")
        if isinstance(default, bool):
            group.add_argument(flag, dest="cfg_" + f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=f"{text} [{'on' if default else 'off'}]")
        elif f.name == "lm_head_plan":
            group.add_argument(flag, dest="cfg_" + f.name, choices=LM_HEAD_PLANS, default=None,
                               help=f"{text} [{default}]")
        else:
            kind = _field_type(f)
            group.add_argument(flag, dest="cfg_" + f.name, type=kind, default=None,
                               metavar=kind.__name__.upper(), help=f"{text} [{default}]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunked-logits",
        description="Turn the chunked-logits pass on for torch.compile's stock inductor backend "
                    "around unmodified code.")
    parser.add_argument("--version", action="version", version=f"chunked-logits {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run a Python script or module with the pass installed",
        usage="chunked-logits run [options] -- script.py [args...]\n"
              "       chunked-logits run [options] -- -m module [args...]",
        description="Install the pass into the stock inductor backend, run the script as __main__ "
                    "with its arguments, print a summary of what was rewritten at exit.")
    _add_config_flags(run)
    out = run.add_argument_group("exit summary")
    out.add_argument("--summary", choices=summary.MODES, default="always",
                     help="print the summary to stderr at exit: always (default), auto (only if "
                          "something was compiled), never")
    out.add_argument("--summary-ranks", choices=("0", "all"), default=None,
                     help="under torchrun: only rank 0 prints (default), or every rank (use with "
                          "torchrun --redirects/--log-dir so each rank has its own log)")
    out.add_argument("--summary-dir", metavar="DIR", default=None,
                     help="also write each rank's summary to DIR/chunked_logits.rank<N>.txt")
    out.add_argument("--summary-json", metavar="PATH", default=None,
                     help="write counters and events as JSON to PATH ({rank} and {pid} are replaced)")
    run.add_argument("target", nargs=argparse.REMAINDER,
                     help="-- script.py args...  or  -- -m module args...")
    parser.run_parser = run  # main() reports run's errors with run's usage
    return parser


def config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Config fields given on the command line (the others keep their defaults)."""
    return {f.name: getattr(args, "cfg_" + f.name) for f in dataclasses.fields(Config)
            if getattr(args, "cfg_" + f.name, None) is not None}


def _run_target(target: list[str]) -> None:
    if target[0] == "-m":
        if len(target) < 2:
            raise SystemExit("chunked-logits run: -m needs a module name")
        module, rest = target[1], target[2:]
        sys.argv = [module, *rest]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()  # like `python -m module`
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = target[0], target[1:]
    if not os.path.exists(script):
        raise SystemExit(f"chunked-logits run: can't open file {script!r}: no such file")
    sys.argv = [script, *rest]
    # Like `python script.py`: the script's folder, not the launcher's, is sys.path[0].
    here = os.path.dirname(os.path.abspath(script)) if os.path.isfile(script) else os.path.abspath(script)
    sys.path[0] = here
    runpy.run_path(script, run_name="__main__")


def _install_later(options: dict[str, Any]) -> None:
    def install(_module: Any) -> None:
        from .install import install as do_install

        do_install(**options)

    _autoinstall.when_imported(_autoinstall.TRIGGER, install)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Everything after "--" (or after the script name) belongs to the script.
    if "--" in argv:
        cut = argv.index("--")
        ours, target = argv[:cut], argv[cut + 1:]
    else:
        ours, target = argv, None
    args, extra = parser.parse_known_args(ours if target is not None else argv)
    run = parser.run_parser  # the only command: its errors come with its usage
    if extra:
        run.error(f"unrecognized arguments: {' '.join(extra)}")
    if target is None:
        target = [a for a in (args.target or []) if a != "--"]
    elif args.target:
        run.error(f"unexpected arguments before '--': {' '.join(args.target)}")
    if not target:
        run.error("missing the script: chunked-logits run [options] -- script.py [args...]")
    options = config_options(args)
    try:
        config = Config.from_options(options)  # validate before running anything
    except ValueError as e:
        run.error(str(e))

    summary.configure(mode=args.summary, ranks=args.summary_ranks or env.summary_ranks(),
        directory=args.summary_dir,
        json_path=args.summary_json, lock=True)
    summary.arm()
    if env.disabled():
        if summary.rank() in (None, 0):
            sys.stderr.write("chunked_logits: CHUNKED_LOGITS_DISABLE=1 is set: running the script "
                             "without the pass\n")
    else:
        # Python subprocesses of the script (spawned workers, ...) turn it on the same way.
        env.export(dataclasses.asdict(config))
        _install_later(dataclasses.asdict(config))
    _run_target(target)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
