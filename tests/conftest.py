"""Session-wide test settings."""

import os

# Triton kernels run on CPU only through the interpreter, which must be chosen before triton's
# first import (triton.language decorates its own functions at import time).
os.environ.setdefault("TRITON_INTERPRET", "1")

# Reports fit their tables to COLUMNS when it is exported (backends.report.text): tests compare whole
# lines, so they run at no width limit unless a test sets one itself.
os.environ.pop("COLUMNS", None)
