"""The modes a plain `open` or `mkdir` gives a new file or directory (0666 or 0777 less the umask), for
writers whose own way of creating leaves them private (mkstemp, mkdtemp, safetensors' save_file: 0600)."""

from __future__ import annotations

import os


def _umask() -> int:
    mask = os.umask(0)          # the umask has no getter: set it, and set it back
    os.umask(mask)
    return mask


def plain_file_mode() -> int:
    return 0o666 & ~_umask()


def plain_dir_mode() -> int:
    return 0o777 & ~_umask()
