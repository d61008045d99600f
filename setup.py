"""Build script. Native parts are optional: the package installs and imports without them."""
from setuptools import setup

setup()
