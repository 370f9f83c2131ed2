"""The command line (the top layer): torchrun plumbing the examples share (``launch.py``: one-line user
errors, Ctrl-C, start-up, checks of flags before anything loads). Nothing below imports it.
"""
