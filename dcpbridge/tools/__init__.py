"""Offline tools on top of everything: the CLI, offline reshard, export to single-file formats, reports (inspect/validate)."""

from __future__ import annotations

import sys

from dcpbridge.formats import config

# ``dcpbridge.tools.config`` (named by earlier READMEs) is the module now in dcpbridge.formats
sys.modules[f"{__name__}.config"] = config
