"""Layer 7, the command line: `python -m deltasync` (`cli`), the demo, `export` and `check`.

May import: every layer.
"""
