"""FreeToken: a one-process, OpenAI-compatible inference server for scoring clients.

Importing the package loads nothing heavy; see docs/architecture.md for the module map.
"""

__version__ = "0.1.0"
