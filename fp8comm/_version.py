"""The package version, in a module of its own so any layer can read it without importing the package's top level
(which names every layer).
"""

__version__ = "0.4.0"
