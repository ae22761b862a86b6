"""The directory `rankfs run` puts on an engine's PYTHONPATH: its sitecustomize starts the hook."""
