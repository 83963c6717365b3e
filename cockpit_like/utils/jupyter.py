"""Whether this runs in a Jupyter kernel: where the dashboard is an image display and progress bars are shown.

Only the standard library is imported here; IPython is looked up in ``sys.modules`` (a kernel has imported it).
"""

from __future__ import annotations

import sys

__all__ = ["in_jupyter_kernel"]


def in_jupyter_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (ipykernel: Jupyter, JupyterLab, VS Code, a remote kernel).

    Looks at the running IPython shell, not at matplotlib's backend: a kernel
    has a frontend that shows images even when the backend (``inline``) opens
    no window. A plain ``ipython`` terminal is not a kernel. IPython is not
    imported here: where no IPython runs, it is not in ``sys.modules``.
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # an IPython that is half imported or torn down
        return False
    if shell is None:
        return False
    return getattr(shell, "kernel", None) is not None or "IPKernelApp" in getattr(shell, "config", {})
