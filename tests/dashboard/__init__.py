"""Dashboard tests (a package, so that this folder's conftest does not replace tests/conftest)."""
