"""The config schema and checks every entry point shares (the main job, the server, the training scripts).

``schema`` holds the sections (frozen dataclasses mirrored by conf/) and ``parse_section``; ``checks`` the
value checks; ``model`` turns the model section into a checkpoint dir and an engine.
"""
