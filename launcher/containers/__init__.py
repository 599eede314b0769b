"""`launch.py --local --containers`: the Space images built here and run as containers.

`engine` finds podman or docker, `bases` makes the stand-in base images, `images` builds each
Space's image from its staged context, `checks` holds Spaces' conventions, `run` runs it all.
"""
