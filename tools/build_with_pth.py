"""PEP 517 build backend: setuptools, plus ``chunked_logits.pth`` in every wheel.

The .pth file is the environment switch: at interpreter start, site.py runs its one
line, which imports ``fx_passes.entry.autoinstall`` only when ``CHUNKED_LOGITS`` is set
(and otherwise costs one ``os.environ`` look-up).  setuptools has no option to put
a file at the root of site-packages for both a normal and an editable
(``pip install -e .``) install, so this backend lets setuptools build the wheel and
then adds the file (and its line in RECORD) to it.  Everything else is setuptools'.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F403  (the rest of the PEP 517/660 hooks)

PTH_NAME = "chunked_logits.pth"
PTH_TEXT = ("import os; os.environ.get('CHUNKED_LOGITS') and "
            "__import__('fx_passes.entry.autoinstall')\n")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def add_pth(wheel_path: str) -> None:
    """Add ``chunked_logits.pth`` at the root of the wheel (the root is site-packages)."""
    data = PTH_TEXT.encode()
    with zipfile.ZipFile(wheel_path) as src:
        if PTH_NAME in src.namelist():
            return
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename == record:
                continue
            dst.writestr(info, src.read(info.filename))
        dst.writestr(zipfile.ZipInfo(PTH_NAME, date_time=(1980, 1, 1, 0, 0, 0)), data,
                     compress_type=zipfile.ZIP_DEFLATED)
        text = src.read(record).decode()
        if not text.endswith("\n"):
            text += "\n"
        lines = text.splitlines(keepends=True)
        own = next((i for i, ln in enumerate(lines) if ln.startswith(record + ",")), len(lines))
        lines.insert(own, _record_line(PTH_NAME, data))
        info = src.getinfo(record)
        dst.writestr(info, "".join(lines))
    os.replace(tmp, wheel_path)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _orig.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _orig.build_editable(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name
