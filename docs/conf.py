"""Sphinx configuration of the moe-rl documentation (Markdown sources through MyST).

Build: `python -m sphinx -W -b html docs docs/_build/html` (no network needed). The config-key and CLI reference
pages are generated at build time by `_ext/moe_rl_docs.py` from `moe_rl.config.describe_keys` and the tools'
`--help` output.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "moe-rl"
author = "moe-rl authors"
copyright = "moe-rl authors, Apache License 2.0"
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "moe_rl_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

myst_enable_extensions = ["dollarmath", "deflist", "colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "furo"
html_title = "moe-rl"
html_show_sourcelink = False
