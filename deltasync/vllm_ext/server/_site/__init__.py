"""Not imported as a package: this folder goes on PYTHONPATH so `sitecustomize` runs at start-up.

(The `__init__` only makes setuptools ship the folder with the package.)
"""
