"""`python -m deltasync export`: a committed version as a model repository.

`version` runs it; `model_files` finds the config and tokenizer; `weights` replays and writes
(the tensor side, loaded on first use); `hub` is the Hub's part.
"""
