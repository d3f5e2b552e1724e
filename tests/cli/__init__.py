"""Tests of the app's top-level modules: the command line, python -m app end to end, and the library notices."""
