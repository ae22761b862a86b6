"""rankfs: a FUSE filesystem that serves each inference-engine rank a virtual checkpoint holding only
the tensors it loads (its experts, pre-sliced), and a hook that loads them at the disk's speed.

Importing the package imports nothing else: the engine hook's start-up path must stay light.
"""
