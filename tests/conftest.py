"""Root conftest: its folder (tests/) goes on sys.path, so test modules can import the shared
helpers in `model_steps.py`. (Conftest modules all share the import name `conftest`, so they are
not importable helpers themselves.)"""
