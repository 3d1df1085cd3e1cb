"""The Hydra configs of the console entry points (package data; a package so Hydra finds it by name)."""
