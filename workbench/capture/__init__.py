"""The capture room (adapters, probes, recorder, ...). The package is also callable:
``workbench.capture(model, inputs, names, max_bytes=...)`` is ``workbench.capture.cache.capture`` (the named
modules' outputs of one forward, without a store). The package's name and the function's are one, so the
function lives here as the module's ``__call__``; importing the package stays torch-free."""
from __future__ import annotations

import sys
import types


class _Capture(types.ModuleType):
    def __call__(self, model, inputs, names=None, **kw):
        """``workbench.capture.cache.capture``: ``{module path: output}`` of one forward of ``inputs``."""
        from workbench.capture.cache import capture  # lazy: imports torch; `import workbench` needs none
        return capture(model, inputs, names, **kw)


sys.modules[__name__].__class__ = _Capture
